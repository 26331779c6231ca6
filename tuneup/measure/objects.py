"""Object sorting: which of the objects a job hands to `attach()` tuneup measures, and the
torch object inside a framework's wrapper (Accelerate, Lightning) that really does the work."""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.utils.data import DataLoader

KINDS = ("loaders", "models", "optimizers", "scalers")


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


def loaders_in(value: Any) -> list[Any]:
    """Every DataLoader in a framework's collection of loaders (a loader, a list, a dict, or
    Lightning's CombinedLoader)."""
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
    base = getattr(loader, "base_dataloader", None)
    return base if isinstance(base, DataLoader) and base is not loader else loader


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer): the one whose step hooks fire."""
    inner = optimizer
    for _ in range(4):
        wrapped = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer) or wrapped is inner:
            break
        inner = wrapped
    return inner


def sort_objects(objects: Iterable[Any]) -> dict[str, list[Any]]:
    """The objects by kind, unwrapped; a framework's Trainer is skipped (attach() installs its
    callback). Raises TypeError, with the fix, for anything tuneup cannot measure."""
    kinds: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    for obj in objects:
        if isinstance(obj, DataLoader):
            kinds["loaders"].append(unwrap_loader(obj))
        elif isinstance(obj, nn.Module):
            kinds["models"].append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            kinds["optimizers"].append(unwrap_optimizer(obj))
        elif isinstance(obj, GradScaler):
            kinds["scalers"].append(obj)
        elif framework_of(obj) is not None:
            continue
        elif inspect.isfunction(obj) or inspect.ismethod(obj):
            raise TypeError(
                "tuneup.attach cannot patch a plain function in place: decorate your step "
                "function with @tuneup.step_function, or call tuneup.step() at the end of each step"
            )
        else:
            raise TypeError(
                f"tuneup.attach cannot measure a {type(obj).__name__}: pass DataLoaders, nn.Modules, "
                "Optimizers or GradScalers, or nothing at all to find them automatically"
            )
    return kinds


class Tracked:
    """The objects the job named, per kind, held weakly (the job owns them). A kind it named
    none of is measured in full (None)."""

    def __init__(self, kinds: dict[str, list[Any]]) -> None:
        self.loaders = weakref.WeakSet(kinds["loaders"]) if kinds["loaders"] else None
        self.optimizers = weakref.WeakSet(kinds["optimizers"]) if kinds["optimizers"] else None
        self.scalers = weakref.WeakSet(kinds["scalers"]) if kinds["scalers"] else None
        self.models = bool(kinds["models"])
