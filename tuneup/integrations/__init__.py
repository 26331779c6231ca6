"""Framework integrations: a Lightning Callback and a Hugging Face TrainerCallback that attach
the agent to the framework's own training objects (its training DataLoaders, optimizers,
model and GradScaler; its validation loaders left out) and record the framework's settings.

`tuneup.attach(trainer)` installs the right one; neither framework is imported unless the job
already uses it (`pip install tuneup[lightning]` / `tuneup[hf]` for the frameworks themselves).
"""

from __future__ import annotations

from typing import Any

from ..measure.objects import framework_of, loaders_in, unwrap_loader, unwrap_optimizer

__all__ = ["framework_of", "install", "loaders_in", "unwrap_loader", "unwrap_optimizer"]


def install(trainer: Any, options: dict[str, Any]) -> None:
    """Give the trainer tuneup's callback (once)."""
    kind = framework_of(trainer)
    if kind == "lightning":
        from .lightning import TuneupCallback

        if not any(isinstance(cb, TuneupCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(TuneupCallback(**options))
    elif kind == "transformers":
        from .hf import TuneupTrainerCallback

        if not any(isinstance(cb, TuneupTrainerCallback) for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(TuneupTrainerCallback(**options))
