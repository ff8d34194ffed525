"""The one exception for user mistakes, and how a script reports it.

Every script raises UserError for input the user can fix (a missing file, a bad record, a
checkpoint of the wrong shape) and lets real bugs raise normally. main() catches UserError,
prints one line, `error: <what>, <where>; <what to do>`, and exits with status 2: a learner
sees what to fix instead of a traceback.
"""

import sys


class UserError(Exception):
    """A problem with the user's input or environment that a message can explain."""


def report_and_exit(err: UserError, code: int = 2):
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(code)
