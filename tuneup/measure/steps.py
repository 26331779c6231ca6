"""Per-step bookkeeping on the training thread: hook events in, one record per step out.

A step ends at an optimizer step (gradient accumulation: many backward passes, one step).
Because a loop may step several optimizers per iteration, a step is closed lazily, when the
next one visibly starts: a batch is fetched after an optimizer stepped, or an optimizer
that already stepped steps again (`StepTimeline.moved_on`, the one place this rule is
written). `tuneup.step()` closes a step explicitly. Step windows therefore tile the timeline
(close to close), and every counter lands in exactly one step.

What runs on every step of a loop with a DataLoader and an optimizer, with its cost in
instructions on the ~0.4 ms CPU step (callgrind, per call; bench_instructions.py counts
about 41,000 per step in all, 4.7% of that step):
- `next(loader)` → the iterator's `__next__` wrapper (loader.py): two clock reads, `moved_on`,
  data wait, samples: 9,700; the close it triggers (one 11-field record into the ring; on
  detail and sampled steps the close listeners: syncs, calls, the agent's): 7,300 a step;
- `model(x)` → the model class's `forward` (model.py, `_patching.measured`): 4,400;
- `loss.backward()` → `Tensor.backward` (model.py, measured): 3,900;
- `optimizer.zero_grad()` (optimizer.py, measured): 3,300;
- `optimizer.step()` → torch's global step pre- and post-hooks (optimizer.py): `moved_on`,
  the optimizer's time: 7,000 with their dispatch;
- each host read (`.item()`, ...: syncs.py): one attribute test off sampled steps.
Each measured wrapper allocates its call's args tuple (and kwargs dict) once; a close one
record tuple.

Measured in place on a 0.4 ms CPU step, every Python operation the hooks run costs several
times its warm cost (torch evicts our code and data between hooks), so the hot path does as
little as it can:
- counters only grow (no per-step reset): a closing step appends one tuple of the running
  totals, and the background thread takes differences between consecutive tuples;
- data wait, samples, step boundaries and optimizer time are measured on every step; the
  forward/backward split, zero_grad time and the loss only on "detail" steps (the first
  five, then every `detail_every`th), like the sync counter's sampled steps;
- values that arrive later or only on some steps (loss, sync counts, GPU time) go to side
  arrays tagged with their step number, so nothing needs clearing per step.
"""

from __future__ import annotations

import math
from array import array
from time import perf_counter
from typing import Any, Callable

# Fields of the per-step tuple, in order: the close time, then running totals since attach
# (timings of the split only grow on detail steps), then whether the step was a detail step.
RECORD = (
    "end",
    "data_wait_seconds",
    "forward_seconds",
    "backward_seconds",
    "optimizer_seconds",
    "samples",
    "fetches",
    "backward_passes",
    "optimizer_steps",
    "skipped_steps",
    "detailed",
)
CUMULATIVE = RECORD[1:-1]
EARLY_DETAIL_STEPS = 5
# Side values: (name, value for a step that has none).
LATE = (
    ("loss", math.nan),  # read from the device when ready; see loss_known in columns()
    ("syncs", -1.0),  # host-device syncs counted on a sampled step; -1: not sampled
    ("gpu_seconds", -1.0),  # from CUDA events; -1: unknown
    ("late_skips", 0.0),  # GradScaler skips reported by the device after the step closed
)


class StepRing:
    """The last `capacity` step records; `count` is the number of steps ever closed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self.records: list[tuple | None] = [None] * capacity
        self.origin: tuple | None = None  # the totals before step 1: (its start, zeros...)
        for name, _ in LATE:
            setattr(self, name, array("d", bytes(8 * capacity)))
            setattr(self, name + "_step", array("q", bytes(8 * capacity)))  # whose value it is

    def holds(self, step: int) -> bool:
        """Whether `step` (closed, or being closed: count + 1) still has its slot."""
        return 1 <= step <= self.count + 1 and self.count + 1 - step < self.capacity

    def put(self, name: str, step: int, value: float, add: bool = False) -> None:
        """Set (or add to) a side value of `step`; ignored once the slot was reused."""
        if not self.holds(step):
            return
        slot = (step - 1) % self.capacity
        values, owners = getattr(self, name), getattr(self, name + "_step")
        if add and owners[slot] == step:
            values[slot] += value
        else:
            values[slot] = value
            owners[slot] = step

    def columns(self, first_step: int, last_step: int) -> dict[str, Any]:
        """Steps first_step..last_step (1-based, inclusive, clipped to what is held), column
        by column, as per-step values, for summaries off the training thread."""
        # A step's values are its record minus the one before: that one must still be held.
        first_step = max(first_step, self.count - self.capacity + 2, 1)
        last_step = min(last_step, self.count)
        steps = range(first_step, last_step + 1) if last_step >= first_step else range(0)
        start = (first_step - 1) % self.capacity
        stop = start + len(steps)
        wrapped = stop > self.capacity

        def window(sequence):
            return sequence[start:stop] if not wrapped else sequence[start:] + sequence[: stop - self.capacity]

        out: dict[str, Any] = {"step": steps}
        records = window(self.records) if steps else []
        if records:
            before = self.origin if first_step == 1 else self.records[(first_step - 2) % self.capacity]
            previous = [before] + records[:-1]
            out["step_seconds"] = [b[0] - a[0] for a, b in zip(previous, records)]
            for index, name in enumerate(CUMULATIVE, start=1):
                out[name] = [b[index] - a[index] for a, b in zip(previous, records)]
            out["detailed"] = [record[-1] for record in records]
        else:
            for name in ("step_seconds", "detailed") + CUMULATIVE:
                out[name] = []
        for name, missing in LATE:
            values, owners = window(getattr(self, name)), window(getattr(self, name + "_step"))
            out[name] = [v if o == s else missing for s, v, o in zip(steps, values, owners)]
        out["loss_known"] = [o == s for s, o in zip(steps, window(self.loss_step))]
        late_skips = out.pop("late_skips")
        out["skipped_steps"] = [a + b for a, b in zip(out["skipped_steps"], late_skips)]
        return out


class StepTimeline:
    """Accumulates the open step from hook events and closes it into the ring."""

    def __init__(self, capacity: int, fail: Callable[[str, BaseException], None], detail_every: int = 4) -> None:
        self.ring = StepRing(capacity)
        self.fail = fail
        self.detail_every = detail_every
        self.detail = True  # measure the split and the loss on the open step
        self.detail_until = 0  # every step up to this one is a detail step (apply mode's guarded steps)
        self.attached_at = perf_counter()  # start of the first step when nothing came before it
        self.step_start: float | None = None
        self.last_optimizer_end: float | None = None
        self.group: list[int] = []  # ids of the optimizers stepped in the open step (not the objects)
        # Regions whose host reads are not the user's: inside the loader, inside
        # optimizer.step (its CPU-side step counters), inside tuneup's own bookkeeping.
        self.in_loader = False
        self.in_optimizer = False
        self.in_tuneup = False
        self.forward_start = 0.0
        self.forward_depth = 0
        self.optimizer_start = 0.0
        self.gpu_timer: Any = None  # CudaStepTimer once the job uses CUDA
        self.loss: Any = None  # detached loss of the latest backward
        self.step_loss: Any = None  # the loss the step's optimizer update consumed
        self.scaled_loss_id = 0  # id of GradScaler.scale()'s output: backward keeps the unscaled loss
        # Run with the step number at the close of every detail step and of the steps a
        # listener asked for through `wake_at` (the agent: loss reads, sync sampling, CUDA
        # events). A listener that raises is dropped and reported through `fail`.
        self.on_close: tuple[tuple[str, Callable[[int], None]], ...] = ()
        self.wake_at = 1
        # Running totals since attach (never reset: see the module docstring).
        self.data_wait = 0.0
        self.forward = 0.0
        self.backward = 0.0
        self.optimizer = 0.0
        self.samples = 0
        self.fetches = 0
        self.backward_passes = 0
        self.optimizer_steps = 0
        self.skipped = 0

    # --- events ---------------------------------------------------------------------------

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

    def moved_on(self, now: float, optimizer: int | None = None) -> None:
        """The step boundary, the one rule (see the module docstring): the loop visibly moved
        on at `now`: a batch fetched, iter(loader), a step function beginning (optimizer
        None), or the optimizer with this id about to step. The open step closes if an
        optimizer stepped in it (for an optimizer: if that same one did; two optimizers
        stepped in one iteration are one step). Otherwise `now` may open the first step."""
        group = self.group
        if group and (optimizer is None or optimizer in group):
            self.close(now)
        elif self.step_start is None:
            self.step_start = now

    def waited(self, began: float, ended: float) -> None:
        """Blocked on data without getting a batch: iter(loader) (worker start-up), or a
        next() that raised (StopIteration at the end of an epoch, the user's exception)."""
        self.moved_on(began)
        self.data_wait += ended - began

    def optimizer_end(self, optimizer: Any, now: float) -> None:
        self.in_optimizer = False
        self.optimizer += now - self.optimizer_start
        self.optimizer_steps += 1
        self.last_optimizer_end = now
        self.group.append(id(optimizer))
        if self.loss is not None:
            self.step_loss, self.loss = self.loss, None

    def optimizer_skipped(self, optimizer: Any, now: float) -> None:
        """GradScaler skipped optimizer.step(): still one step of the loop."""
        self.moved_on(now, id(optimizer))
        self.skipped += 1
        self.last_optimizer_end = now
        self.group.append(id(optimizer))
        if self.loss is not None:
            self.step_loss, self.loss = self.loss, None

    def step_begins(self, now: float) -> None:
        """A @tuneup.step_function call begins: it is a step of its own, so a step the
        loop left open (an optimizer stepped since the last close) closes here."""
        self.moved_on(now)

    # --- closing ------------------------------------------------------------------------

    def close(self, now: float) -> None:
        ring = self.ring
        step = ring.count + 1
        if step == 1:
            start = self.step_start if self.step_start is not None else self.attached_at
            ring.origin = (start,) + (0,) * len(CUMULATIVE) + (True,)
        ring.records[ring.count % ring.capacity] = (
            now, self.data_wait, self.forward, self.backward, self.optimizer, self.samples,
            self.fetches, self.backward_passes, self.optimizer_steps, self.skipped, self.detail,
        )
        if self.detail or step >= self.wake_at or self.step_loss is not None:
            self._notify(step)
        self.step_loss = None  # a loss belongs to the step whose update consumed it
        self.group.clear()
        following = step + 1
        self.detail = (following <= EARLY_DETAIL_STEPS or following % self.detail_every == 0
                       or following <= self.detail_until)
        ring.count = step  # publish last: readers only see complete records

    def _notify(self, step: int) -> None:
        self.in_tuneup = True
        try:
            for name, listener in self.on_close:
                try:
                    listener(step)
                except Exception as exc:
                    self.remove_listener(name)
                    self.fail(name, exc)
        finally:
            self.in_tuneup = False  # also after a KeyboardInterrupt inside a listener

    def flush(self) -> None:
        """Close the open step at detach, ending it at its last optimizer step."""
        if self.group and self.last_optimizer_end is not None:
            self.close(self.last_optimizer_end)

    def manual_step(self, now: float | None = None) -> None:
        """tuneup.step(): close the step now. Automatic boundaries go on working (the
        optimizers stepped so far are forgotten at every close, so none fires twice)."""
        if self.step_loss is None and self.loss is not None:
            self.step_loss, self.loss = self.loss, None
        self.close(perf_counter() if now is None else now)

    # --- values that arrive late (read asynchronously from the device) ----------------

    def record_skip(self, step: int) -> None:
        """A device-side skip flag for `step`, which may still be open."""
        if step == self.ring.count + 1 and not self.in_tuneup:
            self.skipped += 1  # the open step
        else:
            self.ring.put("late_skips", step, 1.0, add=True)

    def add_listener(self, name: str, listener: Callable[[int], None]) -> None:
        self.on_close = self.on_close + ((name, listener),)

    def remove_listener(self, name: str) -> None:
        self.on_close = tuple(item for item in self.on_close if item[0] != name)
