"""What an action and a change are.

An `Action` (one file each in `actions/`) fixes the findings of some rules. When one of them
fires and the action's safety conditions hold, `propose()` returns a `Change`: one concrete
edit of the job's live objects (`num_workers 0 -> 2`) that can `apply()` and `revert()`
itself exactly, and whose `check()` says, while it is in effect, whether it must be rolled
back at once (a non-finite loss under AMP); guards that must run before an optimizer
update go through `LiveJob.add_guard`. The Experimenter (experimenter.py) decides whether a
change stays; the action hears the verdict through `decided()` and proposes its next change
(the DataLoader action climbs one knob at a time) or is done.

Everything here runs on the training thread, between steps, except `propose()`'s reads of
the findings and the host sample, which the agent's background thread publishes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from ..measure.loader import LoaderProbe
from ..measure.model import ModelProbe
from ..measure.optimizer import OptimizerProbe
from ..measure.scaler import ScalerProbe
from ..measure.hotpath import StepTimeline

FASTER = "faster"  # kept only when the trial is measurably faster than the baseline
NOT_SLOWER = "not slower"  # kept unless measurably slower: what it buys is not step time (memory)


@dataclass
class LiveJob:
    """What actions read and change: the job's objects as the probes found them, and the
    latest findings, host sample and configuration (published by the background thread)."""

    timeline: StepTimeline
    loaders: LoaderProbe
    optimizers: OptimizerProbe
    models: ModelProbe
    scalers: ScalerProbe
    compiles: Any = None  # the recorder's CompileProbe (measure/compiled.py): compilations so far
    collector: Any = None  # the recorder's GcPauses (measure/gc_pauses.py): full collections, timed
    # fn(gpu labels or None) -> joules NVML's energy counters read now, or None (measure/gpu.py)
    energy: Callable[[Any], float | None] | None = None
    findings: dict[str, dict[str, Any]] = field(default_factory=dict)
    system: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    # Changes' guards around each optimizer step, fn(optimizer), run from the optimizer probe's
    # step hooks (hotpath.py) while any is in effect: torch cannot take a hook added or removed
    # while it runs the hooks, and a change may be applied or rolled back in the middle of an
    # optimizer step. A guard that raises goes to `guard_failed` (the Experimenter's _fail).
    before_update: tuple[Callable[[Any], None], ...] = ()
    after_update: tuple[Callable[[Any], None], ...] = ()
    guard_failed: Callable[[BaseException], None] | None = None
    skipping: set[int] = field(default_factory=set)  # optimizers whose update a guard is skipping now

    def add_guard(self, before: Callable[[Any], None], after: Callable[[Any], None] | None = None) -> None:
        self.before_update = self.before_update + (before,)
        if after is not None:
            self.after_update = self.after_update + (after,)
        self._wire_guards()

    def remove_guard(self, before: Callable[[Any], None], after: Callable[[Any], None] | None = None) -> None:
        self.before_update = tuple(guard for guard in self.before_update if guard != before)
        if after is not None:
            self.after_update = tuple(guard for guard in self.after_update if guard != after)
        self._wire_guards()

    def _wire_guards(self) -> None:
        self.optimizers.guard_before = self._run_before_update if self.before_update else None
        self.optimizers.guard_after = self._run_after_update if self.after_update else None

    def _run_before_update(self, optimizer: Any) -> None:
        self._run(self.before_update, optimizer)

    def _run_after_update(self, optimizer: Any) -> None:
        self._run(self.after_update, optimizer)

    def _run(self, guards: tuple[Callable[[Any], None], ...], optimizer: Any) -> None:
        # tuneup's own work: a read a guard makes (AMP's finite check) is no sync of the job's
        # (the syncs probe skips reads while in_tuneup, on either backend).
        timeline = self.timeline
        prior, timeline.in_tuneup = timeline.in_tuneup, True
        try:
            for guard in guards:
                try:
                    guard(optimizer)
                except Exception as exc:  # never into the job's optimizer.step()
                    if self.guard_failed is not None:
                        self.guard_failed(exc)
        finally:
            timeline.in_tuneup = prior

    def finding(self, *rules: str) -> dict[str, Any] | None:
        """The first of these rules' current findings, if any fires."""
        findings = self.findings
        for rule in rules:
            if rule in findings:
                return findings[rule]
        return None

    @property
    def distributed(self) -> bool:
        """Several ranks train together: a change that touches numerics would be kept or
        rolled back by each rank on its own."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return True
        return (os.environ.get("WORLD_SIZE") or "1").strip() not in ("", "1")

    @property
    def on_cuda(self) -> bool:
        return self.models.cuda_device() is not None


class Change:
    """One edit of the running job. Subclasses set the fields and implement apply/revert."""

    action: str = ""
    description: str = ""  # what changes, in the user's words: "num_workers 0 -> 2"
    settle_steps: int = 5  # steps after apply() left out of the trial (warm-up of the new setting)
    window_steps: int | None = None  # trial length; None: the Experimenter's (about a second of steps)
    guard_steps: int = 0  # steps after apply() on which check() runs every step, then on detail steps
    keep: str = FASTER
    # Whether it can change the loss: a DataLoader change serves the same batches in the same
    # order, so its trial's loss is the job's own and says nothing about the change.
    affects_numerics: bool = True
    at_start_reason: str | None = None  # a change made before the first step (Experimenter.at_start): why then
    # Whether the steps that began an epoch are left out of the windows judged (judge.steady):
    # all but persistent_workers, whose gain sits in those steps.
    cut_epoch_starts: bool = True

    def __init__(self) -> None:
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}
        self.rollback_reason: str | None = None  # set by a guard inside a step; the Experimenter rolls back

    def apply(self) -> None:
        raise NotImplementedError

    def revert(self) -> None:
        raise NotImplementedError

    def check(self, step: int) -> str | None:
        """At step closes while in effect: a reason to roll back at once, or None."""
        return self.rollback_reason

    def judged(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """The judge's verdict on the trial's step times (judge.py), as this change reads it: a
        change whose gain the step times cannot resolve (gc.freeze: pauses in one step of hundreds)
        adds what shows it and may overrule the keep. As judged, by default."""
        return verdict


class Action:
    """A kind of safe change. `fixes`: the rule ids whose findings start it."""

    id: ClassVar[str]
    title: ClassVar[str]
    fixes: ClassVar[tuple[str, ...]]
    summary: ClassVar[str]  # what it changes, when it keeps it, what rolls it back (`tuneup actions`)
    opt_in: ClassVar[bool] = False  # taken only where the user names it, never by default ("all")
    needs_finding: ClassVar[bool] = True  # False: tried without one of `fixes` firing (only opt-in ones)

    def __init__(self) -> None:
        self.done = False  # nothing more to try in this run
        self.busy = False  # in the middle of a sequence of changes: go on before other actions
        self.deferred = False  # what is left holds the experimenter long: after every other action's turn
        self.not_applicable: str | None = None  # why the finding cannot be acted on (reported once)

    def wanted(self, job: LiveJob) -> bool:
        """Whether the job calls for this action now: one of the findings it fixes fires (an
        action that needs none, always)."""
        return not self.needs_finding or job.finding(*self.fixes) is not None

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        """The next change to try now, or None. `recent`: a summary of the latest steps in
        the current configuration (windows.summarize), None when there are too few."""
        raise NotImplementedError

    def decided(self, change: Change, record: dict[str, Any]) -> None:
        """The verdict on a change this action proposed (record["decision"])."""
        self.done = True

    def close(self) -> None:
        """At detach, after every change was reverted: remove whatever the action still holds."""

    def refuse(self, reason: str) -> None:
        """The finding fires but the change is not safe here: say why once, and stop."""
        self.not_applicable = reason
        self.done = True
