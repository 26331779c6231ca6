"""`tuneup run`'s own parser. The command that starts every measured job reads its three
options itself and execs the script at once: the full command line (typer, rich, and the
pydantic typer checks parameters with) costs about 160 ms of start-up that a training job
would wait for. `--help`, and anything this parser does not know before the script, go to
the full command line, which answers them.

    tuneup run [-m] [--apply] [--actions A,B] TARGET ARGS...

Options for tuneup come before TARGET; everything after it is the script's own (an
`--apply` after the script is the script's argument, not tuneup's).
"""

from __future__ import annotations

import sys

from . import LaunchError, exec_script


def run_command(argv: list[str]) -> None:
    """Exec `argv` (`run ...`) as a measured job; returns, having done nothing, when the full
    command line must answer (not `run`, help, an option it does not know, no TARGET).
    A problem the user can fix is one line on stderr and exit status 2."""
    if not argv or argv[0] != "run":
        return
    module = apply = False
    actions: str | None = None
    index = 1
    while index < len(argv):
        arg = argv[index]
        if arg == "-m":
            module = True
        elif arg == "--apply":
            apply = True
        elif arg == "--actions" and index + 1 < len(argv):
            index += 1
            actions = argv[index]
        elif arg.startswith("--actions="):
            actions = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            return  # --help, or an option only the full command line can explain
        else:
            break
        index += 1
    if index >= len(argv):
        return  # no TARGET: the full command line says so
    try:
        exec_script(argv[index], argv[index + 1:], module=module, env_overrides=run_environment(apply, actions))
    except (LaunchError, ValueError) as exc:
        from ..format import one_line

        sys.stderr.write(f"tuneup: {one_line(str(exc))}\n")
        sys.exit(2)


def run_environment(apply: bool, actions: str | None) -> dict[str, str]:
    """The TUNEUP_* settings `run`'s options stand for (ValueError: the one-line problem)."""
    from ..options import parse_actions

    overrides = {"PYTHONUNBUFFERED": "1"} if "-u" in getattr(sys, "orig_argv", [])[1:3] else {}
    if actions is not None and not apply:
        raise ValueError("--actions chooses what apply mode may change: add --apply")
    if apply:
        overrides["TUNEUP_MODE"] = "apply"
    if actions is not None:
        try:
            overrides["TUNEUP_ACTIONS"] = ",".join(parse_actions(actions))
        except ValueError as exc:
            raise ValueError(f"--actions: {exc}") from None
    return overrides
