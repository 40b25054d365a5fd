"""What ``rlhf run`` shows in a terminal: a line per iteration, a progress bar per running stage, a summary per stage.

Without ``--verbose`` the console shows the stages, not the log: Prefect's own lines (task runs created,
states) and the project's INFO records stay out of the terminal but still reach the Prefect UI (every
stage's task log says what it did), warnings and errors still print, and the Hugging Face libraries'
progress bars and load reports are off. The stages announce themselves with log records marked
:data:`runtime.events.STAGE_EVENT`; :class:`StageConsole` turns them into::

    iteration 3 of campaign demo
      sample_candidates      1.9 s  1024 candidates
      collect_preferences    0.2 s  512 pairs, 3% ties
      train_reward_model     2.8 s  RM accuracy 0.88, 51 held-out pairs
    rollout:  50%|█████     | 2/4 [00:00<00:00,  7.59batch/s]      (while it runs)

A running stage shows its own progress bar (batches or epochs; it disappears when the stage ends), a
finished one its summary; reused stages are counted, not listed. A record marked ``notice`` is printed as it
is: what the person at the terminal must act on (the address of the labelling page a run waits on).

With ``sampling.staleness`` >= 1 the next iteration's generation stages run beside the update (:mod:`flows.overlap`):
both bars show at once (the update's relayed from its training process, :mod:`runtime.bars`), and a stage of the next
iteration says so in its summary::

    iteration 3 of campaign demo
      compute_advantages     0.1 s  reward 0.651
      rollout              131.8 s  32 rollouts, score 0.31  (iteration 4, beside the update)
      ppo_update           185.2 s  approx KL 0.002, clipped 3%
    rollout:  50%|█████     | 2/4 [00:40<00:40, 20.1s/batch]      (while they run)
    ppo_update:  25%|██▌       | 1/4 [00:45<02:15, 45.0s/epoch]

The next iteration then reuses those outputs; they were shown already, so they are not counted as reused.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO

from runtime.events import ITERATION_EVENT, STAGE_EVENT

"""The record attribute :mod:`runtime.stage` and the flows mark their announcements with (the same string there)."""

HEADLINES: dict[str, tuple[tuple[str, str], ...]] = {
    "sample_candidates": (("candidates", "{:.0f} candidates"),),
    "human_labels": (("pairs", "{:.0f} pairs answered"), ("skipped", "{:.0f} tie/skip")),
    "collect_preferences": (("pairs", "{:.0f} pairs"), ("decisive_pairs", "{:.0f} decisive"), ("ties", "{:.0f} ties")),
    "train_reward_model": (("eval_accuracy", "RM accuracy {:.2f}"), ("eval_pairs", "{:.0f} held-out pairs")),
    "rollout": (("rollouts", "{:.0f} rollouts"), ("score_mean", "score {:.3g}")),
    "critic_values": (("value_shift_mean", "the rollout's critic was off by {:.3g} a token"),),
    "compute_advantages": (("reward_mean", "reward {:.3g}"), ("kl_mean", "KL (k1) {:.3g}")),
    "ppo_update": (("approx_kl", "approx KL {:.3g}"), ("clip_fraction", "clipped {:.0%}")),
    "reference_logprobs": (("pairs", "{:.0f} decisive pairs"), ("ties_dropped", "{:.0f} ties dropped")),
    "dpo_update": (("rewards/accuracies", "accuracy {:.2f}"), ("rewards/margins", "margin {:.3g}")),
    "sample_reference": (("responses", "{:.0f} reference responses, once per campaign"),),
    "evaluate": (
        ("gold_win_rate", "gold win rate {:.2f}"),
        ("reward_mean", "reward {:.3g}"),
        ("kl_to_reference", "KL to ref {:.3g}"),
    ),
}
"""Per stage, the metrics its summary line shows, and how."""


JUDGES = (("gold_mean", "reference_gold_mean", "gold score"), ("rubric_mean", "reference_rubric_mean", "rubric"))
"""The held-out scores a learned reward stands for (a hidden gold judge, or the rubric that labelled the pairs), the
first the evaluation has: (policy's metric, initial policy's, name)."""


def overoptimisation_notice(metrics: dict[str, float]) -> str | None:
    """What an evaluation's metrics say when the policy is exploiting its reward (Gao et al. 2022): the reward it is
    trained on rates it above the initial policy, the judge that reward stands for (:data:`JUDGES`) below it; None
    otherwise, or where the evaluation has no judge."""
    judge = next((judge for judge in JUDGES if judge[0] in metrics and judge[1] in metrics), None)
    if judge is None or "reward_mean" not in metrics or "reference_reward_mean" not in metrics:
        return None
    policy, initial, name = judge
    if metrics["reward_mean"] > metrics["reference_reward_mean"] and metrics[policy] < metrics[initial]:
        return (
            f"over-optimising: the reward rates the policy above the initial policy ({metrics['reward_mean']:.3g} > "
            f"{metrics['reference_reward_mean']:.3g}), the {name} below it ({metrics[policy]:.3g} < "
            f"{metrics[initial]:.3g}); see the campaign's over-optimisation figure"
        )
    return None


def kl_budget_notice(metrics: dict[str, float]) -> str | None:
    """What a PPO update's metrics say when it stopped at its KL budget (``ppo.kl_budget``,
    :mod:`rlhf_core.ppo` choice 8); None otherwise, or where it had no budget."""
    if not metrics.get("at_kl_budget"):
        return None
    steps = int(metrics["optimizer_steps"])
    if steps == 0:
        return "at the KL budget (`ppo.kl_budget`): the policy was past it before the update, which took no step"
    return f"at the KL budget (`ppo.kl_budget`): the update stopped after {steps} optimizer step(s)"


def summary_line(stage: str, metrics: dict[str, float], *, width: int = 20) -> str:
    """``"  rollout              4.1 s  256 rollouts, score 0.31"``: a finished stage's seconds and headline metrics."""
    shown = [form.format(metrics[name]) for name, form in HEADLINES.get(stage, ()) if name in metrics]
    seconds = metrics.get("seconds")
    took = f"{seconds:5.1f} s" if seconds is not None else "      "
    return f"  {stage:<{width}} {took}  {', '.join(shown)}".rstrip()


class StageConsole(logging.Handler):
    """Prints iteration headers and stage summaries from the stages' announcements. Attach it to the loggers
    that announce (:data:`_ANNOUNCING`)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(level=logging.INFO)
        self.stream = stream or sys.stderr
        self.reused = 0
        self.iteration: int | None = None
        self.shown: set[str] = set()  # outputs this command computed and showed (input keys)

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, STAGE_EVENT, None)
        if event in ("iteration", "started", "notice"):
            self._flush_reused()
        if event == "iteration":
            self.iteration = getattr(record, ITERATION_EVENT, None)
            self._write(record.getMessage())
        elif event == "notice":  # something the person at the terminal must act on (where to label pairs)
            self._write(f"  {record.getMessage()}")
        elif event == "finished":
            result = record.rlhf_result  # type: ignore[attr-defined]
            if not result.reused:
                iteration = getattr(record, ITERATION_EVENT, None)
                ahead = self.iteration is not None and iteration is not None and iteration > self.iteration
                line = summary_line(result.stage, result.metrics)
                self._write(f"{line}  (iteration {iteration}, beside the update)" if ahead else line)
                if result.stage == "evaluate" and (notice := overoptimisation_notice(result.metrics)):
                    self._write(f"  {notice}")
                if result.stage == "ppo_update" and (notice := kl_budget_notice(result.metrics)):
                    self._write(f"  {notice}")
                self.shown.add(result.input_key)
            elif result.input_key not in self.shown:  # not the output of a stage run ahead by this command
                self.reused += 1

    def _flush_reused(self) -> None:
        if self.reused:
            self._write(f"  ({self.reused} stage(s) reused: their outputs exist)")
            self.reused = 0

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Say how many stages were reused since the last line, and detach from the loggers."""
        self._flush_reused()
        for name in _ANNOUNCING:
            logging.getLogger(name).removeHandler(self)
        super().close()


class _WarningsOnly(logging.Filter):
    """Lets through only warnings and errors: what the console shows of the log without ``--verbose``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def quiet_libraries() -> None:
    """Turn off the Hugging Face libraries' progress bars ("Loading weights", "Writing model shards") and their
    warnings (the LOAD REPORT boxes), and MLflow's "Downloading artifacts" bars (a replay or an export reading a
    run's files), in this process and in those it starts."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # read at each download
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # "Creating initial MLflow database tables..."
    if "mlflow" in sys.modules:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    if "transformers" in sys.modules:  # imported already: the settings above were read at its import
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()


def show_stages(console_handlers: list[logging.Handler]) -> StageConsole:
    """Make the console show stages (see the module docstring): ``console_handlers`` (Prefect's console handlers)
    keep only warnings and errors, and a :class:`StageConsole` prints the stages' announcements."""
    for handler in console_handlers:
        if not any(isinstance(existing, _WarningsOnly) for existing in handler.filters):
            handler.addFilter(_WarningsOnly())
    console = StageConsole()
    for name in _ANNOUNCING:
        logging.getLogger(name).addHandler(console)
    return console


_ANNOUNCING = ("prefect.task_runs", "prefect.flow_runs", "runtime.stage", "flows")
"""Where stages and flows announce: Prefect's run loggers (so the Prefect UI's logs say the same), or their module's
logger outside a run."""
