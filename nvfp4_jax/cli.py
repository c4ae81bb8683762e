"""What every command line of the package shares: its exit codes, its one-line errors, `--debug`
and its argparse scaffolding (`CommandParser`).

Every `python -m nvfp4_jax.<command>` reports something the user can fix as one line on stderr,
`error: <what, the value, what is allowed>`, and exits with `Exit.BAD_INPUT`. `--debug` (or
NVFP4_JAX_DEBUG=1) prints the traceback above that line. A crash (a bug) keeps Python's own
traceback and exit status 1. docs/training.md lists the codes.

Nothing here imports jax, or anything of the package: a command checks its arguments first.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import traceback
from typing import Callable, Sequence


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


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    """Whether the user asked for tracebacks: `--debug` among `argv` (default `sys.argv[1:]`), or
    NVFP4_JAX_DEBUG set (not 0)."""
    argv = sys.argv[1:] if argv is None else argv
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


CONFIG_ARGUMENTS = "[config.yml] [key=value ...]"


class CommandParser(argparse.ArgumentParser):
    """The argparse parser of every `python -m nvfp4_jax.<command>`.

    It holds `--debug` and, for a command that takes a config, the `config` positionals
    (CONFIG_ARGUMENTS, as nvfp4_jax.train reads them). A usage mistake is raised as `error(message)`,
    the command's own one-line error, instead of argparse's usage block and exit; `hint` ends the
    message with where the help is. Without `help`, the command prints its own docstring for
    -h/--help (see `parse_command`).
    """

    def __init__(self, command: str, *, error: Callable[[str], Exception] = ValueError, config: bool = False,
                 hint: bool = True, help: bool = False, **kwargs):
        super().__init__(prog=f"python -m nvfp4_jax.{command}", add_help=help, **kwargs)
        self._error, self._hint = error, hint
        self.add_argument("--debug", action="store_true",
                          help="print the traceback above the error line (as NVFP4_JAX_DEBUG=1 does)")
        if config:
            self.add_argument("config", nargs="*", metavar="CONFIG",
                              help=f"the run's config: {CONFIG_ARGUMENTS} (as nvfp4_jax.train)")

    def error(self, message):  # one line, not argparse's usage block
        raise self._error(f"{message} (see {self.prog} --help)." if self._hint else message)


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None, doc: str, *,
                  help_when_empty: bool = True) -> argparse.Namespace | None:
    """`parser`'s reading of the command's arguments (`sys.argv[1:]` when `argv` is None), or None
    once `doc` is printed because they begin with -h/--help (or, with `help_when_empty`, there are
    none): the command then returns Exit.OK."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if (not argv and help_when_empty) or (argv and argv[0] in ("-h", "--help")):
        print(doc)
        return None
    return parser.parse_args(argv)
