"""The one base of every error that is the user's to fix, not a bug.

A command reports an error of this type in one line naming the problem, with exit code :attr:`UserError.exit_code`
(2; 3 for a labelling form nobody answered); any other error is a bug and shows its traceback. Each layer's
own user errors subclass it (beside the built-in type its callers catch, such as ``ValueError``), so the
command line recognises them by type, without importing the modules that raise them.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave (a setting, an input file, a stored output) or the machine's state."""

    exit_code = 2
