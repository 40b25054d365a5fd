"""Mid-stage checkpoints: a long stage saves its progress after each epoch, so a crashed run
continues from the last saved epoch instead of from the start of the stage.

They live in ``<stage output folder>.partial/epoch-00003/`` beside the output they lead to. Each
epoch folder is written under a temporary name and renamed, so only complete checkpoints are
ever seen; older ones are removed once a newer one is in place, and the whole ``.partial`` folder
is removed when the stage output is finished.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from storage.files import temporary_sibling
from storage.holds import hold

_EPOCH_PREFIX = "epoch-"


def partial_dir(final_dir: Path) -> Path:
    """Where the mid-stage checkpoints of the output ``final_dir`` live."""
    return final_dir.with_name(final_dir.name + ".partial")


def shared_staging(final_dir: Path, epochs_done: int) -> Path:
    """The folder the training processes write the checkpoint after ``epochs_done`` epochs into (each its part)
    before :func:`save_progress` with ``staging`` publishes it: a name every process derives alone. A crashed
    run's leftover is emptied by the main process before they write."""
    return partial_dir(final_dir) / f".{_EPOCH_PREFIX}{epochs_done:05d}.tmp-shared"


def save_progress(
    final_dir: Path, epochs_done: int, write: Callable[[Path], None], *, staging: Path | None = None
) -> Path:
    """Write a checkpoint after ``epochs_done`` epochs with ``write(folder)``; returns its folder.

    Args:
        staging: the folder :func:`shared_staging` gave, which ``write`` completes (the other processes wrote
            their parts); None writes into a fresh temporary folder.
    """
    root = partial_dir(final_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{_EPOCH_PREFIX}{epochs_done:05d}"
    staging = staging or temporary_sibling(target)
    try:
        write(staging)
        if not target.exists():
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for older in root.iterdir():  # older epochs only: the folder also holds a training job's spec and logs
        if older.name.startswith(_EPOCH_PREFIX) and older.name != target.name:
            shutil.rmtree(older, ignore_errors=True)
    hold(final_dir.parent.name, "computing")  # outputs live at <stage>/<key>: a test may kill the stage here
    return target


def latest_progress(final_dir: Path) -> tuple[int, Path] | None:
    """``(epochs_done, folder)`` of the newest complete checkpoint, or None."""
    root = partial_dir(final_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith(_EPOCH_PREFIX) and p.is_dir())
    if not done:
        return None
    return int(done[-1].name[len(_EPOCH_PREFIX) :]), done[-1]


def clear_progress(final_dir: Path) -> None:
    """Remove the mid-stage checkpoints of ``final_dir`` (its output is complete)."""
    shutil.rmtree(partial_dir(final_dir), ignore_errors=True)
