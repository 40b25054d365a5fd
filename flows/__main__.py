"""``python -m flows`` is the ``rlhf`` command."""

from __future__ import annotations

import sys

from flows.cli import main

sys.exit(main())
