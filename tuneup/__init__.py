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

from typing import Any

from . import session
from ._warning import TuneupWarning
from .options import ENVIRONMENT_VARIABLES, resolve
from .session import current, step, step_function

__all__ = ["attach", "step", "step_function", "current", "Agent", "TuneupWarning", "ENVIRONMENT_VARIABLES"]


def attach(*objects: Any, **options: Any) -> "Agent":
    """Start measuring this training job; returns the process's Agent.

    With no objects every DataLoader, Optimizer, GradScaler and model is found, including
    ones created later. Objects given narrow their kind to those objects (a kind you name
    none of is still found automatically). Attaching again returns the same agent.

    Options (keyword, or the TUNEUP_* variable `ENVIRONMENT_VARIABLES` names; the README's
    table says what each does): mode, actions, run_dir, log, log_max_bytes, log_shared, interval,
    sync_sample_every, detail_every, window_steps, gpu, nvml_module, disable, serve, host, port,
    push_gateway, push_interval, push_job, training_job, silence, cpu_bf16.
    """
    from .integrations import accelerate_settings, framework_of, install
    from .integrations.watch import watch_trainers

    trainers = [obj for obj in objects if framework_of(obj) is not None]
    if trainers:  # Lightning / Transformers: their callback focuses the agent when training starts
        resolve(options)  # a bad keyword argument raises here, at the call site
        for trainer in trainers:
            install(trainer, options)
        objects = tuple(obj for obj in objects if framework_of(obj) is None)
    agent = session.attach(objects, options)
    # A framework's Trainer built from now on gets tuneup's callback (`tuneup run`: no code change).
    watch_trainers(agent)
    accelerate = accelerate_settings(objects)  # Accelerate's prepared objects: the fixes speak it
    if accelerate is not None:
        agent.note_framework(accelerate)
    return agent


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from .agent import Agent

        return Agent
    raise AttributeError(f"module 'tuneup' has no attribute {name!r}")
