"""The campaign's over-optimisation figure: the reward the policy is trained on against the gold score, as the KL
to the reference grows (Gao et al. 2022, "Scaling laws for reward model overoptimization").

A learned reward model's score keeps rising with the KL while the gold score (where a gold judge exists) levels
off or falls: the gap is the policy exploiting the reward model. Without a gold judge, the rubric that labelled the
pairs (labeler ``function``) stands in for it: its score is what the reward model was learned from. The two are on
scales of their own (a reward model's score has no unit), so the judge's score has an axis of its own. A campaign with
no reward (a DPO update's) draws the judge's score alone against the KL. One point per iteration, from the evaluation
metrics every iteration run records. Drawn with matplotlib's object API on the Agg backend: no display, no
pyplot global state.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

REWARD, GOLD, KL = "evaluate/reward_mean", "evaluate/gold_mean", "evaluate/kl_to_reference"
RUBRIC = "evaluate/rubric_mean"
JUDGES = ((GOLD, "gold score (hidden judge)"), (RUBRIC, "rubric score (labelled the pairs)"))
"""The held-out score the learned reward is drawn against, the first every iteration has: (metric, legend)."""
FIGURE_FILE = "overoptimisation.png"


def overoptimisation_figure(rows: Sequence[tuple[int, dict[str, float]]], *, campaign: str) -> Any:
    """A two-panel matplotlib ``Figure``: reward and gold score (or the rubric's, :data:`JUDGES`) against the KL to
    the reference (one point per iteration, labelled), and all three over iterations. ``rows`` are
    ``(iteration, metrics)``, oldest first; iterations without evaluation metrics are left out. A campaign with no
    reward (a DPO update's) draws the judge's score alone, on the left panel's one axis."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rewarded = any(REWARD in metrics for _, metrics in rows)
    rows = [(n, metrics) for n, metrics in rows if KL in metrics and (REWARD in metrics or not rewarded)]
    iterations = [iteration for iteration, _ in rows]
    kl = [metrics[KL] for _, metrics in rows]
    reward = [metrics[REWARD] for _, metrics in rows] if rewarded else None
    judge = next((judge for judge in JUDGES if all(judge[0] in metrics for _, metrics in rows)), None)
    gold = None if judge is None else [metrics[judge[0]] for _, metrics in rows]

    # Fixed margins, room for both twin axes' labels: the constrained layout engine measured every text box, half of
    # what drawing the figure cost (0.68 s against 0.34 s), once per iteration (issue 41).
    figure = Figure(figsize=(10, 3.8))
    figure.subplots_adjust(left=0.065, right=0.935, bottom=0.13, top=0.92, wspace=0.42)
    by_kl, by_iteration = figure.subplots(1, 2)
    if reward is not None:
        by_kl.plot(kl, reward, "o-", color="tab:blue", label="reward (trained on)")
    judge_axis = by_kl
    if gold is not None:
        judge_axis = by_kl.twinx() if reward is not None else by_kl
        judge_axis.plot(kl, gold, "s-", color="tab:orange", label=judge[1])
        judge_axis.set_ylabel(judge[1].partition(" (")[0], color="tab:orange")
    for iteration, x, y in zip(iterations, kl, reward or gold or [None] * len(kl), strict=True):
        if y is None:  # no reward and no judge: nothing drawn to label
            continue
        by_kl.annotate(str(iteration), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    title = "over-optimisation" if rewarded else "score against KL (no reward: DPO)"
    by_kl.set(xlabel="KL to the reference (nats per response)", title=title)
    if reward is not None:
        by_kl.set_ylabel("reward")
    lines = by_kl.get_lines() + (judge_axis.get_lines() if judge_axis is not by_kl else [])
    if lines:
        by_kl.legend(lines, [line.get_label() for line in lines], fontsize=8)

    if reward is not None:
        by_iteration.plot(iterations, reward, "o-", color="tab:blue", label="reward")
    if gold is not None:
        by_iteration.plot(iterations, gold, "s-", color="tab:orange", label=judge[1].partition(" (")[0])
        initial = f"evaluate/reference_{judge[0].removeprefix('evaluate/')}"
        if (
            rows and initial in rows[0][1]
        ):  # the initial policy's score: a campaign should never end below it (issue 43)
            by_iteration.axhline(rows[0][1][initial], color="tab:orange", linestyle=":", label="initial policy")
    by_iteration.set(xlabel="iteration", ylabel="mean score", title=f"campaign {campaign}")
    kl_axis = by_iteration.twinx()
    kl_axis.plot(iterations, kl, "^--", color="tab:gray", label="KL to ref")
    kl_axis.set_ylabel("KL to the reference")
    lines = by_iteration.get_lines() + kl_axis.get_lines()
    by_iteration.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
    for axis in (by_kl, by_iteration):
        axis.grid(alpha=0.3)
    # A few ticks, whole iterations: one iteration's KL near zero would otherwise get overlapping long tick labels.
    by_kl.xaxis.set_major_locator(MaxNLocator(nbins=5))
    by_iteration.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    return figure


def png_bytes(figure: Any, *, dpi: int = 80) -> bytes:
    """``figure`` drawn once as PNG: about 65 KB for the over-optimisation figure at the default ``dpi``. MLflow keeps
    the file and the Prefect artifact shows the same bytes (:func:`png_data_uri`); drawing it is a large part of what
    closing a small iteration costs."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def png_data_uri(png: bytes) -> str:
    """``png`` as a ``data:image/png;base64,...`` URI: an image a page shows with no server behind it (the Prefect
    artifact's)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
