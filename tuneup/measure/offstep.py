"""Running the job's own model between two steps, unseen: what the precision trial
(precision.py) and the FLOP count (flops.py) share.

Both take a training forward's input on a detail step, handed over by the model probe's
wrapper of the trained root's forward (the largest, if several) before the forward runs, then,
at that step's close on the training thread, run the model through torch.func.functional_call
on parameters and buffers of their own. Nothing is put on the model while one waits: a module
hook of ours would be compiled by torch.jit.script(model) (torch/jit/_recursive.py
get_hook_stubs compiles every forward hook and pre-hook on the module) and copied by
copy.deepcopy(model) and torch.save(model), with the probe it is bound to. While they do,
every module hook of the model is set aside (the job's and tuneup's: none sees these forwards)
and tuneup's model probe is off (its class-level forward wrapper passes through). A job with
global module hooks is left alone: they would see the forwards.
"""

from __future__ import annotations

import sys
import threading
import weakref
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


MISSES = 3  # detail steps in a row with no training forward of the model: the capture gives up


class ModelCapture:
    """A one-shot capture of the largest trained model's next training forward on a detail
    step, to run it off the step at that step's close (the precision trial's and the FLOP
    count's): `capture` puts it in the model probe's waiting list, the probe's root-forward
    wrapper calls `take` before the forward (the subclass's `_seen` keeps the input),
    `skip(reason)` ends it without one, `release` takes it off the list; `_failure` keeps what
    `_seen` raised for the close."""

    state = "waiting"

    def __init__(self, model_probe: Any) -> None:
        self.models = model_probe  # the list of waiting captures; off while the model runs unseen
        self._root: Any = None  # a weak reference to the root whose forward is awaited
        self._model: nn.Module | None = None  # the module to run: the root, or DDP's inner one
        self._input: Any = None
        self._skip: str | None = None  # set by _seen: why the step gives nothing to run
        self._failure: Exception | None = None
        self._missed = 0

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def skip(self, reason: str) -> None:
        raise NotImplementedError

    def capture(self, models: list[nn.Module]) -> None:
        """Wait for the largest trained model's next training forward on a detail step, or skip
        with why no model can be run unseen."""
        root = largest(models)
        target = unwrapped(root)
        if isinstance(target, str):
            self.skip(target)
        elif global_hooks():
            self.skip("global module hooks the job registered would see its forwards")
        else:
            self.state, self._model, self._root, self._missed = "capturing", target, weakref.ref(root), 0
            # A new capture waits for a new forward: an input a capture before it kept (its
            # step not closed yet) would be taken at the next call of the model's forward of any
            # kind (jit.trace checks its trace by calling the Python forward under no_grad).
            self._input = self._skip = self._failure = None
            self.release()
            self.models.captures.append(self)

    def take(self, root: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before an outermost training forward of a root on a detail step (its inputs, without
        the module), inside the job's forward: `_seen` never raises."""
        if self._root is None or self._root() is not root:
            return
        self._seen(self._model, args, kwargs)
        if self._input is not None or self._skip is not None or self._failure is not None:
            self.state = "captured"
            self.release()

    def over(self) -> bool:
        """At a detail step's close: whether the capture is over, to be finished now (it took
        the forward's input, or gave up after MISSES such steps without a training forward of
        its model)."""
        if self.state != "capturing":
            return self.state == "captured"
        self._missed += 1
        return self._missed >= MISSES

    def release(self) -> None:
        if self in self.models.captures:
            self.models.captures.remove(self)


class _Muted:
    """sys.stdout while tuneup runs the job's forward itself: what this thread writes (a
    forward's own `print(x.shape)`, 50 times over in a precision trial) is dropped; every other
    thread's goes through. stderr is left alone: a warning shown there is recorded as shown
    (the warnings registry), and dropped it would be lost to the job."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._thread = stream, threading.get_ident()

    def write(self, text: str) -> int:
        if threading.get_ident() == self._thread:
            return len(text)
        return self._stream.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def unseen(model: nn.Module, model_probe: Any) -> Iterator[None]:
    """The block runs `model` with its modules' hooks set aside, the model probe off and what
    the forward prints dropped (_Muted), and leaves each module's own attributes as it found
    them (_ModuleState)."""
    hooks = [(m, name, getattr(m, name)) for m in model.modules() for name in _HOOK_DICTS if hasattr(m, name)]
    state = _ModuleState(model)
    probe_on, model_probe.on = model_probe.on, False
    stdout = sys.stdout
    muted = sys.stdout = _Muted(stdout) if stdout is not None else None
    try:
        for m, name, _ in hooks:
            setattr(m, name, type(getattr(m, name))())
        yield
    finally:
        if muted is not None and sys.stdout is muted:  # (one the forward put there itself stays)
            sys.stdout = stdout
        for m, name, original in hooks:
            setattr(m, name, original)
        model_probe.on = probe_on
        state.restore()


# torch's own bookkeeping in a module's __dict__: put back by functional_call and by unseen itself
_TORCH_KEYS = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOK_DICTS))
_CONTAINERS = (list, dict, set)
CLONE_LIMIT = 64 << 20  # bytes of plain tensor attributes copied, at most (a larger one is only watched)


class _ModuleState:
    """The Python state a forward may keep in its modules' attributes, as it is now, to put
    back after tuneup ran the forward itself (the precision trial, the FLOP count): a counter
    (`self.n += 1`), a statistic kept as a plain tensor, not a buffer (`self.mean = 0.99 *
    self.mean + ...`, or `+=` in place), a queue (MoCo's memory bank: `self.queue.append(...)`).
    Left as the trial's forwards left them, the job's next forward read them, and advise mode
    changed its losses (a running mean over 50 extra forwards). Every attribute is put back;
    lists, dicts and sets get their contents back; a plain tensor changed in place gets its
    values back where it was copied (all of them up to CLONE_LIMIT bytes: a larger one changed
    in place stays changed). State outside the modules (a global, a print) is not the model's
    and is not undone."""

    def __init__(self, model: nn.Module) -> None:
        import torch

        self.saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        budget = CLONE_LIMIT
        for module in model.modules():
            attributes = {k: v for k, v in vars(module).items() if k not in _TORCH_KEYS}
            contents: dict[str, Any] = {}
            for key, value in attributes.items():
                if type(value) in _CONTAINERS:
                    contents[key] = value.copy()
                elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    size = value.nelement() * value.element_size()
                    copy = value.detach().clone() if size <= budget and value.device.type != "meta" else None
                    budget -= size if copy is not None else 0
                    contents[key] = (value._version, copy)
            self.saved.append((module, attributes, contents))

    def restore(self) -> None:
        import torch

        for module, attributes, contents in self.saved:
            own = vars(module)
            for key in [k for k in own if k not in _TORCH_KEYS and k not in attributes]:
                del own[key]  # set by the forward
            own.update(attributes)
            for key, kept in contents.items():
                value = attributes[key]
                if isinstance(value, torch.Tensor):
                    version, copy = kept
                    if value._version != version and copy is not None:
                        with torch.no_grad():
                            value.copy_(copy)
                elif isinstance(value, list):
                    value[:] = kept
                else:
                    value.clear()
                    value.update(kept)
