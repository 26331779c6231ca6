"""zero_grad(set_to_none=True) where the job calls zero_grad(set_to_none=False).

Same numerics for every parameter that receives a gradient each step: backward writes a
fresh gradient instead of adding it to zeros. The one difference is a parameter that gets
no gradient in a step: with zeros the optimizer still updates it (momentum, weight decay),
with None it skips it. So while the change is in effect a step pre-hook checks, before
each update, that every parameter that had a gradient still has one; if one has none it
puts the zeros back (the update is exactly the one the job would have made) and the change
is rolled back. Every step is checked during the guard period, then the detail steps.

Kept unless measurably slower: what it buys is mostly memory between steps (gradients are
freed), and PyTorch made it the default in 2.0. Code that reads `.grad` between
zero_grad() and backward() would see None: leave this action out (TUNEUP_ACTIONS) there.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..._patching import PatchSet, posing_as
from ..action import NOT_SLOWER, Action, Change, LiveJob

GUARD_STEPS = 200


# zero_grad with set_to_none=True, however the loop calls it; it poses as the original (see
# posing_as: Optimizer.zero_grad is one dynamo skips, and a compiled step must still skip it).
_SET_TO_NONE = """
def zero_grad(self, *args, **kwargs):
    if args:
        return _tuneup_original(self, True, *args[1:], **kwargs)
    kwargs["set_to_none"] = True
    return _tuneup_original(self, **kwargs)
"""


def _forcing_set_to_none(original):
    return posing_as(original, _SET_TO_NONE, _tuneup_original=original)


class ZeroGradChange(Change):
    action = "zero-grad"
    description = "zero_grad(set_to_none=False) -> zero_grad(set_to_none=True)"
    keep = NOT_SLOWER
    affects_numerics = False  # the same update for every parameter that gets a gradient (guarded)

    def __init__(self, job: LiveJob, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__()
        self.before = {"set_to_none": False}
        self.after = {"set_to_none": True}
        self.guard_steps = GUARD_STEPS
        self.job = job
        self.patches = PatchSet()
        self.guard_until = 0
        # The parameters that have a gradient now, per optimizer: each must keep getting one.
        self.expected: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[weakref.ref]] = \
            weakref.WeakKeyDictionary()
        for optimizer in optimizers:
            self.expected[optimizer] = [weakref.ref(p) for group in optimizer.param_groups
                                        for p in group["params"] if p.grad is not None]

    def apply(self) -> None:
        self.guard_until = self.job.timeline.ring.count + 1 + self.guard_steps
        self.patches.replace(torch.optim.Optimizer, "zero_grad", _forcing_set_to_none)
        self.patches.replace(nn.Module, "zero_grad", _forcing_set_to_none)
        self.job.add_guard(self._before_update)

    def _before_update(self, optimizer: torch.optim.Optimizer) -> None:
        timeline = self.job.timeline
        if id(optimizer) in self.job.skipping:
            return  # another guard hides this update's gradients: it is skipped, zeros would move it
        if not (self.rollback_reason or timeline.ring.count < self.guard_until or timeline.detail):
            return  # after a rollback, every optimizer until the revert (a second one in the step)
        expected = self.expected.get(optimizer)
        if not expected:
            return
        missing = [p for p in (ref() for ref in expected) if p is not None and p.grad is None]
        if not missing:
            return
        for parameter in missing:  # exactly what zero_grad(set_to_none=False) would have left
            parameter.grad = torch.zeros_like(parameter)
        self.patches.undo_all()  # the next zero_grad keeps tensors again
        if self.rollback_reason is None:
            self.rollback_reason = (f"{len(missing)} parameter(s) got no gradient at step "
                                    f"{timeline.ring.count + 1}: with set_to_none=True the optimizer would "
                                    "have skipped them; zeros restored")

    def revert(self) -> None:
        self.patches.undo_all()
        self.job.remove_guard(self._before_update)


class ZeroGradSetToNone(Action):
    id = "zero-grad"
    title = "Free gradients instead of zeroing them"
    fixes = ("zero-grad-keeps-tensors",)
    summary = ("zero_grad(set_to_none=True); kept unless slower (it frees gradient memory between steps); "
               "rolled back, with the zeros put back, when a parameter gets no gradient.")

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        if job.finding(*self.fixes) is None:
            return None
        if job.optimizers.set_to_none:
            self.done = True  # the job switched by itself
            return None
        if job.distributed:
            return self.refuse("a distributed job: each rank would roll the change back on its own")
        optimizers = list(job.optimizers.optimizers)
        if not optimizers:
            return None
        custom = sorted({type(o).__name__ for o in optimizers if "zero_grad" in _own_methods(type(o))})
        if custom:
            self.refuse(f"{', '.join(custom)} define(s) their own zero_grad; tuneup leaves it alone")
            return None
        return ZeroGradChange(job, optimizers)


def _own_methods(cls: type) -> set[str]:
    """Methods a subclass of Optimizer defines itself (not inherited from torch's base)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is torch.optim.Optimizer:
            break
        names.update(vars(klass))
    return names
