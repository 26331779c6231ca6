"""GradScaler probe: scale, skipped optimizer steps, growth and back-off, with no extra sync.

A skip is seen for free: GradScaler.step() skips by not calling optimizer.step(), so the
optimizer's step hooks simply don't fire. Optimizers that handle scaling themselves (fused
Adam and friends) always run and skip on the device; for them the found-inf flags are read
asynchronously. The scale is read asynchronously after each update(): a drop is a back-off,
a rise is a growth.
"""

from __future__ import annotations

import weakref
from time import perf_counter
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

from .._patching import PatchSet, measured
from .device_values import DeviceValues
from .optimizer import OptimizerProbe
from .hotpath import StepTimeline


class ScalerProbe:
    name = "grad_scaler"

    def __init__(
        self,
        timeline: StepTimeline,
        tracked: weakref.WeakSet | None,
        optimizers: OptimizerProbe,
        values: DeviceValues,
    ) -> None:
        self.on = True
        self.timeline = timeline
        self.tracked = tracked
        self.optimizers = optimizers
        self.values = values
        self.scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self.seen = 0  # scalers seen (the WeakSet empties when the job drops them)
        self.enabled: bool | None = None
        self.steps = 0  # scaler.step() calls with the scaler enabled
        self.calls = {"step": 0, "update": 0}  # calls enabled or not: does the loop use the idiom?
        self.skipped = 0
        self.skip_run = 0
        self.longest_skip_run = 0
        self.growth_events = 0
        self.backoff_events = 0
        self.scale: float | None = None
        self._last_scale: weakref.WeakKeyDictionary[GradScaler, float] = weakref.WeakKeyDictionary()

    def install(self, patches: PatchSet) -> None:
        patches.replace(GradScaler, "scale", self._wrap_scale)
        patches.replace(GradScaler, "step", self._wrap_step)
        patches.replace(GradScaler, "update", self._wrap_update)

    def focus(self, scalers: weakref.WeakSet) -> None:
        """Measure only these GradScalers from now on."""
        self.tracked = scalers

    def _measured(self, scaler: GradScaler) -> bool:
        return self.on and (self.tracked is None or scaler in self.tracked)

    # --- wrappers (posing as GradScaler's own methods: see posing_as) --------------------

    def _wrap_scale(self, original):
        return measured(original, self._before_scale, self._after_scale, self.fail)

    def _before_scale(self, args: tuple, kwargs: dict) -> bool | None:
        try:
            return True if self._measured(args[0]) else None
        except Exception as exc:
            self.fail(exc)
            return None

    def _after_scale(self, token: bool, result: Any, args: tuple, kwargs: dict) -> None:
        if result is None:
            return  # scale() raised
        try:
            scaler = args[0]
            outputs = args[1] if len(args) > 1 else kwargs.get("outputs")
            tl = self.timeline
            if scaler not in self.scalers:
                self.scalers.add(scaler)
                self.seen += 1
                start = getattr(scaler, "_scale", None)  # absent on a disabled scaler
                if start is not None:  # the starting scale, so a first back-off counts
                    ref = weakref.ref(scaler)
                    self.values.read(start, lambda value: self._scale_read(ref, value, True))
            self.enabled = bool(scaler._enabled)
            if tl.detail and result is not outputs and type(outputs) is torch.Tensor and outputs.numel() == 1:
                # The unscaled loss, on detail steps, summed over the step's backward passes (hotpath)
                tl.loss = outputs.detach() if tl.loss is None else tl.loss + outputs.detach()
                tl.scaled_loss_id = id(result)
        except Exception as exc:
            self.fail(exc)

    def _wrap_step(self, original):
        return measured(original, self._before_step, self._after_step_call, self.fail)

    def _before_step(self, args: tuple, kwargs: dict) -> int | None:
        """The optimizer steps run so far, or None when this step() is not measured."""
        self.calls["step"] += 1
        try:
            scaler = args[0]
            if not self._measured(scaler) or not scaler._enabled:
                return None
        except Exception as exc:
            self.fail(exc)
            return None
        return self.optimizers.total_steps

    def _after_step_call(self, ran_before: int, result: Any, args: tuple, kwargs: dict) -> None:
        try:
            optimizer = args[1] if len(args) > 1 else kwargs.get("optimizer")
            self._after_step(args[0], optimizer, ran_before)
        except Exception as exc:
            self.fail(exc)

    def _after_step(self, scaler: GradScaler, optimizer: Any, ran_before: int) -> None:
        self.steps += 1
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The optimizer ran and skipped (or not) on the device: read its found-inf flags.
            state = scaler._per_optimizer_states.get(id(optimizer))
            flags = list(state["found_inf_per_device"].values()) if state else []
            if flags:
                step = self.timeline.ring.count + 1
                total = flags[0] if len(flags) == 1 else torch.stack([f.reshape(()) for f in flags]).sum()
                self.values.read(total, lambda found: self._resolved(found > 0, step), step)
            return
        if not self.optimizers.on:
            return  # its hooks report nothing reliable any more
        skipped = self.optimizers.total_steps == ran_before
        if skipped and self.optimizers._measured(optimizer):
            self.timeline.optimizer_skipped(optimizer, perf_counter())
        self._count(skipped)

    def _resolved(self, skipped: bool, step: int) -> None:
        """A device-side skip flag arrived for `step` (still open, or already closed)."""
        if skipped:
            self.timeline.record_skip(step)
        self._count(skipped)

    def _count(self, skipped: bool) -> None:
        if skipped:
            self.skipped += 1
            self.skip_run += 1
            self.longest_skip_run = max(self.longest_skip_run, self.skip_run)
        else:
            self.skip_run = 0

    def _wrap_update(self, original):
        return measured(original, self._before_update, self._after_update, self.fail)

    def _before_update(self, args: tuple, kwargs: dict) -> bool:
        self.calls["update"] += 1
        return True

    def _after_update(self, token: bool, result: Any, args: tuple, kwargs: dict) -> None:
        try:
            scaler = args[0]
            current = getattr(scaler, "_scale", None)
            if self._measured(scaler) and scaler._enabled and current is not None:
                ref = weakref.ref(scaler)
                set_by_hand = (args[1] if len(args) > 1 else kwargs.get("new_scale")) is not None
                self.values.read(current, lambda value: self._scale_read(ref, value, set_by_hand))
        except Exception as exc:
            self.fail(exc)

    def _scale_read(self, ref: weakref.ref, value: float, reset: bool) -> None:
        """A scale value arrived. `reset`: the starting scale, or one set by hand (no event)."""
        scaler = ref()
        if scaler is None:
            return
        previous = self._last_scale.get(scaler)
        if previous is not None and not reset:
            if value < previous:
                self.backoff_events += 1
            elif value > previous:
                self.growth_events += 1
        self._last_scale[scaler] = value
        self.scale = value

    # --- results -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        present = self.seen > 0
        return {
            "present": present,
            "enabled": self.enabled if present else None,
            "scale": self.scale,
            "steps": self.steps,
            "skipped_steps": self.skipped,
            "skip_rate": self.skipped / self.steps if self.steps else None,
            "longest_skip_run": self.longest_skip_run,
            "growth_events": self.growth_events,
            "backoff_events": self.backoff_events,
        }

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.fail(self.name, exc)
