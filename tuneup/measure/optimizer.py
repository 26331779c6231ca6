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

from .._patching import OPTIMIZER_OFF_DETAIL, PatchSet, measured
from .config import plain_number
from .hotpath import StepTimeline, optimizer_hooks, zero_grad_hooks


CURVE_POINTS = 256  # learning-rate changes kept per optimizer (halved, every other one, when full)


class LearningRate:
    """One optimizer's learning rate as the job really ran it (its first param group's),
    read after the update of each detail step: whoever sets it (an LRScheduler, or the loop
    writing `group["lr"]` each iteration) a changing value is a schedule."""

    def __init__(self, step: int, value: float) -> None:
        self.first = self.last = self.low = self.high = value
        self.reads = 1
        self.changes = 0
        self.curve: list[tuple[int, float]] = [(step, value)]  # (step, lr) where it changed

    def read(self, step: int, value: float) -> None:
        self.reads += 1
        if value == self.last:
            return
        self.changes += 1
        self.last = value
        self.low, self.high = min(self.low, value), max(self.high, value)
        if len(self.curve) >= CURVE_POINTS:
            self.curve = self.curve[::2]
        self.curve.append((step, value))

    def summary(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "min": self.low, "max": self.high,
                "changes": self.changes, "reads": self.reads}


class OptimizerProbe:
    name = "optimizer"
    clock = staticmethod(perf_counter)

    def __init__(
        self,
        timeline: StepTimeline,
        tracked: weakref.WeakSet | None,
        on_new_optimizer: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        self.measured: set[int] = set()  # ids of the optimizers measured (the hot path's one test)
        self._on = True
        self.timeline = timeline
        self.tracked = tracked
        self.on_new_optimizer = on_new_optimizer
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.seen: set[int] = set()  # ids of self.optimizers: a cheaper test on every step
        self.first_step: dict[int, int] = {}  # id -> the order of its first step (reports number them so)
        self.classes: list[str] = []  # the class of every optimizer seen stepping, in order
        self.set_to_none: bool | None = None  # as last passed to zero_grad
        self.unmeasured_steps = 0  # optimizer.step() calls that ran of optimizers not measured (total_steps)
        # Run around every optimizer step by the hooks when set (apply mode's guards): its
        # guards are called from here, as hooks registered mid-step would break torch's loop.
        self.guard_before: Callable[[Any], None] | None = None
        self.guard_after: Callable[[Any], None] | None = None
        self.rates: dict[int, LearningRate] = {}  # by optimizer id (dropped with the optimizer)
        self._patches: PatchSet | None = None
        self._hooks: tuple[Callable[..., None], Callable[..., None]] | None = None
        self.compiled_steps: set[int] = set()  # ids of optimizers whose own step was looked at (wrapped if compiled)
        self.gradients: Any = None  # gradients.GradientNorms: the norm each update uses, on sampled steps

    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        pre, post = self._hooks = optimizer_hooks(self)  # hotpath.py
        patches.add_handle(optimizer_hooks_registry.register_optimizer_step_pre_hook(pre))
        patches.add_handle(optimizer_hooks_registry.register_optimizer_step_post_hook(post))
        # Posing as the original (see posing_as): Optimizer.zero_grad is dynamo-disabled
        # (@torch._disable_dynamo, whose wrapper lives in torch/_compile.py, a file dynamo skips),
        # so a compiled train step must meet a function dynamo skips just the same.
        # Optimizer.zero_grad's wrapper is gated on detail steps (dynamo never traces it);
        # Module.zero_grad's is not (dynamo inlines torch.nn's code, and would guard on the gate).
        before, after = zero_grad_hooks(self)
        patches.replace(torch.optim.Optimizer, "zero_grad",
                        lambda original: measured(original, before, after, self.fail, gate=self.timeline,
                                                  skip=OPTIMIZER_OFF_DETAIL))
        patches.replace(nn.Module, "zero_grad", lambda original: measured(original, before, after, self.fail))

    @property
    def total_steps(self) -> int:
        """optimizer.step() calls that ran, of any optimizer (monotonic; the post-hook counts
        a measured one's in the timeline, any other's in unmeasured_steps)."""
        return self.timeline.optimizer_steps + self.unmeasured_steps

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = value
        if not value:
            self.measured.clear()  # the hooks measure nothing from now on

    def focus(self, optimizers: weakref.WeakSet) -> None:
        """Measure only these optimizers from now on."""
        self.tracked = optimizers
        self.measured.clear()  # each is admitted again at its next step

    def _measured(self, optimizer: Any) -> bool:
        return self.on and (self.tracked is None or optimizer in self.tracked)

    def admit(self, optimizer: torch.optim.Optimizer) -> bool:
        """A step of an optimizer not measured so far: measured from now on if the probe is on
        and the job named it (or named none). The first step of a new one: remember it (a new
        optimizer usually means a new model: the owner looks)."""
        try:
            if not self._measured(optimizer):
                return False
            key = id(optimizer)
            if key not in self.seen:
                self.timeline.not_by_hand()  # an optimizer updates the parameters
                self.seen.add(key)
                self.first_step[key] = len(self.classes)  # classes grows by one per new optimizer
                self.classes.append(type(optimizer).__name__)
                weakref.finalize(optimizer, self._forget, key)  # an id is reused once its object dies
                self.optimizers.add(optimizer)
                self.on_new_optimizer(optimizer)
            self.measured.add(key)
            return True
        except Exception as exc:
            self.fail(exc)
            return False

    def in_order(self) -> list[torch.optim.Optimizer]:
        """The optimizers alive, in the order they first stepped (a WeakSet has no order)."""
        return sorted(self.optimizers, key=lambda optimizer: self.first_step.get(id(optimizer), 1 << 30))

    def adopt_compiled_step(self, optimizer: Any) -> None:
        """`optimizer.step = torch.compile(optimizer.step)`: the global step hooks run inside
        the compiled code, where they return at once (hotpath.optimizer_hooks), so the step
        is called through them here instead, eagerly, around the compiled function: on the
        instance, where the job put it (Optimizer.__getstate__ keeps only defaults, state and
        param_groups: no copy or pickle takes the wrapper along). Seen at zero_grad, before
        the optimizer's first step in the usual loop; each optimizer is looked at once (a step
        of its own that is not compiled is left alone, and not looked at again)."""
        step = vars(optimizer).get("step")
        key = id(optimizer)
        if step is None or key in self.compiled_steps or self._patches is None or self._hooks is None:
            return
        self.compiled_steps.add(key)
        if getattr(step, "_torchdynamo_orig_callable", None) is None:
            return
        pre, post = self._hooks
        held = weakref.ref(optimizer)

        def before(args: tuple, kwargs: dict) -> bool | None:
            target = held()
            if target is None:
                return None
            pre(target, args, kwargs)
            return True

        def after(token: Any, result: Any, args: tuple, kwargs: dict) -> None:
            target = held()
            if target is not None:
                post(target, args, kwargs)

        self._patches.replace(optimizer, "step", lambda compiled: measured(compiled, before, after, self.fail))

    def _forget(self, key: int) -> None:
        self.compiled_steps.discard(key)
        self.seen.discard(key)
        self.first_step.pop(key, None)
        self.measured.discard(key)
        self.rates.pop(key, None)

    def read_rate(self, optimizer: Any) -> None:
        """The learning rate the update of a detail step used (its post-hook; a few dict reads)."""
        groups = optimizer.param_groups
        value = plain_number(groups[0].get("lr")) if groups else None
        if value is None:
            return
        step = self.timeline.ring.count + 1  # the open step
        rate = self.rates.get(id(optimizer))
        if rate is None:
            self.rates[id(optimizer)] = LearningRate(step, value)
        else:
            rate.read(step, value)

    def rate_of(self, optimizer: Any) -> dict[str, Any] | None:
        """The configuration's view: first, last, min, max, changes, reads."""
        rate = self.rates.get(id(optimizer))
        return rate.summary() if rate is not None else None

    def rate_curves(self) -> list[dict[str, Any]]:
        """Each optimizer's learning rate where it changed, [step, lr] (the run log's end)."""
        return [{"optimizer": type(optimizer).__name__, "curve": [list(point) for point in rate.curve]}
                for optimizer in list(self.optimizers) if (rate := self.rates.get(id(optimizer))) is not None]

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.in_optimizer = False
        self.timeline.fail(self.name, exc)
