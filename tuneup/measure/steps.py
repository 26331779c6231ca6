"""Per-step bookkeeping on the training thread: hook events in, one record per step out.

A step ends at an optimizer step (gradient accumulation: many backward passes, one step).
Because a loop may step several optimizers per iteration, a step is closed lazily, when the
next one visibly starts: a batch is fetched after an optimizer stepped, or an optimizer
that already stepped steps again. `tuneup.step()` closes a step explicitly. Step windows
therefore tile the timeline (close to close), and every counter lands in exactly one step.

The hot path is a few clock reads and float additions; records go into preallocated
columns (array('d')) that the agent's background thread reads without stopping training.
"""

from __future__ import annotations

import math
from array import array
from time import perf_counter
from typing import Any, Callable

COLUMNS = (
    "end",  # perf_counter() at the close of the step
    "step_seconds",
    "data_wait_seconds",
    "forward_seconds",
    "backward_seconds",
    "optimizer_seconds",
    "samples",
    "fetches",
    "backward_passes",
    "optimizer_steps",
    "skipped_steps",
    "syncs",  # host-device syncs counted on this step; -1 when the step was not sampled
    "loss",  # NaN until read (device values arrive later); see loss_known
    "loss_known",
    "gpu_seconds",  # GPU time from CUDA events; -1 when unknown
)


class StepRing:
    """Fixed-size columns of step records; `count` is the number of steps ever written."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        for name in COLUMNS:
            setattr(self, name, array("d", bytes(8 * capacity)))

    def slot(self, step: int) -> int | None:
        """Index of 1-based step number `step` if it is still held, else None."""
        if step < 1 or step > self.count or self.count - step >= self.capacity:
            return None
        return (step - 1) % self.capacity

    def rows(self, first_step: int, last_step: int) -> list[dict[str, float]]:
        """Records for steps first_step..last_step (1-based, inclusive) still held."""
        first_step = max(first_step, self.count - self.capacity + 1, 1)
        out = []
        columns = [(name, getattr(self, name)) for name in COLUMNS]
        for step in range(first_step, min(last_step, self.count) + 1):
            i = (step - 1) % self.capacity
            row = {name: column[i] for name, column in columns}
            row["step"] = step
            out.append(row)
        return out


class StepTimeline:
    """Accumulates the open step from hook events and closes it into the ring."""

    def __init__(self, capacity: int, fail: Callable[[str, BaseException], None]) -> None:
        self.ring = StepRing(capacity)
        self.fail = fail
        self.manual = False
        self.attached_at = perf_counter()  # start of the first step when nothing came before it
        self.step_start: float | None = None
        self.last_optimizer_end: float | None = None
        self.group: list[Any] = []  # optimizers stepped in the open step
        # Regions whose host reads are not the user's: inside the loader, inside
        # optimizer.step (its CPU-side step counters), inside tuneup's own bookkeeping.
        self.in_loader = False
        self.in_optimizer = False
        self.in_tuneup = False
        self.forward_start = 0.0
        self.forward_depth = 0
        self.optimizer_start = 0.0
        self.closing = 0  # number of the step being closed while listeners run, else 0
        self.gpu_timer: Any = None  # CudaStepTimer once the job uses CUDA
        self.loss: Any = None  # detached loss of the latest backward
        self.step_loss: Any = None  # the loss the step's optimizer update consumed
        self.scaled_loss_id = 0  # id of GradScaler.scale()'s output: backward keeps the unscaled loss
        # Run at each close with (step number, ring slot): sync sampler, loss reader, CUDA
        # events. A listener that raises is dropped and reported through `fail`.
        self.on_close: tuple[tuple[str, Callable[[int, int], None]], ...] = ()
        self._reset()

    def _reset(self) -> None:
        self.data_wait = 0.0
        self.forward = 0.0
        self.backward = 0.0
        self.optimizer = 0.0
        self.samples = 0
        self.fetches = 0
        self.backward_passes = 0
        self.optimizer_steps = 0
        self.skipped = 0
        self.step_loss = None
        self.scaled_loss_id = 0
        self.group.clear()

    # --- events -------------------------------------------------------------------------

    def forward_begin(self, now: float) -> None:
        if self.step_start is None:
            self.step_start = now
        if self.forward_depth == 0:
            self.forward_start = now
            self.in_optimizer = False
            if self.gpu_timer is not None:
                self.gpu_timer.forward_started()
        self.forward_depth += 1

    def forward_end(self, now: float) -> None:
        if self.forward_depth > 0:
            self.forward_depth -= 1
            if self.forward_depth == 0:
                self.forward += now - self.forward_start

    def backward_done(self, began: float, now: float) -> None:
        if self.step_start is None:
            self.step_start = began
        self.backward += now - began
        self.backward_passes += 1

    def fetch_begin(self, now: float) -> None:
        if self.group and not self.manual:
            self.close(now)
        elif self.step_start is None:
            self.step_start = now
        self.in_optimizer = False
        self.in_loader = True

    def fetch_end(self, began: float, now: float, samples: int) -> None:
        self.in_loader = False
        self.data_wait += now - began
        self.fetches += 1
        self.samples += samples

    def fetch_failed(self, began: float, now: float) -> None:
        """next() raised (StopIteration at the end of an epoch, or the user's exception)."""
        self.in_loader = False
        self.data_wait += now - began

    def loader_start(self, began: float, now: float) -> None:
        """Time in iter(loader): worker start-up is data wait too."""
        self.in_loader = False
        self.data_wait += now - began

    def optimizer_begin(self, optimizer: Any, now: float) -> None:
        if not self.manual and optimizer in self.group:
            self.close(now)
        elif self.step_start is None:
            self.step_start = now
        self.optimizer_start = now
        self.in_optimizer = True

    def optimizer_end(self, optimizer: Any, now: float) -> None:
        self.in_optimizer = False
        self.optimizer += now - self.optimizer_start
        self.optimizer_steps += 1
        self.last_optimizer_end = now
        self.group.append(optimizer)
        if self.loss is not None:
            self.step_loss, self.loss = self.loss, None

    def optimizer_skipped(self, optimizer: Any, now: float) -> None:
        """GradScaler skipped optimizer.step(): still one step of the loop."""
        if not self.manual and optimizer in self.group:
            self.close(now)
        elif self.step_start is None:
            self.step_start = now
        self.skipped += 1
        self.last_optimizer_end = now
        self.group.append(optimizer)
        if self.loss is not None:
            self.step_loss, self.loss = self.loss, None

    # --- closing ------------------------------------------------------------------------

    def activity(self, now: float) -> None:
        """Something of the step happened (a step function began): the step has started."""
        if self.step_start is None:
            self.step_start = now

    def close(self, now: float) -> None:
        start = self.step_start if self.step_start is not None else self.attached_at
        ring = self.ring
        i = ring.count % ring.capacity
        ring.end[i] = now
        ring.step_seconds[i] = now - start
        ring.data_wait_seconds[i] = self.data_wait
        ring.forward_seconds[i] = self.forward
        ring.backward_seconds[i] = self.backward
        ring.optimizer_seconds[i] = self.optimizer
        ring.samples[i] = self.samples
        ring.fetches[i] = self.fetches
        ring.backward_passes[i] = self.backward_passes
        ring.optimizer_steps[i] = self.optimizer_steps
        ring.skipped_steps[i] = self.skipped
        ring.syncs[i] = -1.0
        ring.loss[i] = math.nan
        ring.loss_known[i] = 0.0
        ring.gpu_seconds[i] = -1.0
        step = ring.count + 1
        self.step_start = now
        self.in_tuneup = True
        self.closing = step
        for name, listener in self.on_close:
            try:
                listener(step, i)
            except Exception as exc:
                self.remove_listener(name)
                self.fail(name, exc)
        self.in_tuneup = False
        self.closing = 0
        self._reset()
        ring.count = step  # publish last: readers only see complete records

    # --- values that arrive late (read asynchronously from the device) ----------------

    def _closed_slot(self, step: int) -> int | None:
        if step == self.closing:
            return (step - 1) % self.ring.capacity
        return self.ring.slot(step)

    def record_loss(self, step: int, value: float) -> None:
        slot = self._closed_slot(step)
        if slot is not None:
            self.ring.loss[slot] = value
            self.ring.loss_known[slot] = 1.0

    def record_skip(self, step: int) -> None:
        """A device-side skip flag for `step`, which may still be open."""
        if step > self.ring.count and step != self.closing:
            self.skipped += 1
            return
        slot = self._closed_slot(step)
        if slot is not None:
            self.ring.skipped_steps[slot] += 1

    def record_gpu_seconds(self, step: int, seconds: float) -> None:
        slot = self._closed_slot(step)
        if slot is not None:
            self.ring.gpu_seconds[slot] = seconds

    def add_listener(self, name: str, listener: Callable[[int, int], None]) -> None:
        self.on_close = self.on_close + ((name, listener),)

    def remove_listener(self, name: str) -> None:
        self.on_close = tuple(item for item in self.on_close if item[0] != name)

    def flush(self) -> None:
        """Close the open step at detach, ending it at its last optimizer step."""
        if self.group and self.last_optimizer_end is not None:
            self.close(self.last_optimizer_end)

    def manual_step(self, now: float | None = None) -> None:
        self.manual = True
        if self.step_loss is None and self.loss is not None:
            self.step_loss, self.loss = self.loss, None
        self.close(perf_counter() if now is None else now)
