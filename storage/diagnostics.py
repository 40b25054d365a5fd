"""Diagnostics of recorded experience: what ``rlhf inspect`` prints, as polars expressions over the stage shards.

Every function here is pure: lazy frames (``pl.scan_parquet`` of the shards, ``pl.scan_ndjson`` of evaluation
samples) and scalars in, lazy frames or small data frames out. A summary reads only the columns it needs and
collects one row per run, so a campaign of any size is summarised in bounded memory.

Choices:

1. A rollout's ``reward`` is the sum of its per-token shaped rewards and its ``kl`` the sum over its tokens of
   k1 = ``old_logprobs - ref_logprobs``: per response, as ``compute_advantages`` and ``evaluate`` report them.
   ``negative_kl_share`` is per token: the share of response tokens whose k1 is below 0 (k1 is unbiased but not
   positive per sample; a share near 1/2 says the policy has barely moved, one far below it that it has).
2. Means and sample standard deviations (ddof 1) are over rollouts; the length quantiles interpolate linearly
   (numpy's default). Advantage mean and std are over tokens, from per-rollout sums in float64.
3. A response is truncated when it holds ``max_new_tokens`` tokens and its last is not EOS.
6. A multi-turn episode's row (``action_mask`` not null, docs/environments.md) counts the model's tokens only: its
   length, KL and advantage are over the tokens its ``action_mask`` marks, never the environment's replies between
   them (an episode kept out of the loss has none). It is never truncated: its turns and stop reason say how it
   ended (``rlhf inspect`` shows them, turn by turn).
4. A group is the rollouts of one prompt (``prompt_id``). Its spread is max - min of ``scores``: a group whose
   samples all scored the same gives every one of them advantage 0 under GRPO, Dr. GRPO and RLOO, so
   ``zero_spread_share`` is the share of the rollout the group estimators learn nothing from. It is null when no
   prompt was sampled twice.
5. Drift flags compare each iteration with the one ``window`` iterations earlier (:class:`DriftThresholds`);
   consecutive flagged iterations are reported as one span, with the figures at its two ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import polars as pl

from storage.schemas import (
    ACTION_MASK,
    ADVANTAGES,
    OLD_LOGPROBS,
    PAIR_ID,
    PROMPT_ID,
    REF_LOGPROBS,
    RESPONSE_IDS,
    REWARDS,
    ROW,
    SCORES,
)

_F64 = pl.List(pl.Float64)

#: The per-iteration summary's columns, in print order, with what each means (``docs/inspect.md`` says more).
SUMMARY_COLUMNS: dict[str, str] = {
    "iteration": "the iteration",
    "run": "`iteration`, or `replay <run id>` for a replay of it",
    "estimator": "the advantage estimator that scored the experience",
    "candidates": "candidate responses sampled for labelling",
    "pairs": "preference pairs labelled in the iteration",
    "rollouts": "rollouts in the experience",
    "length_mean": "response length in tokens: mean",
    "length_p50": "response length: median",
    "length_p95": "response length: 95th percentile",
    "truncated_share": "share of responses cut at max_new_tokens (no EOS)",
    "score_mean": "reward source's score of a rollout: mean",
    "score_std": "score: standard deviation",
    "reward_mean": "a rollout's shaped reward (score less the KL penalty, summed): mean",
    "reward_std": "shaped reward: standard deviation",
    "kl_mean": "KL to the reference, k1 summed over a response: mean",
    "negative_kl_share": "share of response tokens whose k1 is negative",
    "entropy": "the policy's entropy during the PPO update (per token)",
    "advantage_mean": "advantage over tokens: mean",
    "advantage_std": "advantage over tokens: standard deviation",
    "zero_spread_share": "share of prompt groups whose samples all scored the same",
    "rm_accuracy": "reward model's accuracy on its held-out pairs",
    "heldout_score_mean": "reward source's score of the policy on held-out prompts: mean",
    "gold_mean": "gold judge's score of the policy on held-out prompts: mean",
    "logps_chosen": "DPO: the updated policy's log-prob of a pair's chosen response (summed over it): mean",
    "logps_rejected": "DPO: its log-prob of the rejected response: mean",
    "ref_logps_chosen": "DPO: the reference's log-prob of the chosen response: mean",
    "ref_logps_rejected": "DPO: the reference's log-prob of the rejected response: mean",
    "reward_accuracy": "DPO: share of pairs whose chosen response has the higher implicit reward",
    "reward_margin": "DPO: implicit reward of the chosen response less the rejected one's: mean",
}

PAIR_COLUMNS = (
    "pair_id", "reward_margin", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected",
    "ref_logps_chosen", "ref_logps_rejected", "chosen_tokens", "rejected_tokens",
)  # fmt: skip
"""The columns of each pair a DPO update trained on (:func:`pair_frame`)."""


def rollout_frame(scored: pl.LazyFrame, *, max_new_tokens: int, eos_token_id: int | None) -> pl.LazyFrame:
    """One row per rollout of a scored-experience table, the figures the summary and the filters use.

    Args:
        scored: a ``scored_experience`` scan (:data:`storage.schemas.SCORED_EXPERIENCE`).
        max_new_tokens: the rollout's generation limit.
        eos_token_id: the tokenizer's EOS; None counts every response of ``max_new_tokens`` tokens as truncated.

    Returns:
        Columns ``row``, ``prompt_id``, ``length``, ``truncated``, ``score``, ``reward``, ``kl``,
        ``negative_kl_tokens``, ``advantage`` (the rollout's mean over its model tokens) and the float64 sums
        ``advantage_sum``, ``advantage_square_sum`` (choice 6: an episode's model tokens only).
    """
    every_token = pl.col(RESPONSE_IDS).list.eval(pl.element().is_not_null())  # a single-turn row's mask
    if ACTION_MASK in scored.collect_schema().names():  # schema 7: an episode's row has one
        episode, model = pl.col(ACTION_MASK).is_not_null(), pl.coalesce(pl.col(ACTION_MASK), every_token)
    else:
        episode, model = pl.lit(False), every_token
    weight = model.cast(_F64)  # 1.0 at the model's tokens, 0.0 at the environment's
    length = model.list.sum()
    ends_without_eos = (
        pl.lit(True) if eos_token_id is None else pl.col(RESPONSE_IDS).list.last().ne_missing(eos_token_id)
    )
    k1 = (pl.col(OLD_LOGPROBS).cast(_F64) - pl.col(REF_LOGPROBS).cast(_F64)) * weight
    advantages = pl.col(ADVANTAGES).cast(_F64) * weight
    return scored.select(
        pl.col(ROW),
        pl.col(PROMPT_ID),
        length.cast(pl.Int64).alias("length"),
        (~episode & (length == max_new_tokens) & ends_without_eos).alias("truncated"),
        pl.col(SCORES).cast(pl.Float64).alias("score"),
        pl.col(REWARDS).cast(_F64).list.sum().alias("reward"),
        k1.list.sum().alias("kl"),
        k1.list.eval(pl.element() < 0).list.sum().cast(pl.Int64).alias("negative_kl_tokens"),
        pl.when(length > 0).then(advantages.list.sum() / length).alias("advantage"),
        advantages.list.sum().alias("advantage_sum"),
        (advantages * advantages).list.sum().alias("advantage_square_sum"),
    )


def summarize_rollouts(rollouts: pl.LazyFrame) -> pl.LazyFrame:
    """The one-row summary of a :func:`rollout_frame`: counts, length, score, reward, KL and advantage figures.

    Advantage std over tokens: ``sqrt((sum a^2 - (sum a)^2 / n) / (n - 1))`` with ``n`` the number of tokens.
    """
    tokens = pl.col("length").sum()
    advantage_sum = pl.col("advantage_sum").sum()
    return rollouts.select(
        pl.len().cast(pl.Int64).alias("rollouts"),
        pl.col("length").mean().alias("length_mean"),
        pl.col("length").quantile(0.5, interpolation="linear").alias("length_p50"),
        pl.col("length").quantile(0.95, interpolation="linear").alias("length_p95"),
        pl.col("truncated").mean().alias("truncated_share"),
        pl.col("score").mean().alias("score_mean"),
        pl.col("score").std().alias("score_std"),
        pl.col("reward").mean().alias("reward_mean"),
        pl.col("reward").std().alias("reward_std"),
        pl.col("kl").mean().alias("kl_mean"),
        (pl.col("negative_kl_tokens").sum() / tokens).alias("negative_kl_share"),
        (advantage_sum / tokens).alias("advantage_mean"),
        ((pl.col("advantage_square_sum").sum() - advantage_sum * advantage_sum / tokens) / (tokens - 1))
        .clip(lower_bound=0.0)
        .sqrt()
        .alias("advantage_std"),
    )


def group_spread(rollouts: pl.LazyFrame) -> pl.LazyFrame:
    """One row: ``zero_spread_share``, the share of prompt groups of two or more rollouts whose scores are all
    equal (null when no prompt has two rollouts)."""
    groups = rollouts.group_by(PROMPT_ID).agg(
        pl.len().alias("size"), (pl.col("score").max() - pl.col("score").min()).alias("spread")
    )
    return groups.filter(pl.col("size") >= 2).select(
        (pl.col("spread") == 0).mean().cast(pl.Float64).alias("zero_spread_share")
    )


def summarize_evaluation(samples: pl.LazyFrame) -> pl.LazyFrame:
    """One row from evaluation samples (``samples.jsonl``): ``heldout_score_mean`` (the reward source's score of the
    policy's responses) and ``gold_mean`` (the gold judge's; null where no judge scored them)."""
    names = samples.collect_schema().names()
    gold = pl.col("policy_gold").cast(pl.Float64).mean() if "policy_gold" in names else pl.lit(None, pl.Float64)
    return samples.select(
        pl.col("policy_reward").cast(pl.Float64).mean().alias("heldout_score_mean"), gold.alias("gold_mean")
    )


def pair_frame(reference: pl.LazyFrame, measures: pl.LazyFrame) -> pl.LazyFrame:
    """Each pair a DPO update trained on (:data:`PAIR_COLUMNS`): the reference's log-probs of its two responses (a
    ``reference_logprobs`` scan) beside the updated policy's and their implicit rewards (the update's
    ``pair_measures``), by ``pair_id``; ``reward_margin`` is the chosen response's implicit reward less the
    rejected one's (DPO's ``rewards/margins`` per pair)."""
    sides = ("chosen", "rejected")
    references = reference.select(
        pl.col(PAIR_ID),
        *(pl.col(f"{REF_LOGPROBS}_{side}").cast(pl.Float64).alias(f"ref_logps_{side}") for side in sides),
        *(pl.col(f"{side}_tokens").cast(pl.Int64) for side in sides),
    )
    policy = measures.select(
        pl.col(PAIR_ID), *(pl.col(f"{name}_{side}").cast(pl.Float64) for name in ("logps", "rewards") for side in sides)
    )
    pairs = references.join(policy, on=PAIR_ID, how="inner", maintain_order="left")
    return pairs.with_columns(reward_margin=pl.col("rewards_chosen") - pl.col("rewards_rejected")).select(PAIR_COLUMNS)


def summarize_pairs(pairs: pl.LazyFrame) -> pl.LazyFrame:
    """One row from a :func:`pair_frame`: the means of both sides' log-probs (the policy's and the reference's), the
    share of pairs the implicit reward orders rightly (``reward_accuracy``, DPO's ``rewards/accuracies``) and the
    mean ``reward_margin``."""
    means = ("logps_chosen", "logps_rejected", "ref_logps_chosen", "ref_logps_rejected", "reward_margin")
    return pairs.select(
        *(pl.col(name).mean() for name in means),
        (pl.col("rewards_chosen") > pl.col("rewards_rejected")).cast(pl.Float64).mean().alias("reward_accuracy"),
    )


def filter_rollouts(rollouts: pl.LazyFrame, where: str | None) -> pl.LazyFrame:
    """The rollouts matching a SQL condition over their columns (``"length >= 8 and score > 0.5"``); all for None.

    Raises:
        ValueError: ``where`` is not a condition polars can parse, or names a column that does not exist.
    """
    if not where:
        return rollouts
    try:
        condition = pl.sql_expr(where)
    except Exception as error:  # noqa: BLE001 - polars raises its own SQL error types
        raise ValueError(f"`--where` {where!r} is not a SQL condition: {_first_line(error)}") from error
    names = set(rollouts.collect_schema().names())
    if unknown := sorted(set(condition.meta.root_names()) - names):
        raise ValueError(f"`--where` names no column {', '.join(unknown)}: the columns are {', '.join(sorted(names))}")
    return rollouts.filter(condition)


def top_rollouts(rollouts: pl.LazyFrame, *, by: str, count: int) -> pl.LazyFrame:
    """The ``count`` rollouts with the highest ``by`` (ties in their stored order).

    Raises:
        ValueError: ``by`` is not a column.
    """
    names = rollouts.collect_schema().names()
    if by not in names:
        raise ValueError(f"`--by` {by!r} is not a column: choose one of {', '.join(names)}")
    return rollouts.sort(by, descending=True, nulls_last=True, maintain_order=True).head(count)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# Drift flags ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DriftThresholds:
    """When the summary flags drift; each is settable with ``rlhf inspect --threshold NAME=VALUE``."""

    window: int = 2
    """Compare each iteration with the one this many iterations earlier (fewer in a shorter campaign)."""
    length_rise: float = 0.2
    """Length drift: the mean response length rose by at least this fraction ..."""
    gold_gain: float = 0.01
    """... while the gold score gained less than this (the gold judge's units). Also the gold stall of the
    reward-model drift."""
    kl_rise: float = 0.5
    """KL drift: the KL to the reference (k1 per response) rose by at least this many nats ..."""
    kl_per_score: float = 1.0
    """... and by more than this many nats per unit of score gained."""
    entropy_floor: float = 0.5
    """Entropy collapse: the policy's entropy fell below this fraction of the first inspected iteration's."""
    score_rise: float = 0.05
    """Reward-model drift: the held-out score rose by at least this while the gold score gained less than
    ``gold_gain``."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"`window` must be at least 1, got {self.window}")
        for field in fields(self):
            value = getattr(self, field.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"`{field.name}` must be a finite number >= 0, got {value}")

    @classmethod
    def parse(cls, settings: list[str]) -> DriftThresholds:
        """Thresholds from ``NAME=VALUE`` strings; the rest keep their defaults.

        Raises:
            ValueError: an unknown name, a value that is not a number, or one out of range.
        """
        names = [field.name for field in fields(cls)]
        values: dict[str, float | int] = {}
        for setting in settings:
            name, _, text = setting.partition("=")
            if name not in names:
                raise ValueError(f"`--threshold` {setting!r}: no threshold {name!r}; one of {', '.join(names)}")
            try:
                values[name] = int(text) if name == "window" else float(text)
            except ValueError:
                raise ValueError(f"`--threshold` {setting!r}: {text!r} is not a number") from None
        return cls(**values)


@dataclass(frozen=True)
class DriftFlag:
    """One warning: its kind, the first and last iteration it spans, and what it saw, in words."""

    kind: str
    first: int
    last: int
    message: str


def _spans(flagged: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive positions: ``[1, 2, 3, 7]`` -> ``[(1, 3), (7, 7)]``."""
    spans: list[tuple[int, int]] = []
    for position in flagged:
        if spans and spans[-1][1] == position - 1:
            spans[-1] = (spans[-1][0], position)
        else:
            spans.append((position, position))
    return spans


def _present(rows: list[dict], *columns: str) -> bool:
    return all(row.get(column) is not None and math.isfinite(row[column]) for row in rows for column in columns)


def _length_drift(a: dict, b: dict, t: DriftThresholds) -> str | None:
    if b["length_mean"] >= a["length_mean"] * (1 + t.length_rise) and _gain(a, b, "gold_mean") < t.gold_gain:
        return (
            f"response length climbed {_change(a, b, 'length_mean', relative=True)} while the gold score stalled "
            f"({_change(a, b, 'gold_mean')})"
        )
    return None


def _kl_drift(a: dict, b: dict, t: DriftThresholds) -> str | None:
    kl = _gain(a, b, "kl_mean")
    if kl >= t.kl_rise and kl > t.kl_per_score * max(_gain(a, b, "score_mean"), 0.0):
        return (
            f"KL to the reference grew faster than the score: KL {_change(a, b, 'kl_mean')} nats, "
            f"score {_change(a, b, 'score_mean')}"
        )
    return None


def _reward_model_drift(a: dict, b: dict, t: DriftThresholds) -> str | None:
    if _gain(a, b, "heldout_score_mean") >= t.score_rise and _gain(a, b, "gold_mean") < t.gold_gain:
        return (
            "the reward's held-out score rose away from the gold score (over-optimisation): "
            f"score {_change(a, b, 'heldout_score_mean')}, gold {_change(a, b, 'gold_mean')}"
        )
    return None


_WINDOWED_CHECKS = (
    ("length", ("length_mean", "gold_mean"), _length_drift),
    ("kl", ("kl_mean", "score_mean"), _kl_drift),
    ("reward_model", ("heldout_score_mean", "gold_mean"), _reward_model_drift),
)
"""Kind, the summary columns it needs, and the check of one iteration ``b`` against ``a``, ``window`` before it."""


def _entropy_flags(rows: list[dict], t: DriftThresholds) -> list[DriftFlag]:
    start = rows[0]
    if not _present(rows, "entropy") or start["entropy"] <= 0:
        return []
    low = [i for i in range(1, len(rows)) if rows[i]["entropy"] < t.entropy_floor * start["entropy"]]
    flags = []
    for first, last in _spans(low):
        lowest = min(rows[first : last + 1], key=lambda row: row["entropy"])
        message = (
            f"policy entropy collapsed: {lowest['entropy']:.3g} at iteration {lowest['iteration']}, "
            f"{lowest['entropy'] / start['entropy']:.0%} of iteration {start['iteration']}'s {start['entropy']:.3g} "
            f"(floor {t.entropy_floor:.0%})"
        )
        flags.append(DriftFlag("entropy", rows[first]["iteration"], rows[last]["iteration"], message))
    return flags


def drift_flags(summary: pl.DataFrame, thresholds: DriftThresholds | None = None) -> list[DriftFlag]:
    """The drift warnings of a per-iteration summary (its ``run == "iteration"`` rows, by iteration).

    Each windowed check compares iteration ``t`` with ``t - w`` (``w = min(window, iterations - 1)``) and flags
    ``t``; a run of flagged iterations becomes one :class:`DriftFlag` spanning ``first - w`` to ``last``:

    * ``length``: ``length_mean`` rose by at least ``length_rise`` (relative) while ``gold_mean`` gained less
      than ``gold_gain``;
    * ``kl``: ``kl_mean`` rose by at least ``kl_rise`` and by more than ``kl_per_score`` times the gain of
      ``score_mean``;
    * ``reward_model``: ``heldout_score_mean`` rose by at least ``score_rise`` while ``gold_mean`` gained less
      than ``gold_gain`` (the reward model's score leaving the gold score behind: over-optimisation);
    * ``entropy``: ``entropy`` is below ``entropy_floor`` times the first iteration's (no window).

    A check whose columns are missing or null (no gold judge, no entropy recorded) flags nothing.
    """
    t = thresholds or DriftThresholds()
    rows = summary.filter(pl.col("run") == "iteration").sort("iteration").to_dicts()
    if len(rows) < 2:
        return []
    w = min(t.window, len(rows) - 1)
    flags: list[DriftFlag] = []
    for kind, columns, check in _WINDOWED_CHECKS:
        if not _present(rows, *columns):
            continue
        flagged = [i for i in range(w, len(rows)) if check(rows[i - w], rows[i], t)]
        for first, last in _spans(flagged):
            before, after = rows[first - w], rows[last]
            message = check(before, after, t) or _span_message(kind, before, after)
            flags.append(DriftFlag(kind, before["iteration"], after["iteration"], message))
    return flags + _entropy_flags(rows, t)


def _span_message(kind: str, before: dict, after: dict) -> str:
    """A span's figures when its two ends, compared directly, would not pass the check (a dip and a recovery)."""
    columns = next(columns for name, columns, _ in _WINDOWED_CHECKS if name == kind)
    return f"{kind} drift: " + ", ".join(f"{column} {_change(before, after, column)}" for column in columns)


def _gain(before: dict, after: dict, column: str) -> float:
    return after[column] - before[column]


def _change(before: dict, after: dict, column: str, *, relative: bool = False) -> str:
    """``"+0.42 (1.10 -> 1.52)"``, or with ``relative`` ``"+38% (1.10 -> 1.52)"``."""
    a, b = before[column], after[column]
    delta = f"{(b - a) / a:+.0%}" if relative and a else f"{b - a:+.3g}"
    return f"{delta} ({a:.3g} -> {b:.3g})"


def describe_flag(flag: DriftFlag) -> str:
    """``"iterations 3-7: <message>"``."""
    span = f"iteration {flag.first}" if flag.first == flag.last else f"iterations {flag.first}-{flag.last}"
    return f"{span}: {flag.message}"
