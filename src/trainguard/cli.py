"""The ``trainguard`` command, a thin layer over the library.

Exit codes: 0 success, 1 a finding (e.g. a failed doctor check), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from trainguard import __version__
from trainguard.errors import TrainGuardError

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"trainguard: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainguard",
        description="Keep PyTorch training runs alive and debuggable.",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    try:
        return handler(args)
    except (TrainGuardError, OSError) as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
