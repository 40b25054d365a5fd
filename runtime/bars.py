"""A stage's progress bar, wherever its work runs, shown by the stage's own process.

In the stage's own process a bar is a tqdm bar on the console. In a training process :mod:`runtime.launch` started,
the bar's state goes to a file instead (``<job folder>/bar.json``, named by :data:`BAR_FILE_VARIABLE`), and the
stage's process, which waits for that training process, shows it as a bar of its own (:func:`relay_bar`). So two
stages that run at once, one training in a process of its own and one sampling in the flow's (``sampling.staleness``),
both show their progress on the console, one bar each.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from storage.files import write_text_replacing

BAR_FILE_VARIABLE = "RLHF_BAR_FILE"
"""The environment variable naming the file a launched training process writes its bar's state to."""


def stage_bar(*, total: int, desc: str, unit: str, initial: int = 0, disable: bool = False) -> Any:
    """A progress bar for a stage's work (see the module docstring): ``update(n)``, ``close()``, a context manager."""
    path = os.environ.get(BAR_FILE_VARIABLE)
    if path is None or disable:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=False, disable=disable)
    return _FileBar(Path(path), total=total, initial=initial, desc=desc, unit=unit)


class _FileBar:
    """A bar whose state is a JSON file: ``{"n", "total", "desc", "unit"}``, replaced whole at each update."""

    def __init__(self, path: Path, *, total: int, initial: int, desc: str, unit: str) -> None:
        self.path, self.state = path, {"n": initial, "total": total, "desc": desc, "unit": unit}
        self._write()

    def update(self, n: int = 1) -> None:
        self.state["n"] += n
        self._write()

    def close(self) -> None:
        """Nothing to close: the stage's process closes the bar it shows when the training process ends."""

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self) -> None:
        write_text_replacing(self.path, json.dumps(self.state))


def relay_bar(path: Path) -> Callable[[bool], None]:
    """A function the stage's process calls while a training process runs (and once more with True when it has
    ended): it shows the bar that process writes to ``path`` as a tqdm bar of its own."""
    shown: list[Any] = []

    def relay(ended: bool) -> None:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet
            state = None
        if state is not None and not ended:
            if not shown:
                shown.append(tqdm(total=state["total"], desc=state["desc"], unit=state["unit"], leave=False))
            shown[0].n = state["n"]
            shown[0].refresh()
        if ended and shown:
            shown[0].close()

    return relay
