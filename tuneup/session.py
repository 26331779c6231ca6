"""The process's agent: attach without frameworks, current(), step marks, and the fork rule.

The package root adds the frameworks (`tuneup.attach(trainer)` installs a callback from
integrations/); the callbacks attach through here, so nothing imports the package root back.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any, Callable, TypeVar

from ._patching import unwind
from ._warning import warn
from .options import resolve

_current: Any = None  # the Agent of this process
_lock = threading.RLock()
F = TypeVar("F", bound=Callable[..., Any])


def attach(objects: tuple[Any, ...] = (), options: dict[str, Any] | None = None) -> "Agent":
    """tuneup.attach() for objects that are not trainers: the process's agent, started once;
    attaching again adds the objects to it."""
    global _current
    from .agent import Agent
    from .measure.objects import sort_objects

    with _lock:
        if _current is not None and (_current.attached or not _current.enabled):
            _check_against(_current.options, options or {})
            _current.add(objects)
            return _current
        settings = resolve(options or {})  # a bad keyword argument raises here, at the call site
        sort_objects(objects)  # an object attach() cannot measure: TypeError, with the fix
        reason = _inert_reason(settings)
        if reason is None:
            try:
                agent = Agent(settings, objects, on_detach=_forget).start()
            except Exception as exc:  # tuneup's own failure must not stop the job
                warn(f"tuneup: agent could not start ({type(exc).__name__}: {exc}); training continues unmeasured")
                agent = Agent(settings, objects, inert_reason=f"start-up failed: {exc}")
        else:
            agent = Agent(settings, objects, inert_reason=reason)
        _current = agent
        return agent


def _check_against(running: Any, options: dict[str, Any]) -> None:
    """A later attach() with options: bad ones raise as on the first call; ones that differ
    from the running agent's cannot be applied to it, and a warning names them."""
    if not options:
        return
    wanted = resolve(options, environ={})
    differ = [f"{name}={getattr(wanted, name)!r} (running: {getattr(running, name)!r})"
              for name in options if options[name] is not None and getattr(wanted, name) != getattr(running, name)]
    if differ:
        warn(f"tuneup: already attached (by `tuneup run` or an earlier attach()), so these options were not applied: "
             f"{', '.join(differ)}; give them where the agent starts (the first attach(), or tuneup run's options "
             "and TUNEUP_* variables)")


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
        except BaseException as exc:
            unwind(exc)  # the job's own traceback, as without the decorator (_patching.py)
            raise
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
