"""User-facing errors: one line on stderr and a non-zero exit, never a traceback.

Code anywhere raises `UserError` for bad input; the CLI entry points wrap `main` in `run_cli`, which
turns it (and argparse's own complaints) into a single `error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Bad input from the user (flags, files, prompt): reported as one line, exit status 2."""


class CliParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (argparse's default prints the usage block too). A
    `description` is cut to its first paragraph: the entry points pass their module's docstring."""

    def __init__(self, *args, description: str | None = None, **kwargs) -> None:
        if description:
            description = " ".join(description.strip().split("\n\n")[0].split())
        super().__init__(*args, description=description, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UserError(message)


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
