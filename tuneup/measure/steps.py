"""The step records: one tuple per closed step in a ring, and its per-step columns.

A step ends at an optimizer step (gradient accumulation: many backward passes, one step),
or, in a loop with no optimizer, at the forward after a backward whose gradients were used
(parameters updated by hand). Evaluation phases between training steps (forwards of a
trained model in eval() mode) are timed apart and left out of the
step's time. Because a loop may step several optimizers per iteration, a step is closed
lazily, when the next one visibly starts (hotpath.py: `StepTimeline.moved_on`, the one place this rule is
written). `tuneup.step()` closes a step explicitly. Step windows therefore tile the timeline
(close to close), and every counter lands in exactly one step.

The training thread writes (hotpath.py); the background thread reads `columns()`:
- counters only grow (no per-step reset): a closing step appends one tuple of the running
  totals, and the background thread takes differences between consecutive tuples;
- values that arrive later or only on some steps (loss, sync counts, GPU time) go to side
  arrays tagged with their step number, so nothing needs clearing per step.
"""

from __future__ import annotations

import math
import random
from array import array
from itertools import compress
from operator import add, eq, is_not, itemgetter, sub
from typing import Any

# A step's record: its close time, the running totals since attach that move on every step
# (EVERY_STEP), and `rest`: a tuple of the totals that move only on detail steps and a few
# events (ON_DETAIL: the split's timings, GradScaler skips, evaluation phases), then whether the
# step was a detail step. Plain steps share one `rest` (the tuple itself, not a copy: the
# close writes six fields, not fourteen, and the drain takes those columns' differences only
# where `rest` changes: StepRing.columns). Build one with `record()`.
EVERY_STEP = ("data_wait_seconds", "samples", "fetches", "optimizer_steps")
ON_DETAIL = ("forward_seconds", "backward_seconds", "optimizer_seconds", "input_seconds", "backward_passes",
             "skipped_steps", "evaluation_seconds", "evaluations")
CUMULATIVE = EVERY_STEP + ON_DETAIL
SPARSE = 16  # `rest` moved on under one step in this many: its columns filled where it did (StepRing.columns)
_NONE_MOVED = tuple(0.0 if name.endswith("_seconds") else 0 for name in ON_DETAIL)  # a plain step's differences


def record(end: float, detailed: bool = False, **totals: float) -> tuple:
    """A step record (see EVERY_STEP): `totals` by their CUMULATIVE names, 0 where left out."""
    unknown = set(totals) - set(CUMULATIVE)
    if unknown:
        raise ValueError(f"no such step totals: {sorted(unknown)}")
    rest = tuple(totals.get(name, 0) for name in ON_DETAIL) + (detailed,)
    return (end,) + tuple(totals.get(name, 0) for name in EVERY_STEP) + (rest,)


EARLY_DETAIL_STEPS = 5
SAMPLING_SEED = 0x7E1E
# One fixed random draw per block (the table repeats after 4,096 blocks: 81,920 steps for blocks
# of 20), so a draw costs an index, not a hash: it runs at every detail step's close.
def _seeded_draws(count: int) -> tuple[int, ...]:
    draws = random.Random(SAMPLING_SEED)
    return tuple(draws.getrandbits(30) for _ in range(count))


_DRAWS = _seeded_draws(4096)


def sampled_after(step: int, every: int) -> int:
    """The first step after `step` chosen when one step is drawn at random from each block of
    `every` steps (1..every, every+1..2*every, ...): stratified sampling. Every block gets its
    sample, so the samples are spread over the run, and no loop period can line up with them
    (evaluation or logging every 10, 50, 100 steps would meet every Nth step each time): an
    average over sampled steps is an unbiased estimate of the run's. The draw is a pure
    function of the block, so asking twice gives the same step."""
    block = step // every  # the block of step + 1
    chosen = block * every + 1 + _DRAWS[block & 4095] % every
    if chosen > step:
        return chosen
    block += 1  # this block's draw is behind `step`: the next block's
    return block * every + 1 + _DRAWS[block & 4095] % every


# Side values: (name, value for a step that has none).
LATE = (
    ("loss", math.nan),  # read from the device when ready; see loss_known in columns()
    ("syncs", -1.0),  # host-device syncs counted on a sampled step; -1: not sampled
    ("gpu_seconds", -1.0),  # from CUDA events; -1: unknown
    ("late_skips", 0.0),  # GradScaler skips reported by the device after the step closed
    ("compile_seconds", 0.0),  # torch.compile's compilations during the step (compiled.py)
    ("input_samples", -1.0),  # no DataLoader: the batch dimension of a detail step's training forwards; -1: not seen
    ("own_seconds", 0.0),  # tuneup's listeners at the close that opened the step (a precision trial): not the job's
    ("epoch_starts", 0.0),  # iter(loader) calls in the step: an epoch began (its workers started) there
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
        # The latest step each side value was put for: a window after it has none (most side
        # values come on a few steps, some never), and `columns` need not look at its slots.
        self.latest = dict.fromkeys((name for name, _ in LATE), 0)

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
        if step > self.latest[name]:
            self.latest[name] = step

    def side(self, name: str, step: int, default: float = 0.0) -> float:
        """A side value of `step` (`default` where it has none, or its slot was reused)."""
        if not self.holds(step):
            return default
        slot = (step - 1) % self.capacity
        return getattr(self, name)[slot] if getattr(self, name + "_step")[slot] == step else default

    def closed_total(self, name: str) -> float:
        """The running total `name` (one of EVERY_STEP) as the latest close recorded it; 0
        before any close."""
        if not self.count:
            return 0
        return self.records[(self.count - 1) % self.capacity][1 + EVERY_STEP.index(name)]

    def recent_step_seconds(self, steps: int) -> float:
        """The mean time of the last `steps` closed steps (fewer where fewer are held); 0.0
        before two steps closed."""
        count = min(steps, self.count - 1, self.capacity - 1)
        if count < 1:
            return 0.0
        newest = self.records[(self.count - 1) % self.capacity]
        oldest = self.records[(self.count - 1 - count) % self.capacity]
        return (newest[0] - oldest[0]) / count

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
            # Column by column at C speed (map, itemgetter, operator.sub): the background thread
            # runs this over every step, holding the GIL the training thread waits for.
            before = self.origin if first_step == 1 else self.records[(first_step - 2) % self.capacity]
            # Field by field (itemgetter), not zip(*rows): that makes an iterator object per row,
            # and their thousands of allocations set off the garbage collector (a collection of
            # every generation in a job holding torch's millions of objects takes milliseconds,
            # the GIL held: 8,000 steps' columns in the agent's process, 11.5 ms and 11
            # collections a call against 3.7 ms and none this way).
            rows = [before, *records]
            fields = [list(map(itemgetter(index), rows)) for index in range(len(before))]
            for index, name in enumerate(EVERY_STEP, start=1):
                totals = fields[index]
                out[name] = list(map(sub, totals[1:], totals[:-1]))
            # The totals in `rest` moved only where the tuple is another one (a detail step, the
            # plain step after it, an event's step): a Python loop over those alone, where they
            # are few (short steps, paced detail steps); else, as above, every step's.
            rests = fields[-1]
            moved = list(compress(range(len(records)), map(is_not, rests[1:], rests[:-1])))
            if len(moved) * SPARSE < len(records):
                columns = [[zero] * len(records) for zero in _NONE_MOVED]
                for index in moved:
                    for column, now, was in zip(columns, rests[index + 1], rests[index]):
                        column[index] = now - was
                out.update(zip(ON_DETAIL, columns))
            else:
                for index, name in enumerate(ON_DETAIL):
                    totals = list(map(itemgetter(index), rests))
                    out[name] = list(map(sub, totals[1:], totals[:-1]))
            # A step's time is its training: an evaluation phase inside it is reported apart.
            ends = fields[0]
            seconds = list(map(sub, ends[1:], ends[:-1]))
            if any(out["evaluation_seconds"]):
                seconds = list(map(sub, seconds, out["evaluation_seconds"]))
            out["step_seconds"] = _not_negative(seconds)
            out["detailed"] = list(map(itemgetter(-1), rests[1:]))
        else:
            for name in ("step_seconds", "detailed") + CUMULATIVE:
                out[name] = []
        for name, missing in LATE:
            if self.latest[name] < first_step:  # none put since the window began
                owned = [False] * len(steps)
                out[name] = [missing] * len(steps)
            else:
                owned = list(map(eq, window(getattr(self, name + "_step")), steps))  # the slot's value is this step's
                out[name] = _owned(window(getattr(self, name)), owned, missing)
            if name == "loss":
                out["loss_known"] = owned
        own = out["own_seconds"]
        if any(own):
            out["step_seconds"] = _not_negative(list(map(sub, out["step_seconds"], own)))
        late_skips = out.pop("late_skips")
        if any(late_skips):
            out["skipped_steps"] = list(map(add, out["skipped_steps"], late_skips))
        compiling = out["compile_seconds"]
        if any(compiling):
            # A step that compiled is a warm-up step: its compilations are reported apart (as an
            # evaluation is), and it gives no phase split (the compile sits inside its forward,
            # backward or optimizer step).
            out["step_seconds"] = _not_negative(list(map(sub, out["step_seconds"], compiling)))
            out["detailed"] = [flag and not spent for flag, spent in zip(out["detailed"], compiling)]
        return out


def _not_negative(values: list[float]) -> list[float]:
    """`values` with each negative one 0.0 (the list itself where none is: most windows)."""
    if not values or min(values) >= 0.0:
        return values
    return [value if value > 0.0 else 0.0 for value in values]


def _owned(values: Any, owned: list[bool], missing: float) -> list[float]:
    """A side array's window as per-step values: each slot's value where the slot is its own
    step's (`owned`), else `missing`; a Python loop only over the owned slots of a window
    that has some but not all (the loss on detail steps, syncs on sampled ones)."""
    held = owned.count(True)
    if held == len(owned):
        return values.tolist() if isinstance(values, array) else list(values)
    out = [missing] * len(owned)
    if held:
        for index in compress(range(len(owned)), owned):
            out[index] = values[index]
    return out
