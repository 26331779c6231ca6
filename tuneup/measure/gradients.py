"""The gradient norm the job's updates consume, read on sampled steps: what an exploding
gradient shows (the no-grad-clipping rule), where a loss cannot (one that sits near zero or
changes sign, a policy gradient's, leaps tenfold with nothing wrong).

Where: in torch's optimizer step pre-hook (hotpath.optimizer_hooks), so the gradients are the
ones the update is about to use (after GradScaler's unscale_, summed over accumulation steps;
a step GradScaler skips never gets there), one series per optimizer (a GAN's two do not mix);
in a loop without an optimizer, after the backward (hotpath.backward_hooks), over the trained
models' parameters. Only on detail steps, and paced by its own measured cost: at most
BUDGET of the training time (a norm reads every gradient once, a fraction of what one
optimizer update does), never more often than one step in MIN_EVERY. Its time falls in the
sampled step's time outside the forward, backward and update ("other"), within that budget.

How: `torch.nn.utils.get_total_norm` (torch >= 2.6; the per-tensor norms, then their norm,
foreach kernels where the device has them), the same figure `clip_grad_norm_` returns and
clips by. It reads the gradients and changes nothing: no gradient, parameter or RNG state is
touched. On a GPU the norm is read without a sync (device_values.DeviceValues). Gradients that
are not plain tensors (DTensor under FSDP2: their norm is a collective) switch it off, said
once in the summary.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from statistics import median
from time import perf_counter
from typing import Any, Callable, Iterable

import torch

from .device_values import DeviceValues
from .terms import MIN_BEFORE, SPIKE_FACTOR, SPIKE_FALLBACK, SPIKE_FLOOR, SPIKE_HISTORY

BUDGET = 0.005  # of the training time, at most, spent on norms
MIN_EVERY = 4  # steps between two norms of one series, at least
RECENT = 64  # norms kept for the typical size (p90: the max_norm the fix suggests)

_total_norm: Callable[..., torch.Tensor] | None = getattr(torch.nn.utils, "get_total_norm", None)


def total_norm(gradients: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `gradients` as one vector (clip_grad_norm_'s figure)."""
    if _total_norm is not None:
        return _total_norm(gradients, 2.0, error_if_nonfinite=False, foreach=None)
    with torch.no_grad():  # torch < 2.6: the same figure, a tensor at a time
        norms = [torch.linalg.vector_norm(g) for g in gradients]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


class Series:
    """One optimizer's (or a hand-written update's) norms, as they arrive."""

    def __init__(self) -> None:
        self.highest = 0.0  # the largest finite norm so far: the floor's scale
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.samples = self.spikes = self.nonfinite = 0
        self.largest: tuple[float, float, float, int] | None = None  # (ratio, norm, median before, step)
        self.largest_spike: tuple[float, float, float, int] | None = None  # the same, of the spikes counted
        # The latest spike, until the next norm says whether it fell back (SPIKE_FALLBACK), and
        # the largest spike before it.
        self._pending: tuple[float, tuple[float, float, float, int] | None] | None = None

    def add(self, value: float, step: int) -> None:
        self.samples += 1
        pending, self._pending = self._pending, None
        if not math.isfinite(value):
            self.nonfinite += 1  # (after a spike: the explosion went on; the spike stands)
            return
        if pending is not None and value > pending[0] / SPIKE_FALLBACK:
            # Still up: the norm climbed and stays there (a net's gradients wander over a
            # twentyfold range in a few hundred steps), not a step that exploded.
            self.spikes -= 1
            self.largest_spike = pending[1]
        before = list(islice(reversed(self.recent), SPIKE_HISTORY))  # the last SPIKE_HISTORY finite norms
        if len(before) >= MIN_BEFORE:
            middle = median(before)
            if middle > 0 and value >= SPIKE_FLOOR * self.highest:
                ratio = value / middle
                if ratio > SPIKE_FACTOR:
                    self.spikes += 1
                    self._pending = (value, self.largest_spike)
                    if self.largest_spike is None or ratio > self.largest_spike[0]:
                        self.largest_spike = (ratio, value, middle, step)
                if self.largest is None or ratio > self.largest[0]:
                    self.largest = (ratio, value, middle, step)
        self.highest = max(self.highest, value)
        self.recent.append(value)


class GradientNorms:
    """Norms on sampled steps, per series. `due[key]`: the step count from which the series'
    next norm is taken (the hot path's one test, on detail steps)."""

    def __init__(self, timeline: Any, values: DeviceValues) -> None:
        self.timeline = timeline
        self.values = values
        self.on = True
        self.off_reason: str | None = None
        self.due: dict[Any, int] = {}
        self.series: dict[Any, Series] = {}
        self.seconds = 0.0  # host time spent on norms
        self.costs: deque[float] = deque(maxlen=5)  # the last norms' cost (what paces them)

    def of_optimizer(self, optimizer: Any) -> float:
        """The pre-hook of a detail step whose series is due: the optimizer's gradients.
        Returns the seconds it took (the caller leaves them out of the update's time)."""
        return self._take(id(optimizer), (p for group in optimizer.param_groups for p in group["params"]))

    def of_models(self, models: Iterable[torch.nn.Module]) -> float:
        """After a detail step's backward in a loop without an optimizer."""
        return self._take("by hand", (p for model in models for p in model.parameters()))

    def _take(self, key: Any, parameters: Iterable[Any]) -> float:
        tl = self.timeline
        if not self.on:
            self.due[key] = 1 << 62
            return 0.0
        began = perf_counter()
        step = tl.ring.count + 1  # the open step
        tl.in_tuneup = True  # none of this is the job's (host reads, calls)
        try:
            gradients = []
            for parameter in parameters:
                gradient = parameter.grad
                if gradient is None or gradient.is_sparse:
                    continue
                if type(gradient) is not torch.Tensor:  # a DTensor's norm is a collective: not ours to start
                    self._off(f"gradients of type {type(gradient).__name__} (their norm needs the other ranks)")
                    return 0.0
                gradients.append(gradient)
            if gradients:
                norm = total_norm(gradients)
                series = self.series.get(key)
                if series is None:
                    series = self.series[key] = Series()
                self.values.read(norm, lambda value: series.add(value, step), step)
        except Exception as exc:  # never the job's problem: off, with one warning
            self._off(f"failed: {type(exc).__name__}")
            tl.fail("gradients", exc)
        finally:
            tl.in_tuneup = False
            cost = perf_counter() - began
            self.seconds += cost
            self.costs.append(cost)
            step_seconds = tl.ring.recent_step_seconds(16)
            # Paced by the recent norms' median cost: one descheduled (or the first, warming up)
            # would put the next off for thousands of steps.
            typical = median(self.costs)
            every = math.ceil(typical / (BUDGET * step_seconds)) if step_seconds > 0.0 else MIN_EVERY
            self.due[key] = tl.ring.count + max(MIN_EVERY, every)
        return cost

    def _off(self, reason: str) -> None:
        self.on = False
        self.off_reason = reason

    def summary(self) -> dict[str, Any] | None:
        """Over every series: norms read, spikes, non-finite norms; the largest leap and the
        norms' typical size (median and p90 of the recent ones, of the series with most)."""
        if not self.series:
            return {"skipped": self.off_reason} if self.off_reason else None
        # The optimizers' series; a hand-written update's only where no optimizer stepped (a
        # job's first backward is taken as one until its optimizer steps).
        every = [s for key, s in self.series.items() if key != "by hand"] or list(self.series.values())
        main = max(every, key=lambda s: s.samples)
        recent = sorted(main.recent)
        # The largest spike where there are some (the evidence), else the largest leap.
        spiked = [s.largest_spike for s in every if s.spikes and s.largest_spike is not None]
        largest = max(spiked or [s.largest for s in every if s.largest is not None], default=None)
        out: dict[str, Any] = {
            "samples": sum(s.samples for s in every), "spikes": sum(s.spikes for s in every),
            "nonfinite": sum(s.nonfinite for s in every), "series": len(every),
            "median": median(recent) if recent else None,
            "p90": recent[min(len(recent) - 1, int(0.9 * len(recent)))] if recent else None,
            "seconds": self.seconds,
        }
        if largest is not None:
            out.update(largest_ratio=largest[0], largest_norm=largest[1], median_before=largest[2],
                       largest_step=largest[3])
        return out
