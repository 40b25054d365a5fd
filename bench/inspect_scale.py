"""``rlhf inspect`` at scale: a synthetic campaign of 100 iterations x 10,000 rollouts, summarised by the lazy polars
scans of ``rlhf inspect`` and, for comparison, by reading the same shards with pyarrow into pandas.

    PYTHONPATH=$PWD .venv/bin/python bench/inspect_scale.py [--iterations 100] [--rollouts 10000] [--root DIR]

The campaign is written once (real schemas, real manifests, real MLflow records, like a run's; reused when it is
there), then each reader runs in a fresh process, so its peak resident memory (``ru_maxrss``) is its own:

* ``inspect``: ``rlhf inspect CAMPAIGN --format json``, the whole command (MLflow lookup, summary, flags);
* ``summary``: :func:`flows.inspection.summarize_runs` over the runs the command found (the scans alone);
* ``pandas``: every ``scored_experience`` shard read with ``pyarrow.parquet.read_table`` (only the summary's
  columns) and converted ``to_pandas()``, then the same figures computed with pandas and numpy.

:func:`write_synthetic_campaign` is also what the tests build drifting and steady campaigns with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from campaign.config import load_config  # noqa: E402
from campaign.store import campaign_layout, store_tracker  # noqa: E402
from demo.tokenizer import EOS_ID, build_tokenizer  # noqa: E402
from storage.manifest import StageOutput, compute_input_key  # noqa: E402
from storage.schemas import EXPERIENCE, SAMPLES, SCORED_EXPERIENCE  # noqa: E402
from storage.tracking import (  # noqa: E402
    KIND_ITERATION,
    KIND_STAGE,
    TAG_CAMPAIGN,
    TAG_INPUT_KEY,
    TAG_ITERATION,
    TAG_KIND,
    TAG_OUTPUT_PREFIX,
    TAG_STAGE,
)

WORDS = [f"w{index}" for index in range(60)]
HELD_OUT = 64


def _trend(iteration: int, iterations: int, *, drift: bool) -> dict[str, float]:
    """Per-iteration means. Steady: length and KL flat, score, held-out score and gold rise together, entropy
    falls gently. Drifting: length and per-token KL climb, the score rises a little, the held-out score rises
    while the gold score stalls then falls, and the entropy collapses."""
    f = iteration / max(iterations - 1, 1)
    if drift:
        return dict(length=0.3 + 0.5 * f, kl_token=0.002 + 0.08 * f * f, score=0.3 * f, heldout=1.5 * f,
                    gold=0.2 * min(f, 0.2) - 0.5 * max(f - 0.5, 0), entropy=2.5 - 2.2 * f, accuracy=0.7)  # fmt: skip
    return dict(length=0.3, kl_token=0.002 + 0.004 * f, score=0.6 * f, heldout=0.5 * f, gold=0.8 * f,
                entropy=2.5 - 0.3 * f, accuracy=0.7)  # fmt: skip


def _lists(lengths: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def scored_experience(
    rng: np.random.Generator, trend: dict[str, float], *, rollouts: int, group: int, max_new_tokens: int, vocab: int
) -> pa.Table:
    """A ``scored_experience`` table of ``rollouts`` rows in prompt groups of ``group``, drawn around ``trend``."""
    mean_length = trend["length"] * max_new_tokens
    lengths = np.clip(np.rint(rng.normal(mean_length, max_new_tokens / 6, rollouts)), 1, max_new_tokens).astype(int)
    tokens = int(lengths.sum())
    ends = np.cumsum(lengths) - 1
    response_ids = rng.integers(EOS_ID + 1, vocab, tokens)
    truncated = (lengths == max_new_tokens) & (rng.random(rollouts) < 0.5)
    response_ids[ends[~truncated]] = EOS_ID
    d = rng.normal(trend["kl_token"], 0.05, tokens)  # per-token k1 = old_logprobs - ref_logprobs
    old_logprobs = rng.normal(-2.0, 0.5, tokens)
    scores = rng.normal(trend["score"], 1.0, (rollouts // group, group))
    same = rng.random(rollouts // group) < 0.2  # a fifth of the groups scored alike: zero spread
    scores[same] = scores[same][:, :1]
    scores = scores.reshape(-1)
    rewards = -0.05 * d
    rewards[ends] += scores
    f32 = pa.float32()
    zeros = np.zeros(tokens)
    return pa.table(
        {
            "row": np.arange(rollouts),
            "prompt_id": np.arange(rollouts) // group,
            "prompt_ids": _lists(np.full(rollouts, 2), rng.integers(EOS_ID + 1, vocab, 2 * rollouts), pa.int32()),
            "response_ids": _lists(lengths, response_ids, pa.int32()),
            "old_logprobs": _lists(lengths, old_logprobs, f32),
            "ref_logprobs": _lists(lengths, old_logprobs - d, f32),
            "old_values": _lists(lengths, zeros, f32),
            "engine_logprobs": pa.nulls(rollouts, pa.list_(f32)),  # sampled by hf: no engine log-probs
            "scores": pa.array(scores, type=f32),
            "policy_version": pa.array(np.zeros(rollouts, dtype=np.int64)),
            "action_mask": pa.nulls(rollouts, pa.list_(pa.bool_())),  # single-turn rows
            "turn_rewards": pa.nulls(rollouts, pa.list_(f32)),
            "rewards": _lists(lengths, rewards, f32),
            "kl": _lists(lengths, d, f32),
            "advantages": _lists(lengths, rng.normal(0.0, 1.0, tokens), f32),
            "returns": _lists(lengths, zeros, f32),
        },
        schema=SCORED_EXPERIENCE,
    )


def _write_iteration(
    layout, campaign: str, iteration: int, table: pa.Table, trend: dict[str, float], tokenizer, *, max_new_tokens: int
) -> dict[str, str]:
    """One iteration's stage outputs, with their manifests; their input keys by stage."""
    keys = {}

    def output(stage: str, config: dict, metrics: dict | None = None) -> StageOutput:
        config = {**config, "context": {"campaign": campaign, "iteration": iteration}}
        keys[stage] = key = compute_input_key(stage, config, {}, code="synthetic")
        out = StageOutput(layout.stage_dir(stage, key), stage=stage, input_key=key, config=config, upstream={},
                          code="synthetic")  # fmt: skip
        out.metrics.update(metrics or {})
        return out

    with output("rollout", {"stage": {"sampling": {"max_new_tokens": max_new_tokens}}}) as out:
        experience = table.drop_columns(["rewards", "kl", "advantages", "returns"])
        out.write_table("experience", experience, schema=EXPERIENCE)
    with output("compute_advantages", {"stage": {"advantages": {"estimator": "gae"}}}) as out:
        out.write_table("scored_experience", table, schema=SCORED_EXPERIENCE)
    with output("ppo_update", {"stage": {}}, {"entropy": trend["entropy"]}) as out:
        tokenizer.save_pretrained(out.path / "actor")
    with output("train_reward_model", {"stage": {}}, {"eval_accuracy": trend["accuracy"]}):
        pass
    with output("evaluate", {"stage": {}}) as out:
        samples = [
            {"prompt": "w1", "policy_response": "w2", "policy_reward": trend["heldout"] + (0.1 if k % 2 else -0.1),
             "policy_gold": trend["gold"] + (0.01 if k % 2 else -0.01)}
            for k in range(HELD_OUT)
        ]  # fmt: skip
        (out.path / SAMPLES).write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return keys


def write_synthetic_campaign(
    run_root: Path,
    campaign: str,
    *,
    iterations: int,
    rollouts: int,
    drift: bool = False,
    group: int = 4,
    max_new_tokens: int = 32,
    seed: int = 0,
):
    """Write a campaign of ``iterations`` finished iterations as a run would record them: the rollout, scored
    experience, PPO (entropy, the tokenizer beside the actor), reward-model and evaluation outputs of each, with
    their manifests, and the MLflow iteration and stage runs that name them.

    Returns:
        The config that finds it (``run_root`` and ``campaign`` set).
    """
    config = load_config(None, [f"run_root={run_root}", f"campaign={campaign}"], store_only=True)
    layout, tracker = campaign_layout(config), store_tracker(config)
    experiment_id = tracker.experiment_id(campaign)
    tokenizer = build_tokenizer(WORDS)
    rng = np.random.default_rng(seed)
    for iteration in range(iterations):
        trend = _trend(iteration, iterations, drift=drift)
        table = scored_experience(
            rng, trend, rollouts=rollouts, group=group, max_new_tokens=max_new_tokens, vocab=len(tokenizer)
        )
        folders = _write_iteration(layout, campaign, iteration, table, trend, tokenizer, max_new_tokens=max_new_tokens)
        parent = tracker.start_run(experiment_id, name=f"iteration-{iteration}", tags={
            TAG_KIND: KIND_ITERATION, TAG_ITERATION: str(iteration), TAG_CAMPAIGN: campaign})  # fmt: skip
        tags = {}
        for stage, key in folders.items():
            run_id = tracker.start_run(experiment_id, name=stage, parent_run_id=parent, tags={
                TAG_KIND: KIND_STAGE, TAG_STAGE: stage, TAG_INPUT_KEY: key, TAG_ITERATION: str(iteration)})  # fmt: skip
            tracker.end_run(run_id)
            tags[f"{TAG_OUTPUT_PREFIX}{stage}"] = run_id
        tracker.set_tags(parent, tags)
        tracker.end_run(parent)
    return config


# The benchmark ----------------------------------------------------------------------------------------------------

_PANDAS = r"""
import sys, time, glob, numpy as np, pyarrow as pa, pyarrow.parquet as pq
start = time.perf_counter()
columns = ["prompt_id", "response_ids", "old_logprobs", "ref_logprobs", "scores", "rewards", "advantages"]
tables = []
for number, folder in enumerate(sorted(glob.glob(sys.argv[1] + "/compute_advantages/*"))):
    table = pq.read_table(sorted(glob.glob(folder + "/scored_experience-*.parquet")), columns=columns)
    tables.append(table.append_column("iteration", pa.array(np.full(len(table), number))))
frame = pa.concat_tables(tables).to_pandas()
rows = []
for _, part in frame.groupby("iteration"):
    lengths = part.response_ids.map(len)
    k1 = [old.astype("f8") - ref for old, ref in zip(part.old_logprobs, part.ref_logprobs)]
    advantages = np.concatenate(part.advantages.to_numpy()).astype("f8")
    groups = part.groupby("prompt_id").scores.agg(lambda s: s.max() - s.min())
    rows.append(dict(rollouts=len(part), length_mean=lengths.mean(), length_p95=lengths.quantile(0.95),
                     score_mean=part.scores.mean(), reward_mean=part.rewards.map(lambda r: r.sum(dtype="f8")).mean(),
                     kl_mean=np.mean([d.sum() for d in k1]), negative=np.mean(np.concatenate(k1) < 0),
                     advantage_std=advantages.std(ddof=1), zero_spread=(groups == 0).mean()))
print(f"read and summarised in {time.perf_counter() - start:.2f} s, {len(rows)} rows")
"""

_SUMMARY = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
from campaign.config import load_config
from flows.inspection import eos_token_id, find_runs, summarize_runs, tokenizer_dir
config = load_config(None, [f"run_root={sys.argv[1]}"], store_only=True)
start = time.perf_counter()
runs = find_runs(config, sys.argv[2])
found = time.perf_counter()
summary = summarize_runs(runs, eos=eos_token_id(tokenizer_dir(runs[0])))
print(f"find_runs {found - start:.2f} s, summarize_runs {time.perf_counter() - found:.2f} s, {summary.height} rows")
"""


_PEAK = r"""
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(done.returncode)
"""
"""Runs a command and reports its peak resident memory (KiB, Linux) on its last stderr line: one child per wrapper,
so each reader's peak is its own."""


def _measure(argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds, the command's peak RSS in MiB, and its stdout's last line."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{argv[:4]} failed:\n{done.stderr[-3000:]}")
    peak = int(done.stderr.strip().splitlines()[-1]) / 1024
    return seconds, peak, (done.stdout.strip().splitlines() or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--root", type=Path, default=Path("/tmp/rlhf-inspect-bench"))
    arguments = parser.parse_args()
    campaign = f"synthetic-{arguments.iterations}x{arguments.rollouts}"
    campaign_dir = arguments.root / campaign
    if not (campaign_dir / "compute_advantages").is_dir():
        start = time.perf_counter()
        write_synthetic_campaign(
            arguments.root, campaign, iterations=arguments.iterations, rollouts=arguments.rollouts, drift=True
        )
        print(f"wrote {campaign} in {time.perf_counter() - start:.0f} s")
    shards = sorted(campaign_dir.glob("compute_advantages/*/scored_experience-*.parquet"))
    size = sum(path.stat().st_size for path in shards) / 2**20
    print(f"{len(shards)} scored_experience shards, {size:.0f} MiB on disk")
    python = sys.executable
    results = {
        "summary": _measure([python, "-c", _SUMMARY, str(arguments.root), campaign, str(ROOT)]),
        "inspect": _measure(
            [python, "-m", "flows.cli", "inspect", campaign, "--format", "json", f"--set=run_root={arguments.root}"]
        ),  # fmt: skip
        "pandas": _measure([python, "-c", _PANDAS, str(campaign_dir)]),
    }
    print(f"| reader | {arguments.iterations} x {arguments.rollouts}: wall s | peak RSS MiB | inside the process |")
    print("| --- | ---: | ---: | --- |")
    for name, (seconds, peak, line) in results.items():
        inside = "(whole command)" if name == "inspect" else line
        print(f"| {name} | {seconds:.1f} | {peak:.0f} | {inside} |")


if __name__ == "__main__":
    main()
