"""Python's garbage collector, timed: a collection stops the training thread wherever it lands.

CPython runs `gc.callbacks` at the start and the stop of every collection (Modules/gcmodule.c,
`invoke_gc_callback`: phase "start" or "stop", info {"generation", "collected",
"uncollectable"}), on the thread whose allocation set it off, with the GIL held: every thread
of the job waits for it, whichever thread it runs on. A young collection (generations 0 and 1)
looks at the objects made since the last one: microseconds. A full one (generation 2) looks at
every container object the process tracks, and a process that imported torch holds some
170,000 of them before it builds anything (290,000 once many_workers.py below has built its
model and loader): 100-200 ms on a 2-core CPU host
(benchmarks/apply_scripts/many_workers.py with num_workers=0: nine of them, 1.4 s of an
8.7 s loop). It comes when enough objects have survived into the oldest generation (a quarter
as many as it holds: gcmodule.c `gc_collect_generations`, `long_lived_pending`), so a loop that keeps
a little of each step (a log of per-step dicts, batches of Python objects) meets one every
few hundred steps, and its step takes that much longer. `gc.freeze()` after set-up moves the
objects made so far where no collection looks again (Python >= 3.7): the full ones then
traverse only what the job made since.

tuneup's own share of that walk: its modules and an attached agent add some 3,900 objects to
the 170,000 of torch's import (len(gc.get_objects()) before and after), 2% of a full
collection's work.

Counted from the first step on, outside evaluation phases and tuneup's own work at a step's
close (the training time, which leaves both out, is the share's denominator). The callback is
two calls a collection, and collections come a few per thousand steps of a plain loop: nothing
per step.
"""

from __future__ import annotations

import gc
from collections import deque
from statistics import median
from time import perf_counter
from typing import Any

from .hotpath import StepTimeline

RECENT_FULL = 64  # full collections whose pauses are kept (median, longest)


class GcPauses:
    name = "gc"

    def __init__(self, timeline: StepTimeline) -> None:
        self.timeline = timeline
        self.fail = timeline.fail  # (name, exc): one warning, this probe off
        self.on = True
        self.collections = [0, 0, 0]  # by generation
        self.seconds = [0.0, 0.0, 0.0]
        self.full: deque[float] = deque(maxlen=RECENT_FULL)  # the latest full collections' pauses
        self.full_steps: deque[int] = deque(maxlen=RECENT_FULL)  # ... and the steps they fell in
        self._began: float | None = None
        # Apply mode's gc.freeze() (act/actions/gc_freeze.py), while in effect: (the first step
        # after it, its perf_counter time, the full collections and their seconds until then).
        # The job's figures from there on are what the freeze leaves.
        self.tuneup_freeze: tuple[int, float, int, float] | None = None
        self._settled: dict[str, Any] | None = None  # its figures as detach found them (settle)

    def frozen_by_tuneup(self, step: int | None) -> None:
        """Apply mode froze the heap, effective from `step` (None: unfrozen again)."""
        self.tuneup_freeze = None if step is None else (step, perf_counter(), self.collections[2], self.seconds[2])

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def close(self) -> None:
        self.on = False
        try:
            gc.callbacks.remove(self._callback)
        except ValueError:  # not installed, or the job cleared the list
            pass

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # Never raise: CPython reports an exception from a callback as unraisable, on the job's stderr.
        try:
            if phase == "start":
                tl = self.timeline
                # Not before the first step, in an evaluation phase, or in tuneup's own work at a
                # close (a precision trial, the FLOP count: its allocations set off the two full
                # collections a 0.03 s regression script met, inside 0.9 s of tuneup's own time).
                counted = self.on and tl.step_start is not None and not (tl.evaluating or tl.in_tuneup)
                self._began = perf_counter() if counted else None
                return
            began, self._began = self._began, None
            if began is None:
                return
            spent = perf_counter() - began
            generation = min(2, max(0, int(info.get("generation", 0))))
            self.collections[generation] += 1
            self.seconds[generation] += spent
            if generation == 2:
                self.full.append(spent)
                self.full_steps.append(self.timeline.ring.count + 1)  # the open step
        except Exception as exc:
            self.close()
            try:
                self.fail(self.name, exc)
            except Exception:  # nothing may leave a gc callback (it would print on the job's stderr)
                pass

    def settle(self) -> None:
        """At detach, before apply mode undoes what it kept: the freeze's figures, for the final report."""
        self._settled = self._since_freeze()

    def _since_freeze(self) -> dict[str, Any] | None:
        """The full collections since apply mode's freeze, the wall time since it, the objects it froze."""
        if self.tuneup_freeze is None:
            return self._settled
        step, began, full, spent = self.tuneup_freeze
        return {"from_step": step, "full_collections": self.collections[2] - full,
                "full_seconds": self.seconds[2] - spent, "wall_seconds": perf_counter() - began,
                "objects": gc.get_freeze_count()}

    def _kept(self) -> tuple[list[int], list[float]]:
        """The kept full collections' steps and pauses, copied (a collection set off while a list
        is built appends to the deques) and aligned from the newest (a callback between the copies)."""
        steps, pauses = list(self.full_steps), list(self.full)
        n = min(len(steps), len(pauses))
        return steps[len(steps) - n:], pauses[len(pauses) - n:]

    def full_since(self, first: int, last: int) -> list[float]:
        """The pauses of the full collections kept (the latest RECENT_FULL) that fell in steps first..last."""
        steps, pauses = self._kept()
        return [spent for step, spent in zip(steps, pauses) if first <= step <= last]

    def spacing(self) -> tuple[float, float] | None:
        """The median pause of the kept full collections and the median steps between them (None: fewer than two)."""
        steps, pauses = self._kept()
        if len(steps) < 2:
            return None
        return median(pauses), median(b - a for a, b in zip(steps, steps[1:]))

    def summary(self) -> dict[str, Any]:
        full = list(self.full)
        return {
            "collections": list(self.collections),
            "seconds": list(self.seconds),
            "full_median_seconds": median(full) if full else None,
            "full_max_seconds": max(full) if full else None,
            "full_steps": list(self.full_steps)[-8:],
            "frozen": gc.get_freeze_count(),
            "tuneup_freeze": self._since_freeze(),
            "enabled": gc.isenabled(),
            "thresholds": list(gc.get_threshold()),
        }
