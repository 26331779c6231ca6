"""Running the job's own model between two steps, unseen: what the precision trial
(precision.py) and the FLOP count (flops.py) share.

Both capture a training forward's input with a one-shot forward pre-hook on the trained model
(the largest, if several), then, at the next step close on the training thread, run the model
through torch.func.functional_call on parameters and buffers of their own. While they do,
every module hook of the model is set aside (the job's and tuneup's: none sees these forwards)
and tuneup's model probe is off (its class-level forward wrapper passes through). A job with
global module hooks is left alone: they would see the forwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn
from torch.nn.modules import module as _module

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def unwrapped(model: nn.Module) -> nn.Module | str:
    """The module to run: DDP's and DataParallel's inner one (their forward would talk to the
    other ranks or replicate), or why there is none."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return model.module
    if type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule") or any(
            type(m).__name__.startswith("FullyShardedDataParallel") for m in model.modules()):
        return "an FSDP model (sharded parameters)"
    return model


def largest(models: list[nn.Module]) -> nn.Module:
    return max(models, key=lambda model: sum(p.numel() for p in model.parameters()))


def global_hooks() -> bool:
    """Whether module hooks are registered globally (by the job): they would see the forwards."""
    return any(getattr(_module, name, None) for name in _GLOBAL_HOOKS)


def own_hooks_on(model: nn.Module) -> bool:
    """Whether a hook of tuneup's own is on the model's modules or global now (a capture's,
    for one step; the model finder's, until the first step)."""
    dicts = [getattr(m, name, None) for m in model.modules() for name in _HOOK_DICTS]
    dicts += [getattr(_module, name, None) for name in _GLOBAL_HOOKS]
    return any(str(getattr(hook, "__module__", "") or "").startswith("tuneup.")
               for hooks in dicts for hook in (hooks or {}).values())


class ModelCapture:
    """A one-shot capture of the largest trained model's next training forward, to run it off
    the step at the close after (the precision trial's and the FLOP count's): `capture` hooks
    the model with the subclass's pre-hook `_seen`, `skip(reason)` ends it without one,
    `remove_hooks` unhooks; `_failure` keeps what the hook raised for the close."""

    state = "waiting"

    def __init__(self) -> None:
        self._handle: Any = None
        self._model: nn.Module | None = None
        self._input: Any = None
        self._failure: Exception | None = None

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def skip(self, reason: str) -> None:
        raise NotImplementedError

    def capture(self, models: list[nn.Module]) -> None:
        """Hook the largest trained model (DDP's inner one) for its next forward, or skip with
        why no model can be run unseen."""
        target = unwrapped(largest(models))
        if isinstance(target, str):
            self.skip(target)
        elif global_hooks():
            self.skip("global module hooks the job registered would see its forwards")
        else:
            self.state, self._model = "capturing", target
            self._handle = target.register_forward_pre_hook(self._seen, with_kwargs=True)

    def remove_hooks(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()


@contextmanager
def unseen(model: nn.Module, model_probe: Any) -> Iterator[None]:
    """The block runs `model` with its modules' hooks set aside and the model probe off."""
    hooks = [(m, name, getattr(m, name)) for m in model.modules() for name in _HOOK_DICTS if hasattr(m, name)]
    probe_on, model_probe.on = model_probe.on, False
    try:
        for m, name, _ in hooks:
            setattr(m, name, type(getattr(m, name))())
        yield
    finally:
        for m, name, original in hooks:
            setattr(m, name, original)
        model_probe.on = probe_on
