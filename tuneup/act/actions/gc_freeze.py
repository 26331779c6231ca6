"""gc.freeze() for a job whose full garbage collections stop its loop (the gc-pauses finding).

A full collection traverses every container object the process tracks: some 290,000 in a job
that imported torch and built a model and a loader, 80-100 ms each on a 2-core host
(measure/gc_pauses.py). It comes every few hundred steps in a loop that makes Python objects
in the main process (a map-style dataset's samples with num_workers=0: the many_workers script
of benchmarks/bench_apply_scripts.py once its workers are gone, nine of them in 3,000 steps,
9% of its time). `gc.freeze()` moves every tracked object into the permanent generation, which
no collection looks at (Python >= 3.7, Modules/gcmodule.c `gc_freeze_impl`: the young and old
generations are merged into `permanent_generation`); the later ones walk only what the job
made since.

- The change, at a step close (tuneup's own time, left out of the step): `gc.collect()`, so the
  garbage that exists now is freed rather than kept frozen, then `gc.freeze()`.
- Numerics: none. What it changes is when garbage is freed: an object that existed at the
  freeze and later becomes part of unreachable cycles stays in memory while frozen (at most
  what the job held at that step; objects freed by their reference count go as before).
- Judged by what it is for. The trial runs twice the steps the job's full collections have
  been apart (their median spacing, from the collector's record): the step times cannot show
  it in a shorter window, the pauses falling in one step of hundreds, which a window's block
  means do not resolve. Kept where the full collections in the trial took at most half the
  time a step that they took before (median pause over median spacing): the freeze changes
  nothing else a step does, so the trial's step times (said in the record) measure the
  machine's load beside it, and do not decide.
- Undone with `gc.unfreeze()`: the frozen objects go back to the oldest generation, where the
  next full collection looks at them again, as before the freeze.
- Not tried where the job froze objects itself (its freeze is its own, and unfreezing at a
  revert would undo it too) or turned the collector off.
"""

from __future__ import annotations

import gc
import math
from typing import Any

from ..action import NOT_SLOWER, Action, Change, LiveJob
from ..judge import BLOCKS

MIN_WINDOW, MAX_WINDOW = 4 * BLOCKS, 2400  # steps (a job whose full collections come 1,200+ steps apart waits long)
SPACINGS = 2  # the trial holds this many of the spacings seen between the job's full collections
KEEP_BELOW = 0.5  # the trial's full-collection time a step, as a share of before's, that keeps the freeze


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


class FreezeChange(Change):
    action = "gc-freeze"
    description = "gc.freeze() after a gc.collect(): the objects that exist now leave every later collection"
    keep = NOT_SLOWER
    affects_numerics = False  # only when garbage is freed changes

    def __init__(self, job: LiveJob, pause: float, spacing: float) -> None:
        super().__init__()
        self.job = job
        self.pause, self.spacing = pause, spacing  # before: the median full collection, steps apart (>= 1)
        window = min(MAX_WINDOW, max(MIN_WINDOW, math.ceil(SPACINGS * spacing)))
        self.window_steps = BLOCKS * math.ceil(window / BLOCKS)
        self.before = {"gc frozen objects": 0}
        self.after = {"gc frozen objects": None}  # counted at apply()

    def apply(self) -> None:
        gc.collect()
        gc.freeze()
        self.after["gc frozen objects"] = gc.get_freeze_count()
        if self.job.collector is not None:
            self.job.collector.frozen_by_tuneup(self.job.timeline.ring.count + 1)

    def revert(self) -> None:
        gc.unfreeze()
        if self.job.collector is not None:
            self.job.collector.frozen_by_tuneup(None)

    def judged(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """The full collections the trial met against those before decide; the step times are said."""
        trial = verdict["trial"]
        first, last, steps = trial.get("first_step"), trial.get("last_step"), trial.get("steps") or 0
        collector = self.job.collector
        if collector is None or first is None or last is None or not steps:
            return verdict
        pauses = collector.full_since(first, last)
        before = self.pause / self.spacing  # seconds of full collection a step (spacing >= 1: propose)
        after = sum(pauses) / steps
        step = trial.get("mean_step_seconds") or 0.0
        count = f"{len(pauses)} in {steps} steps"
        now = f"{_ms(sum(pauses) / len(pauses))} each ({count})" if pauses else f"none ({count})"
        told = f"full collections {now}, {_ms(self.pause)} each before (one every {self.spacing:.0f} steps)"
        verdict = dict(verdict, measured={"gc": {"before_seconds_per_step": before, "after_seconds_per_step": after,
                                    "before_pause_seconds": self.pause, "before_spacing_steps": self.spacing,
                                    "trial_full_collections": len(pauses), "trial_full_seconds": sum(pauses)}})
        steps_read = f"steps {verdict['speedup']:.2f}x"
        verdict["criterion"] = "shorter pauses"
        if after > KEEP_BELOW * before:
            verdict.update(keep=False, slower=False, reason=f"no shorter pauses: {told}; {steps_read}")
        else:
            # Kept on the pauses alone: the freeze changes nothing else a step does, so a window whose
            # steps ran slower measured the machine, not the change (beside a test suite's other worker
            # the block test read a trial slower whose 139 ms pauses had come down to 0.7 ms).
            saved = f"{_ms(before - after)} a step saved" + (f" ({(before - after) / step:.0%})" if step else "")
            verdict.update(keep=True, slower=False, reason=f"{saved}: {told}; {steps_read}")
        return verdict


class GcFreeze(Action):
    id = "gc-freeze"
    title = "Freeze what set-up built out of the garbage collector's full passes"
    fixes = ("gc-pauses",)
    summary = ("gc.collect() then gc.freeze() once full collections are seen stopping the loop; kept where the "
               "full collections in its trial took at most half the time a step they took before; undone with "
               "gc.unfreeze().")

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        if job.finding(*self.fixes) is None or job.collector is None:
            return None
        if not gc.isenabled():
            self.done = True  # the job turned the collector off itself
            return None
        frozen = gc.get_freeze_count()
        if frozen:
            return self.refuse(f"the job froze {frozen:,} objects itself (gc.freeze()); unfreezing at a revert would "
                               "undo that: move its gc.freeze() later, as the finding's fix says")
        spacing = job.collector.spacing()
        if spacing is None:
            return None  # two full collections seen first: how far apart they come sizes the trial
        pause, steps = spacing  # (proposed again until a trial starts: its baseline may need more steps first)
        return FreezeChange(job, pause, max(1.0, steps))
