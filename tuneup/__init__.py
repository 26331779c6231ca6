"""tuneup: a live performance-tuning advisor for PyTorch training jobs.

    import tuneup
    agent = tuneup.attach()          # finds loaders, optimizers, scalers and models itself
    ...train...
    print(agent.snapshot())          # or read the run log tuneup printed

Options come from keyword arguments or TUNEUP_* environment variables (see
`tuneup.options.ENVIRONMENT_VARIABLES`); TUNEUP_DISABLE=1 turns the agent into a no-op.
"""

from __future__ import annotations

from ._version import __version__

import functools
import os
import sys
import threading
import warnings
from typing import Any, Callable, TypeVar

from .options import ENVIRONMENT_VARIABLES, TuneupWarning, resolve

__all__ = ["attach", "step", "step_function", "current", "Agent", "TuneupWarning", "ENVIRONMENT_VARIABLES"]

_current: Any = None  # the Agent of this process
_lock = threading.RLock()
F = TypeVar("F", bound=Callable[..., Any])


def attach(*objects: Any, **options: Any) -> "Agent":
    """Start measuring this training job; returns the process's Agent.

    With no objects every DataLoader, Optimizer, GradScaler and model is found, including
    ones created later. Objects given narrow their kind to those objects (a kind you name
    none of is still found automatically). Attaching again returns the same agent.

    Options (keyword, or the TUNEUP_* variable `ENVIRONMENT_VARIABLES` names; the README's
    table says what each does): mode, actions, run_dir, log, log_max_bytes, interval,
    sync_sample_every, detail_every, window_steps, gpu, nvml_module, disable, serve, host, port,
    push_gateway, push_interval, push_job, silence, cpu_bf16.
    """
    global _current
    from .agent import Agent
    from .integrations import framework_of, install

    trainers = [obj for obj in objects if framework_of(obj) is not None]
    if trainers:  # Lightning / Transformers: their callback focuses the agent when training starts
        resolve(options)  # a bad keyword argument raises here, at the call site
        for trainer in trainers:
            install(trainer, options)
        objects = tuple(obj for obj in objects if framework_of(obj) is None)
    with _lock:
        if _current is not None and (_current.attached or not _current.enabled):
            _current.add(objects)
            return _current
        settings = resolve(options)  # a bad keyword argument raises here, at the call site
        Agent.check_objects(objects)
        reason = _inert_reason(settings)
        if reason is None:
            try:
                agent = Agent(settings, objects, on_detach=_forget).start()
            except Exception as exc:  # tuneup's own failure must not stop the job
                warnings.warn(
                    f"tuneup: agent could not start ({type(exc).__name__}: {exc}); training continues unmeasured",
                    TuneupWarning,
                    stacklevel=2,
                )
                agent = Agent(settings, objects, inert_reason=f"start-up failed: {exc}")
        else:
            agent = Agent(settings, objects, inert_reason=reason)
        _current = agent
        return agent


def current() -> "Agent | None":
    """The attached agent of this process, if any."""
    return _current


def step() -> None:
    """Mark the end of a training step, for loops without an optimizer."""
    agent = _current
    if agent is not None:
        agent.step()


def step_function(function: F) -> F:
    """Decorator: each call of `function` is one training step."""

    @functools.wraps(function)
    def measured_step(*args: Any, **kwargs: Any) -> Any:
        agent = _current
        if agent is not None and agent.attached:
            agent.begin_step()
        try:
            return function(*args, **kwargs)
        finally:
            if agent is not None:
                agent.step()

    return measured_step  # type: ignore[return-value]


def _inert_reason(settings: Any) -> str | None:
    if settings.disable:
        return "turned off by TUNEUP_DISABLE"
    import torch.utils.data

    if torch.utils.data.get_worker_info() is not None:
        return "inside a DataLoader worker process"
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return "inside a spawned worker that is re-importing the main module"
        frame = frame.f_back
    return None


def _forget(agent: Any) -> None:
    global _current
    with _lock:
        if _current is agent:
            _current = None


def _after_fork_in_child() -> None:
    global _current
    agent = _current
    if agent is not None:
        agent.forked()
    _current = None
    _lock._at_fork_reinit()  # type: ignore[attr-defined]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from .agent import Agent

        return Agent
    raise AttributeError(f"module 'tuneup' has no attribute {name!r}")
