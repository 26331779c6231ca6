"""Framework integrations: a Lightning Callback and a Hugging Face TrainerCallback that attach
the agent to the framework's own training objects (its training DataLoaders, optimizers,
model and GradScaler; its validation loaders left out) and record the framework's settings.

`tuneup.attach(trainer)` installs the right one; neither framework is imported unless the job
already uses it (`pip install tuneup[lightning]` / `tuneup[hf]` for the frameworks themselves).
"""

from __future__ import annotations

from typing import Any

from ..measure.objects import framework_of, loaders_in, unwrap_loader, unwrap_optimizer

__all__ = ["accelerate_settings", "framework_of", "install", "loaders_in", "unwrap_loader", "unwrap_optimizer"]


def accelerate_settings(objects: tuple[Any, ...]) -> dict[str, Any] | None:
    """Accelerate's settings, where attach() was given what `accelerator.prepare` returned (an
    AcceleratedOptimizer holds the process's AcceleratorState and GradientState:
    accelerate/optimizer.py): the framework the fixes speak; None otherwise."""
    optimizer = next((obj for obj in objects if type(obj).__module__.startswith("accelerate.")
                      and hasattr(obj, "accelerator_state")), None)
    if optimizer is None:
        return None
    import accelerate

    state, gradients = optimizer.accelerator_state, getattr(optimizer, "gradient_state", None)
    return {"framework": "accelerate", "version": accelerate.__version__,
            "mixed_precision": str(getattr(state, "mixed_precision", None)),
            "gradient_accumulation_steps": getattr(gradients, "num_steps", None),
            "distributed_type": str(getattr(state, "distributed_type", None))}


def install(trainer: Any, options: dict[str, Any]) -> None:
    """Give the trainer tuneup's callback (once); it ends the measurement at train end (what
    `tuneup.attach(trainer)` promises: the job's code after fit()/train() is not a step)."""
    kind = framework_of(trainer)
    if kind == "lightning":
        from .lightning import TuneupCallback

        callback = next((cb for cb in trainer.callbacks if isinstance(cb, TuneupCallback)), None)
        if callback is None:
            callback = TuneupCallback(**options)
            trainer.callbacks.append(callback)
        callback.ends_measurement = True
    elif kind == "transformers":
        from .hf import TuneupTrainerCallback

        callback = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TuneupTrainerCallback)), None)
        if callback is None:
            callback = TuneupTrainerCallback(**options)
            trainer.add_callback(callback)
        callback.ends_measurement = True
