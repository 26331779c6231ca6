"""The `tuneup` command's entry point: `run` starts the training job without importing the
full command line (launch/command.py); every other command is cli.py's."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    from .launch.command import run_command

    run_command(args)  # execs the job, or returns for the full command line
    from .cli import main as full_command_line

    full_command_line(args)
