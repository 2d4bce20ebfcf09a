"""One way for every command-line entry point to meet a user's mistake.

A problem the user can fix (a bad flag, a bad model directory) is a `ValueError` or an `OSError`
such as `FileNotFoundError` whose message says what to do. `run_main` prints that message as one
line on stderr and exits with status 2, the status argparse uses for usage errors; the traceback
appears only with `--debug` or `DSV4_DEBUG=1`. Anything else is a bug and keeps its traceback.

It lives in the lowest package (`pallas_kernels.check` is an entry point too); `dsv4_jax` and
`serve` entry points import it from here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

USER_ERRORS = (ValueError, OSError)
AddArgument = Callable[..., argparse.Action]  # a parser's add_argument, as flag-group helpers take it


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as one line `<error_prog>: error: ...` and status 2, without the
    usage block, as `run_main` reports a user error. `error_prog` defaults to `prog`."""

    def __init__(self, *args, error_prog: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.error_prog = error_prog or self.prog

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.error_prog}: error: {message}\n")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug", action="store_true",
        help="show the full traceback of an error instead of one line (also DSV4_DEBUG=1; default: off)",
    )


def debug_requested(argv: Sequence[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get("DSV4_DEBUG", "").strip() not in ("", "0")


def one_line(error: BaseException) -> str:
    """The error's message folded onto one line (an OSError's filename included once)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
             *, prog: str) -> NoReturn:
    """Run `main(argv)` and exit with its status; a user error becomes one line and status 2."""
    try:
        status = main(argv)
    except USER_ERRORS as error:
        if debug_requested(argv):
            raise
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status or 0)
