"""Optimizer probe: step boundaries and optimizer time from torch's global step hooks
(their bodies: hotpath.py). The pre-hook is in torch's registry only on the steps that need
it (OptimizerProbe.fit_pre_hook): in a loop whose steps close at a fetch, detail and sampled
steps; it is moved only where no optimizer step can be running, and never again once dynamo
may trace the registry.

Also wraps Optimizer.zero_grad and Module.zero_grad to see the set_to_none the loop really
uses, on detail steps (their time counts as optimizer time: zeroing gradients is part of
the update).
"""

from __future__ import annotations

import sys
import threading
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
        timeline.unseen_updates = self.watch_updates  # many fetches, no update seen (StepTimeline.unseen_fetch)
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
        # The pre-hook in torch's registry only on the steps that need it (fit_pre_hook); the
        # owner tells whether a sampled step counts host reads (their regions: in_optimizer)
        # and whether no compilation can have seen the registry without it.
        self._pre: PreHook | None = None
        self.regions_read: Callable[[], bool] = lambda: True
        self.compile_quiet: Callable[[], bool] = lambda: False
        self.pre_always = False  # a loop that needs it on every step (steps close at its updates)
        self.step_thread: int | None = None  # the thread the optimizers step on (their first steps)
        self._fitted_at = (0, 0)  # (ring.count, optimizer_steps) at the last fit

    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        pre, post = self._hooks = optimizer_hooks(self)  # hotpath.py
        handle = optimizer_hooks_registry.register_optimizer_step_pre_hook(pre)
        patches.add_handle(handle)
        patches.add_handle(optimizer_hooks_registry.register_optimizer_step_post_hook(post))
        hooks = getattr(optimizer_hooks_registry, "_global_optimizer_pre_hooks", None)
        if _STEP_CODE is not None and isinstance(hooks, dict) and hooks.get(handle.id) is pre:
            self._pre = PreHook(hooks, handle.id, pre)
            patches.add_handle(self._pre)  # (undone first: no switch after detach)
            self.timeline.fit_hooks = self.fit_pre_hook
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
            thread = threading.get_ident()
            if self.step_thread is None:
                self.step_thread = thread
            elif thread != self.step_thread:  # optimizers stepping on several threads: see fit_pre_hook
                self.pre_always = True
            self.timeline.not_by_hand()  # an optimizer updates the parameters (its hooks run: watch_updates)
            if key not in self.seen:
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

    # --- the pre-hook, in place only where it has work --------------------------------------

    def pre_hook_needed(self) -> bool:
        """Whether the next steps need the pre-hook. In a loop whose steps close at a fetch, the
        steps that are neither detail steps nor sampled ones leave it nothing to do but mark
        the update's region (read only on sampled steps) and admit a new optimizer (the
        post-hook does: OptimizerProbe.admit): there it is out of torch's registry, which
        saves the job torch's call of it and its own work (some 3,400 of tuneup's 26,500
        instructions a step on the ~0.4 ms step: benchmarks/bench_instructions.py). It stays
        in place for loops without a fetch (it closes their steps), loops that update
        several times a fetch (`update_closes`, or more updates than optimizers in the steps
        since the last fit), before the first optimizer step, while apply mode's guards are
        in effect, and wherever dynamo could trace torch's step wrapper without it: it
        guards on the registry, and a hook that came and went would recompile a compiled
        `opt.step` (torch/optim/optimizer.py profile_hook_step iterates the registry)."""
        timeline = self.timeline
        return (timeline.detail or timeline.by_hand or not timeline.fetches or timeline.update_closes > 0
                or self.pre_always or self.guard_before is not None or self.regions_read()
                or not self.compile_quiet())

    def fit_pre_hook(self) -> None:
        """At the end of each close that is due (StepTimeline._close_due: around detail and
        sampled steps): the pre-hook in torch's registry or out of it, as the next steps need
        it. Only where no optimizer step can be running: torch iterates the registry there (an
        OrderedDict: changed under iteration, it raises in the job's step). So only on the
        thread the optimizers step on (a close on another: a loader iterated by a prefetching
        thread, leaves it as it is), and not inside a step on it (a fetch inside a closure)."""
        pre = self._pre
        if pre is None:
            return
        try:
            self._count_updates()
            needed = self.pre_hook_needed()
            if needed != pre.in_place and self._free_to_move():
                pre.put(needed)
        except Exception as exc:
            self.fail(exc)

    def _count_updates(self) -> None:
        """More updates than steps x optimizers in the steps closed since the last fit: some
        optimizer stepped twice in a step, a boundary only the pre-hook sees (pre_always)."""
        timeline = self.timeline
        count, updates = timeline.ring.count, timeline.optimizer_steps
        (count_then, updates_then), self._fitted_at = self._fitted_at, (count, updates)
        if updates - updates_then > (count - count_then) * max(1, len(self.measured)):
            self.pre_always = True

    def _free_to_move(self) -> bool:
        return threading.get_ident() == self.step_thread and not inside_optimizer_step()

    def compile_begins(self) -> None:
        """A compilation begins (CompileProbe's start callback, before dynamo traces): the
        pre-hook is in the registry for good, put back now where that is safe (_free_to_move;
        else at the next close that is due); and the updates are watched (watch_updates)."""
        self.pre_always = True
        pre = self._pre
        if pre is not None and not pre.in_place and self._free_to_move():
            pre.put(True)
        self.watch_updates()

    def watch_updates(self) -> None:
        """What is compiled may hold `optimizer.step()` (a training step compiled whole):
        dynamo traces torch's step wrapper with the global hooks in it, so no hook of ours runs
        for those steps and no step would close. Until an optimizer's hooks run again, the
        loop is watched as one that updates its parameters by hand (StepTimeline.by_hand: its
        steps close where the parameters changed since a backward, StepTimeline.moved_on; by
        those versions alone: StepTimeline.watching); the optimizers are admitted again at
        their next step, which ends the watch (admit)."""
        if not self.timeline.by_hand and self.on:
            self.measured.clear()
            self.timeline.watch_updates()

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


class PreHook:
    """The pre-hook's entry in torch's registry of global step pre-hooks, taken out and put
    back under the same id (RemovableHandle.remove at detach deletes it where present). After
    `remove` (detach: the PatchSet undoes it first), it is never put back."""

    def __init__(self, hooks: dict, key: int, hook: Callable[..., Any]) -> None:
        self.hooks, self.key, self.hook = hooks, key, hook
        self.in_place = True
        self.closed = False

    def put(self, in_place: bool) -> None:
        if self.closed:
            return
        if in_place:
            self.hooks[self.key] = self.hook
        else:
            self.hooks.pop(self.key, None)
        self.in_place = in_place

    def remove(self) -> None:
        self.closed = True


def _step_code() -> Any:
    """The code of torch's step wrapper (Optimizer.profile_hook_step's `wrapper`: every
    optimizer class's step runs in it), None where torch has no such wrapper."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    try:
        return wrap(lambda: None).__code__ if wrap is not None else None
    except Exception:  # pragma: no cover - another torch
        return None


_STEP_CODE = _step_code()


def inside_optimizer_step() -> bool:
    """Whether an optimizer step runs on this thread (its wrapper's frame is on the stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _STEP_CODE:
            return True
        frame = frame.f_back
    return False
