"""``python -m flows`` is the ``rlhf`` command."""

from __future__ import annotations

from flows.cli import command

command()
