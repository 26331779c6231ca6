"""Run a training script under tuneup without changing it: `tuneup run [--apply] train.py ARGS...`.

The technique of ddtrace-run and opentelemetry-instrument: put a directory holding only a
`sitecustomize.py` first on PYTHONPATH and exec the same interpreter on the script. Python
imports that bootstrap at start-up, before the script, and the bootstrap attaches the agent.
The script then runs as under plain `python train.py ARGS...`: the same sys.argv, __main__,
sys.path, tracebacks, exit code and signals, and the same pid, because exec replaces this
process (torchrun, which starts `python -m tuneup run train.py` per rank, still supervises
the process that trains). The bootstrap puts PYTHONPATH back at once, so the job's own
children (DataLoader workers, subprocesses) never see it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..format import plural

__all__ = ["exec_script", "ExitLine", "LaunchError"]

_BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"

# Read and removed by bootstrap/sitecustomize.py, which spells them out too: the pid it may
# attach in, and PYTHONPATH as it was (absent when PYTHONPATH was unset, so it can be unset again).
_PID_VARIABLE = "TUNEUP_LAUNCH_PID"
_PYTHONPATH_VARIABLE = "TUNEUP_LAUNCH_PYTHONPATH"


class LaunchError(Exception):
    """The script or module cannot be launched; the message is one line: the problem and the fix."""


def exec_script(
    target: str,
    args: list[str],
    *,
    module: bool = False,
    env_overrides: dict[str, str] | None = None,
) -> NoReturn:
    """Replace this process with `python target args...` (or `python -m target args...`), measured.

    Raises LaunchError before exec for a script that is missing, a directory without
    __main__.py, or unreadable, and for an empty module name. A module's existence is not
    checked here: importing it would run its package's code in this process; Python reports
    a missing module itself, exactly as `python -m` does.
    """
    if module:
        if not target.strip():
            raise LaunchError("-m needs a module name, e.g. -m mypackage.train")
        command = [sys.executable, "-m", target, *args]
    else:
        _check_script(target)
        command = [sys.executable, target, *args]
    env = dict(os.environ)
    original = env.get("PYTHONPATH")
    env.pop(_PYTHONPATH_VARIABLE, None)
    if original is not None:
        env[_PYTHONPATH_VARIABLE] = original
    env["PYTHONPATH"] = os.pathsep.join([str(_BOOTSTRAP_DIR), *([original] if original else [])])
    env[_PID_VARIABLE] = str(os.getpid())
    env.update(env_overrides or {})
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()  # exec discards anything still buffered in this process
    os.execve(sys.executable, command, env)


class ExitLine:
    """What `tuneup run` says on stderr as the job ends: its findings and the command that
    prints their advice, e.g.

        tuneup: 3 findings in 400 steps (data-stall, host-syncs, cpu-oversubscribed); the advice: tuneup report tuneup-runs/20261203-…

    Registered with atexit before attach() (so it runs after the agent's own detach), said
    only where the job ended cleanly (no traceback of its own is then followed by ours: an
    unhandled exception leaves sys.last_value), trained at least one step, has a run log, and
    is rank 0 or not distributed (thousands of ranks would print thousands of lines)."""

    def __init__(self) -> None:
        self.agent: Any = None

    def say(self) -> None:
        try:
            line = self.line()
            if line is not None and sys.stderr is not None:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:  # nothing of tuneup's may change how the job exits
            pass

    def line(self) -> str | None:
        agent = self.agent
        if agent is None or not agent.enabled or agent.run_dir is None or hasattr(sys, "last_value"):
            return None
        if agent.run_info.get("rank") not in (None, 0):
            return None
        steps = agent.snapshot()["totals"]["steps"]
        if not steps:
            return None
        findings = [finding["rule"] for finding in agent.findings()]
        said = (f"{plural(len(findings), 'finding')} in {steps:,} steps "
                f"({', '.join(findings[:4])}{', …' if len(findings) > 4 else ''})" if findings
                else f"no findings in {steps:,} steps")
        kept = [record["change"] for record in agent.actions()
                if record.get("decision") in ("kept", "set at start") and record.get("change")]
        if kept:
            said += f"; apply mode kept {', '.join(kept[:3])}{', …' if len(kept) > 3 else ''}"
        return f"tuneup: {said}; the {'advice' if findings else 'report'}: tuneup report {agent.run_dir}"


def _check_script(target: str) -> None:
    path = Path(target)
    if not target.strip():
        raise LaunchError("the script's path is empty: give it as `tuneup run train.py`")
    try:
        _check_script_path(target, path)
    except OSError as exc:  # a name too long, a folder this user may not search (python: "can't open file")
        raise LaunchError(f"cannot open the script {target!r}: {exc.strerror or exc}") from None


def _check_script_path(target: str, path: Path) -> None:
    if not path.exists():
        raise LaunchError(f"no script at {target!r}; check the path (for a module, use -m package.module)")
    if path.is_dir() and not (path / "__main__.py").is_file():
        raise LaunchError(
            f"{target!r} is a directory without __main__.py; give the training script's path instead"
        )
    if not os.access(path, os.R_OK):
        raise LaunchError(f"cannot read {target!r}; check its permissions")
