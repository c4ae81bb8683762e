"""What every command line of the package shares: its exit codes, its one-line errors and `--debug`.

Every `python -m nvfp4_jax.<command>` reports something the user can fix as one line on stderr,
`error: <what, the value, what is allowed>`, and exits with `Exit.BAD_INPUT`. `--debug` (or
NVFP4_JAX_DEBUG=1) prints the traceback above that line. A crash (a bug) keeps Python's own
traceback and exit status 1. docs/training.md lists the codes.

Nothing here imports jax, or anything of the package: a command checks its arguments first.
"""

from __future__ import annotations

import enum
import os
import sys
import traceback
from typing import Sequence


class Exit(enum.IntEnum):
    OK = 0
    INTERNAL = 1  # a bug, with its traceback
    BAD_INPUT = 2  # one `error:` line, before anything compiles where it can be checked then
    NON_FINITE = 3  # train: a step went non-finite; nothing after the last good checkpoint was saved
    SITES_FAILED = 3  # federated: every site failed in a round; the job ended (an alias of 3)
    NO_CHECKPOINT = 4  # no intact checkpoint to resume from, or a save or run-directory write failed
    DOES_NOT_FIT = 5  # plan: the plan is printed, and it does not fit the device
    NOT_REPRODUCED = 6  # lab --check: the run (or a number derived from it) did not reproduce
    STOPPED = 75  # stopped by SIGTERM/SIGINT after saving; rerun to resume (EX_TEMPFAIL)


def debug_requested(argv: Sequence[str]) -> bool:
    """Whether the user asked for tracebacks: `--debug` among `argv`, or NVFP4_JAX_DEBUG set (not 0)."""
    return "--debug" in argv or os.environ.get("NVFP4_JAX_DEBUG", "") not in ("", "0")


def error_line(message: object) -> str:
    """`message` as one `error:` line (its whitespace, newlines included, collapsed)."""
    return f"error: {' '.join(str(message).split())}"


def fail(error: object, code: Exit = Exit.BAD_INPUT, *, debug: bool = False) -> Exit:
    """Prints `error` (an exception or a message) as one `error:` line on stderr, after its
    traceback when `debug`; returns `code`, the process's exit status."""
    if debug and isinstance(error, BaseException):
        traceback.print_exception(error)
    print(error_line(error), file=sys.stderr, flush=True)
    return code
