"""Optimizer probe: step boundaries and optimizer time from torch's global step hooks
(their bodies: hotpath.py).

Also wraps Optimizer.zero_grad and Module.zero_grad to see the set_to_none the loop really
uses, on detail steps (their time counts as optimizer time: zeroing gradients is part of
the update).
"""

from __future__ import annotations

import weakref
from time import perf_counter
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import optimizer as optimizer_hooks_registry

from .._patching import PatchSet, measured
from .hotpath import StepTimeline, optimizer_hooks, zero_grad_hooks


class OptimizerProbe:
    name = "optimizer"
    clock = staticmethod(perf_counter)

    def __init__(
        self,
        timeline: StepTimeline,
        tracked: weakref.WeakSet | None,
        on_new_optimizer: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        self.on = True
        self.timeline = timeline
        self.tracked = tracked
        self.on_new_optimizer = on_new_optimizer
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.seen: set[int] = set()  # ids of self.optimizers: a cheaper test on every step
        self.set_to_none: bool | None = None  # as last passed to zero_grad
        self.total_steps = 0  # optimizer.step() calls that ran, of any optimizer (monotonic)

    def install(self, patches: PatchSet) -> None:
        pre, post = optimizer_hooks(self)  # hotpath.py
        patches.add_handle(optimizer_hooks_registry.register_optimizer_step_pre_hook(pre))
        patches.add_handle(optimizer_hooks_registry.register_optimizer_step_post_hook(post))
        # Posing as the original (see posing_as): Optimizer.zero_grad is dynamo-disabled
        # (@torch._disable_dynamo, whose wrapper lives in torch/_compile.py, a file dynamo skips),
        # so a compiled train step must meet a function dynamo skips just the same.
        before, after = zero_grad_hooks(self)
        for owner in (torch.optim.Optimizer, nn.Module):
            patches.replace(owner, "zero_grad", lambda original: measured(original, before, after, self.fail))

    def _measured(self, optimizer: Any) -> bool:
        return self.on and (self.tracked is None or optimizer in self.tracked)

    def first_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's first measured step: remember it (a new optimizer usually means a
        new model: the owner looks)."""
        key = id(optimizer)
        self.seen.add(key)
        weakref.finalize(optimizer, self.seen.discard, key)
        self.optimizers.add(optimizer)
        self.on_new_optimizer(optimizer)

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.in_optimizer = False
        self.timeline.fail(self.name, exc)
