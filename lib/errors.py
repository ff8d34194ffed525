"""The one exception for user mistakes, and how a script reports it.

Every script raises UserError for input the user can fix (a missing file, a bad record, a
checkpoint of the wrong shape) and lets real bugs raise normally. main() catches UserError,
prints one line, `error: <what>, <where>; <what to do>`, and exits with status 2: a learner
sees what to fix instead of a traceback.
"""

import sys


class UserError(Exception):
    """A problem with the user's input or environment that a message can explain."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (lib/rundir.catch_sigterm), so that one
    `except KeyboardInterrupt` in every training loop saves for both."""


def report_and_exit(err, code: int = 2):
    """One line and exit 2 for a UserError. Ctrl-C or SIGTERM outside the training loop (whose own handler
    saves and exits): one line too, and the shell's codes 130 (128 + SIGINT) or 143 (128 + SIGTERM)."""
    if isinstance(err, KeyboardInterrupt):
        what, code = ("SIGTERM", 143) if isinstance(err, Terminated) else ("Ctrl-C", 130)
        print(f"stopped by {what} outside the training loop; nothing was saved after the last checkpoint",
              file=sys.stderr, flush=True)
        sys.exit(code)
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(code)
