"""The category of every warning tuneup emits, and the one function that emits them, in a
module of its own so that any room can warn without importing the options (which import the
rule and action catalogs)."""

from __future__ import annotations

import os
import sys
import threading
import warnings


class TuneupWarning(UserWarning):
    """Every warning the agent emits has this category, so users can filter them."""


# Frames in these folders are passed over: a warning names the job's own line that led to it
# (the attach() call, the optimizer.step() whose hook found the problem), not tuneup's or
# torch's code in between. (Python 3.12's warnings.warn(skip_file_prefixes=...) does this.)
_TUNEUP = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THREADING = os.path.abspath(threading.__file__)
_OWN_REGISTRY: dict = {}


def _passed_over() -> tuple[str, ...]:
    torch = sys.modules.get("torch")  # not imported for it: the CLI's reports run without torch
    where = getattr(torch, "__file__", None)
    return (_TUNEUP, "<frozen") + ((os.path.dirname(os.path.abspath(where)) + os.sep,) if where else ())


def warn(message: str) -> None:
    """Warn with TuneupWarning, at the first frame of this thread outside tuneup and torch: one
    `file:line: TuneupWarning: message` line and the job's line of code under it. On a thread
    that runs only tuneup's code (the sampler), there is no line of the job's to show: the
    warning is attributed to `tuneup` itself, and is one line."""
    passed_over = _passed_over()
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(passed_over):
        frame, level = frame.f_back, level + 1
    own = frame is None or os.path.abspath(frame.f_code.co_filename) == _THREADING
    try:
        if own:
            warnings.warn_explicit(message, TuneupWarning, "tuneup", 0, module="tuneup", registry=_OWN_REGISTRY)
        else:
            warnings.warn(message, TuneupWarning, stacklevel=level + 1)
    except Exception:
        # The job's filters make warnings errors (warnings.simplefilter("error"), -W error): raised
        # here, tuneup's would end the job from inside a probe, an optimizer step or attach(). It is
        # shown instead, as the default filter shows it (and a custom showwarning that raises
        # is passed over: nothing of tuneup's may stop the job).
        try:
            filename, line = ("tuneup", 0) if own else (frame.f_code.co_filename, frame.f_lineno)
            warnings.showwarning(message, TuneupWarning, filename, line)
        except Exception:
            pass
