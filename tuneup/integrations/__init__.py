"""Framework integrations: a Lightning Callback and a Hugging Face TrainerCallback that attach
the agent to the framework's own training objects (its training DataLoaders, optimizers,
model and GradScaler; its validation loaders left out) and record the framework's settings.

`tuneup.attach(trainer)` installs the right one; neither framework is imported unless the job
already uses it (`pip install tuneup[lightning]` / `tuneup[hf]` for the frameworks themselves).
"""

from __future__ import annotations

from typing import Any


def framework_of(obj: Any) -> str | None:
    """"lightning" or "transformers" for a framework's Trainer, else None (by the class's
    module: importing a framework only to ask would cost seconds)."""
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if cls.__name__ == "Trainer" and module.split(".")[0] in ("lightning", "pytorch_lightning"):
            return "lightning"
        if cls.__name__ == "Trainer" and module.split(".")[0] == "transformers":
            return "transformers"
    return None


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


def loaders_in(value: Any) -> list[Any]:
    """Every DataLoader in a framework's collection of loaders (a loader, a list, a dict, or
    Lightning's CombinedLoader)."""
    from torch.utils.data import DataLoader

    if isinstance(value, DataLoader):
        return [unwrap_loader(value)]
    flattened = getattr(value, "flattened", None)  # Lightning's CombinedLoader
    if isinstance(flattened, list):
        return [loader for item in flattened for loader in loaders_in(item)]
    if isinstance(value, dict):
        return [loader for item in value.values() for loader in loaders_in(item)]
    if isinstance(value, (list, tuple)):
        return [loader for item in value for loader in loaders_in(item)]
    return []


def unwrap_loader(loader: Any) -> Any:
    """The torch DataLoader that really iterates (Accelerate's DataLoaderShard/Dispatcher wrap
    one as `base_dataloader` and only pass for a DataLoader)."""
    from torch.utils.data import DataLoader

    base = getattr(loader, "base_dataloader", None)
    return base if isinstance(base, DataLoader) and base is not loader else loader


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer): the one whose step hooks fire."""
    import torch

    inner = optimizer
    for _ in range(4):
        wrapped = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer) or wrapped is inner:
            break
        inner = wrapped
    return inner
