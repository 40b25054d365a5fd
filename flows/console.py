"""What ``rlhf run`` shows in a terminal: a line per iteration, a live line per running stage, a summary per stage.

Without ``--verbose`` the console shows the stages, not the log: Prefect's own lines (task runs created,
states) and the project's INFO records stay out of the terminal but still reach the Prefect UI (every
stage's task log says what it did), warnings and errors still print, and the Hugging Face libraries'
progress bars and load reports are off. The stages announce themselves with log records marked
:data:`tasks.stage.STAGE_EVENT`; :class:`StageConsole` turns them into::

    iteration 3 of campaign demo
      sample_candidates    1.9 s  1024 candidates
      collect_preferences  0.2 s  512 pairs, 3% ties
      train_reward_model   2.8 s  RM accuracy 0.88 on 52 held-out pairs
      rollout              ⠹ 2 s                    (while it runs, on a terminal)

One line per stage while it runs, redrawn in place on a terminal (elapsed seconds: the stages report no
finer progress), replaced by its summary when it ends; reused stages are counted, not listed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import IO, Any

STAGE_EVENT = "rlhf_stage_event"
"""The record attribute :mod:`tasks.stage` and the flows mark their announcements with (the same string there)."""

HEADLINES: dict[str, tuple[tuple[str, str], ...]] = {
    "sample_candidates": (("candidates", "{:.0f} candidates"),),
    "collect_preferences": (("pairs", "{:.0f} pairs"), ("tie_fraction", "{:.0%} ties")),
    "train_reward_model": (("eval_accuracy", "RM accuracy {:.2f}"), ("eval_pairs", "on {:.0f} held-out pairs")),
    "rollout": (("rollouts", "{:.0f} rollouts"), ("score_mean", "score {:.3g}")),
    "compute_advantages": (("reward_mean", "reward {:.3g}"), ("kl_mean", "KL {:.3g}")),
    "ppo_update": (("approx_kl", "approx KL {:.3g}"), ("clip_fraction", "clipped {:.0%}")),
    "evaluate": (
        ("gold_win_rate", "gold win rate {:.2f}"),
        ("reward_mean", "reward {:.3g}"),
        ("kl_to_reference", "KL to ref {:.3g}"),
    ),
}
"""Per stage, the metrics its summary line shows, and how."""

_SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def summary_line(stage: str, metrics: dict[str, float], *, width: int = 20) -> str:
    """``"  rollout              4.1 s  256 rollouts, score 0.31"``: a finished stage's seconds and headline metrics."""
    shown = [form.format(metrics[name]) for name, form in HEADLINES.get(stage, ()) if name in metrics]
    seconds = metrics.get("seconds")
    took = f"{seconds:5.1f} s" if seconds is not None else "      "
    return f"  {stage:<{width}} {took}  {', '.join(shown)}".rstrip()


class StageConsole(logging.Handler):
    """Prints iteration headers and stage summaries from the stages' announcements, with a live line per running
    stage on a terminal. Attach it to the loggers that announce (``tasks.stage``, ``flows``)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(level=logging.INFO)
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() and os.environ.get("TERM") != "dumb"
        self.reused = 0
        self._running: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, STAGE_EVENT, None)
        if event == "iteration":
            self._flush_reused()
            self._write(record.getMessage())
        elif event == "started":
            self._start(record.rlhf_stage)  # type: ignore[attr-defined]
        elif event == "finished":
            self._finish(record.rlhf_result)  # type: ignore[attr-defined]

    def _start(self, stage: str) -> None:
        self._flush_reused()
        with self._lock:
            self._running = (stage, time.monotonic())
        if self.live and self._ticker is None:
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick, name="rlhf-console", daemon=True)
            self._ticker.start()

    def _finish(self, result: Any) -> None:
        self._stop_ticker()
        if result.reused:
            self.reused += 1
            return
        self._write(summary_line(result.stage, result.metrics))

    def _flush_reused(self) -> None:
        if self.reused:
            self._write(f"  ({self.reused} stage(s) reused: their outputs exist)")
            self.reused = 0

    def _tick(self) -> None:
        frame = 0
        while not self._stop.wait(0.25):
            with self._lock:
                if self._running is None:
                    continue
                stage, started = self._running
                self.stream.write(
                    f"\r\x1b[2K  {stage:<20} {_SPINNER[frame % len(_SPINNER)]} {time.monotonic() - started:.0f} s"
                )
                self.stream.flush()
            frame += 1

    def _stop_ticker(self) -> None:
        with self._lock:
            self._running = None
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None

    def _write(self, line: str) -> None:
        with self._lock:
            self.stream.write(("\r\x1b[2K" if self.live else "") + line + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Stop the live line, say how many stages were reused, and detach from the loggers."""
        self._stop_ticker()
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
    warnings (the LOAD REPORT boxes), in this process and in those it starts."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
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


_ANNOUNCING = ("prefect.task_runs", "prefect.flow_runs", "tasks.stage", "flows")
"""Where stages and flows announce: Prefect's run loggers (so the Prefect UI's logs say the same), or their module's
logger outside a run."""
