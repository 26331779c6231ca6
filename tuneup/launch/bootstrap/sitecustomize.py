"""Imported by Python at start-up in a process that `tuneup run` exec'd: attach, then get out of the way.

This directory holds nothing but this file, so being first on sys.path shadows nothing else.
First PYTHONPATH, sys.path and the environment lose every trace of the launch, so the job's
children (DataLoader workers, subprocesses) start as they would without tuneup. Then the
sitecustomize this one shadowed (the user's or the distribution's) runs, as Python would
have run it. Last, the agent attaches, only in the process the launcher became: a failure
prints one line and the job runs unmeasured, as it would without tuneup.
"""

import os
import site
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

_launcher_pid = os.environ.pop("TUNEUP_LAUNCH_PID", None)  # the variables tuneup/launch sets
if _launcher_pid is not None:
    _pythonpath = os.environ.pop("TUNEUP_LAUNCH_PYTHONPATH", None)  # absent: PYTHONPATH was unset
    if _pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = _pythonpath
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry) != _HERE]

# Out of sys.modules for a moment, so that importing sitecustomize finds the next one. Back in
# when there is none: the import system that is importing this module expects to find it there.
_this = sys.modules.pop("sitecustomize")
site.execsitecustomize()  # reports a failure of that one the way Python's start-up does, and goes on
sys.modules.setdefault("sitecustomize", _this)

if _launcher_pid == str(os.getpid()):
    try:
        import importlib.util

        if importlib.util.find_spec("tuneup") is None:  # launched from a source checkout
            sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        import atexit

        import tuneup
        from tuneup.launch import ExitLine

        _exit_line = ExitLine()
        atexit.register(_exit_line.say)  # before attach(): atexit runs it after the agent's detach
        _exit_line.agent = tuneup.attach()
    except Exception as exc:
        print(f"tuneup: could not attach: {type(exc).__name__}: {' '.join(str(exc).split())} "
              "(the script runs unmeasured)", file=sys.stderr)
