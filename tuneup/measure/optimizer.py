"""Optimizer probe: step boundaries and optimizer time from torch's global step hooks.

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
from torch.optim import optimizer as optimizer_hooks

from .._patching import PatchSet, measured
from .steps import StepTimeline


class OptimizerProbe:
    name = "optimizer"

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
        self._seen: set[int] = set()  # ids of self.optimizers: a cheaper test on every step
        self.set_to_none: bool | None = None  # as last passed to zero_grad
        self.total_steps = 0  # optimizer.step() calls that ran, of any optimizer (monotonic)

    def install(self, patches: PatchSet) -> None:
        patches.add_handle(optimizer_hooks.register_optimizer_step_pre_hook(self._pre))
        patches.add_handle(optimizer_hooks.register_optimizer_step_post_hook(self._post))
        patches.replace(torch.optim.Optimizer, "zero_grad", self._wrap_zero_grad)
        patches.replace(nn.Module, "zero_grad", self._wrap_zero_grad)

    def _measured(self, optimizer: Any) -> bool:
        return self.on and (self.tracked is None or optimizer in self.tracked)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.on or (self.tracked is not None and optimizer not in self.tracked):
            return
        try:
            if id(optimizer) not in self._seen:
                self._seen.add(id(optimizer))
                weakref.finalize(optimizer, self._seen.discard, id(optimizer))
                self.optimizers.add(optimizer)
                self.on_new_optimizer(optimizer)
            # An optimizer that already stepped in the open step closes it (a new iteration
            # began without a DataLoader fetch).
            tl = self.timeline
            now = perf_counter()
            tl.moved_on(now, id(optimizer))
            tl.optimizer_start = now
            tl.in_optimizer = True
        except Exception as exc:
            self.fail(exc)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.total_steps += 1  # every step that ran, measured or not: GradScaler skip detection
        if not self.on or (self.tracked is not None and optimizer not in self.tracked):
            return
        try:
            self.timeline.optimizer_end(optimizer, perf_counter())
        except Exception as exc:
            self.fail(exc)

    def _wrap_zero_grad(self, original):
        # Posing as the original (see posing_as): Optimizer.zero_grad is dynamo-disabled
        # (@torch._disable_dynamo, whose wrapper lives in torch/_compile.py, a file dynamo skips),
        # so a compiled train step must meet a function dynamo skips just the same.
        return measured(original, self._zero_grad_before, self._zero_grad_after, self.fail)

    def _zero_grad_before(self, args: tuple, kwargs: dict) -> float | None:
        return perf_counter() if self.on and self.timeline.detail else None

    def _zero_grad_after(self, began: float, result: Any, args: tuple, kwargs: dict) -> None:
        """On detail steps: the set_to_none the loop uses, and the time (optimizer time:
        zeroing gradients is part of the update)."""
        try:
            self.set_to_none = bool(args[1] if len(args) > 1 else kwargs.get("set_to_none", True))
            self.timeline.optimizer += perf_counter() - began
        except Exception as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.in_optimizer = False
        self.timeline.fail(self.name, exc)
