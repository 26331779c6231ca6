"""The Experimenter: runs apply mode's changes one at a time, as experiments.

    baseline (the last W steps in the current configuration) -> apply at a step boundary ->
    settle steps -> trial (the next W steps) -> judge -> keep, or revert at a step boundary

It runs on the training thread, in the agent's step-close listener, so every change lands
between two steps and sees the step records the moment they close; at a close it sees the
steps before the closing one. W is sized from the noise of the recent steps: enough to tell
a 10% gain (default_window), at least half a second and 24 steps, at most a second. An action's
first trial, where its finding predicts a larger gain, is sized to tell half that gain and looked
at twice: at its own W (held to p < FIRST_LOOK_ALPHA) and, where that read faster but not
certain, again at the 10% W (held to the rest of ALPHA): a job gains a large change as soon as
a short window can show it, and a smaller gain than predicted is not thrown away for it.
Every other trial of a change kept for speed is looked at twice as well: at its W (p <
FIRST_LOOK_ALPHA) and, where that read faster but not certain, at twice W or, where the noise
asks for more than the second's cap holds, at what it asks (up to NOISY_LOOK_FACTOR times the
capped W): a real gain is not undone for a window too short to show it.
A kept change's trial window is the next change's baseline; after a revert the job settles
again first, and the undone trial's baseline serves the next trial (the same configuration, a
window earlier).
While a change is in its guard period its `check()` runs at every close (and its own hooks
may skip an update and roll it back inside a step); after that, on detail steps.

Every record (one per change: what, before/after settings, the windows' numbers, the
verdict and why) is kept in `records` and queued in `events` for the background thread to
log. A failure inside apply mode reverts everything it changed and turns apply mode off
with one warning; the job goes on as the user configured it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from statistics import median
from dataclasses import dataclass
from typing import Any, Callable

from ..measure.history import WARMUP_STEPS
from ..measure.windows import DETECT, summarize
from .action import FASTER, Action, Change, LiveJob
from .judge import ALPHA, BLOCKS, MIN_SPEEDUP, judge

NEVER = 1 << 62
# A trial's windows hold enough steps to tell a DETECT gain in mean step time (windows.py) from the
# noise the job's recent steps show, and no more; at least MIN_SECONDS of steps (a second of a
# 1 ms step is 1,000 steps; a few hundred average the machine's own jitter as well).
MIN_SECONDS = 0.5
# And at most MAX_SECONDS of steps (at least MIN_WINDOW): a noisier job's trial loses power (more
# "not certain"), not correctness, and every action still gets its turn within a short run.
MAX_SECONDS = 1.0
# A trial that runs this many times slower than its baseline is cut short and judged on the
# steps it has (at least MIN_TRIAL_STEPS): bf16 on a CPU without bf16 units can be 20x slower.
DEADLINE_FACTOR = 3
MIN_TRIAL_STEPS = 2 * BLOCKS
REVERT_WAIT_SECONDS = 2.0  # how long revert_all() from another thread waits for a step close
MIN_WINDOW = 4 * BLOCKS
MAX_WINDOW = 1200
RECENT_STEPS = 64
NOISE_BLOCK = 4  # steps a block of the noise estimate holds: alternating fast and slow steps even out
LOOK_EVERY_STEPS = 16  # while a finding waits for its moment, proposals are asked for this often
# Where the GPUs' energy counter can be read, a trial starts this many steps at least after it
# was first read in the configuration the trial's baseline measures (_Energy).
ENERGY_STEPS = 8
REUSE_WINDOWS = 4  # an undone trial's baseline serves the next trial while it ended this many windows ago
MIN_UNDONE_TO_STOP = 2  # an action's trials undone before their cost can stop the next (_not_worth_a_trial)
# A trial looked at twice (sized from its finding's predicted gain first, _first_look_detect)
# spends ALPHA across its looks: this much at the first, the rest at the second (Bonferroni:
# the chance that either look keeps a change that does not pay stays under ALPHA). The judge's
# exact test of BLOCKS block means a side reaches only k/924: 0.0011, 0.0022, 0.0043, 0.0076,
# 0.013, 0.021, 0.032, 0.047 (judge.p_smaller). At 0.01 and 0.04 the looks used 0.0076 and
# 0.032 of the 0.05, and a 1.82x trial of I/O-bound workers at 0.047 (one block pair in
# seven out of order) was undone at its second look; at 0.0025 and 0.0475, 0.0022 and 0.047.
FIRST_LOOK_ALPHA = 0.0025
# A second look (second_look_window) runs to twice the first's window at least; where the noise
# asks for more steps than MAX_SECONDS holds, to what it asks, up to this many times the window.
NOISY_LOOK_FACTOR = 4


def default_window(step_times: list[float], detect: float = DETECT, seconds: float | None = MAX_SECONDS) -> int:
    """Steps per window, a multiple of BLOCKS within [MIN_WINDOW, MAX_WINDOW], from the recent
    steps' times. The judge compares BLOCKS block means a side; for a `detect` gain to stand
    about two spreads clear of the noise, a block must hold k steps with
    cv(k) = cv(NOISE_BLOCK) x sqrt(NOISE_BLOCK / k) <= detect / 2, where cv(NOISE_BLOCK) is the
    robust relative spread (1.4826 MAD / median) of the recent steps' means over NOISE_BLOCK
    steps (a loader with workers alternates fast and slow steps; their means do not). At most
    `seconds` of steps (None: what the noise asks)."""
    if not step_times:
        return MIN_WINDOW
    means = [sum(step_times[i:i + NOISE_BLOCK]) / NOISE_BLOCK
             for i in range(0, len(step_times) - NOISE_BLOCK + 1, NOISE_BLOCK)] or [sum(step_times) / len(step_times)]
    center = median(means)
    if center <= 0:
        return MIN_WINDOW
    spread = 1.4826 * median(abs(mean - center) for mean in means) / center
    per_block = math.ceil(NOISE_BLOCK * (2 * spread / detect) ** 2)
    steps = max(BLOCKS * per_block, math.ceil(MIN_SECONDS / center))
    if seconds is not None:
        steps = min(steps, math.ceil(seconds / center))
    steps = min(MAX_WINDOW, max(MIN_WINDOW, steps))
    return BLOCKS * math.ceil(steps / BLOCKS)


def second_look_window(step_times: list[float], first: int) -> int:
    """A trial's second look, after a first of `first` steps: the 10% window (default_window),
    or where the job is noisier than MAX_SECONDS of steps can tell 10% from, what the noise
    asks, up to NOISY_LOOK_FACTOR times that; at least twice `first` (within MAX_WINDOW). The
    noise of the recent steps is not the trial's: in CI's full suite two I/O-bound workers'
    1.37x and three's 1.57x read p=0.12 at 24-30 steps a side, their steps alternating in a
    pattern the baseline's 4-step means had smoothed (tests/test_apply.py, the I/O-bound workers)."""
    capped = default_window(step_times)
    asked = min(default_window(step_times, seconds=None), NOISY_LOOK_FACTOR * capped)
    return min(MAX_WINDOW, max(asked, 2 * first))


@dataclass
class _Trial:
    change: Change
    action: Action
    record: dict[str, Any]
    baseline: dict[str, Any]
    first: int
    last: int
    allowance: float  # seconds the trial's steps may take before it is judged on the steps it has
    deadline: float | None = None  # time.monotonic() of that moment, once the trial's first step ran
    # The GPUs' energy while the baseline ran (joules a step, watts), and the counter at the end
    # of the step before the trial's first (_Energy marks)
    baseline_energy: dict[str, float] | None = None
    energy_start: tuple[int, float, float] | None = None
    alpha: float = ALPHA  # the level this look is held to
    longer: int | None = None  # a second look's window, where this (first) look reads undecided
    longer_if_faster: bool = False  # ... only where it read faster (a first look not sized for a predicted gain)

    def due(self, step: int) -> bool:
        """At the close of `step`, whose ring holds the steps before it. The deadline's clock
        starts with the trial's own steps, not at apply: a settle step may compile for seconds
        (the compile action's first calls compile forward and backward)."""
        ran = step - self.first
        if ran >= self.last - self.first + 1:
            return True
        if ran < 1:
            return False
        if self.deadline is None:
            self.deadline = time.monotonic() + self.allowance
        return ran >= MIN_TRIAL_STEPS and time.monotonic() >= self.deadline


def _trial_cost(record: dict[str, Any]) -> float:
    """Seconds a judged trial cost the job: its window's, its settle steps' and, once it was
    undone, the settle steps after the undo (`undo_settle`: the old workers starting again)
    time over what the same steps took at the baseline's mean (none where they were faster)."""
    base = record["baseline"]["mean_step_seconds"]
    extra = sum(max(0.0, settle["seconds"] - settle["steps"] * base)
                for settle in (record.get("settle"), record.get("undo_settle")) if settle)
    return max(0.0, record["trial"]["mean_step_seconds"] - base) * record["trial"]["steps"] + extra


class _Energy:
    """NVML's energy counters read at step closes while apply mode works (at its looks, at a
    change, at a trial's first step and at its verdict), so that a change's row can say what a
    step cost in joules before and after it. A mark (step, joules, time) is the counter at the
    end of that step. A window's energy runs from a mark at or before its first step (in the
    same configuration) to one at or after its last: the steps in between, all of them in it."""

    KEEP = 16

    def __init__(self, read: Callable[[Any], float | None] | None, gpus: Callable[[], Any]) -> None:
        self.read, self.gpus = read, gpus
        self.marks: deque[tuple[int, float, float]] = deque(maxlen=self.KEEP)

    @property
    def on(self) -> bool:
        return self.read is not None

    def mark(self, step: int) -> tuple[int, float, float] | None:
        """The counter now, at the close of `step`; None (and off from now) where it cannot be read."""
        if self.read is None:
            return None
        try:
            joules = self.read(self.gpus())
        except Exception:
            joules = None  # NVML failing here is the GPU probe's to report; apply mode goes on
        if joules is None:
            self.read = None
            return None
        mark = (step, joules, time.perf_counter())
        self.marks.append(mark)
        return mark

    def marked(self, first: int, last: int) -> bool:
        """Whether a mark was taken at the close of a step in first..last."""
        return any(first <= mark[0] <= last for mark in self.marks)

    def since(self, first: int, end: tuple[int, float, float]) -> dict[str, float] | None:
        """Joules a step and watts from the earliest mark at or after step `first` - 1 to `end`."""
        start = next((mark for mark in self.marks if first - 1 <= mark[0] < end[0]), None)
        return self.between(start, end)

    @staticmethod
    def between(start: tuple[int, float, float] | None, end: tuple[int, float, float] | None) -> dict[str, float] | None:
        if start is None or end is None or end[0] <= start[0] or end[1] < start[1] or end[2] <= start[2]:
            return None  # (a counter that fell: the driver reloaded)
        joules = end[1] - start[1]
        return {"joules_per_step": joules / (end[0] - start[0]), "watts": joules / (end[2] - start[2]),
                "steps": end[0] - start[0]}


class Experimenter:
    def __init__(self, job: LiveJob, actions: list[Action], warn: Callable[[str, str], None]) -> None:
        self.job = job
        self.actions = actions
        self.warn = warn
        self.on = True
        self.accepting = True  # False after revert_all(): nothing new is tried
        self.records: list[dict[str, Any]] = []
        self.events: deque[dict[str, Any]] = deque()
        self.applied: list[tuple[Change, Action, dict[str, Any]]] = []  # in effect, oldest first
        self.trial: _Trial | None = None
        self.stable_since = WARMUP_STEPS + 1  # first step of the current configuration
        # The baseline of a trial that was not kept: the configuration it measured is back in
        # effect, so the next trial may compare against it rather than wait a window again.
        self._reusable: dict[str, Any] | None = None
        self.wake_at = NEVER
        self._next_look = 0
        self._lock = threading.RLock()
        self.training_thread: int | None = None
        self._undone = 0
        self._revert_request: tuple[str, threading.Event, Callable[[], None] | None] | None = None
        self._worth_looking = False  # some action is busy or has a finding to fix (see publish)
        # Undone trials whose settle steps after the undo have yet to close: (record, first, last)
        self._undo_settling: list[tuple[dict[str, Any], int, int]] = []
        self.energy = _Energy(job.energy, self._job_gpus)
        job.guard_failed = self._fail
        # The actions left out of this run (the `actions` option): a finding one of them would fix
        # gets a record saying so once, not a silent "apply mode can make it" (_say_unchosen).
        self.unchosen: list[type[Action]] = []
        self.chosen: tuple[str, ...] = tuple(action.id for action in actions)

    @classmethod
    def on_probes(cls, recorder: Any, allowed: tuple[str, ...] | None, warn: Callable[[str, str], None]) -> "Experimenter":
        """Apply mode over a recorder's probes (measure/recorder.py), with the actions
        `allowed` (None: all of them)."""
        from .actions import ACTIONS, DEFAULT_ACTIONS

        job = LiveJob(recorder.timeline, recorder.loader, recorder.optimizer, recorder.model, recorder.scaler,
                      compiles=recorder.compile, collector=recorder.collector, energy=recorder.gpus.energy_joules if recorder.gpus.available else None)
        ids = allowed if allowed is not None else DEFAULT_ACTIONS
        experimenter = cls(job, [ACTIONS[name]() for name in ACTIONS if name in ids], warn)
        experimenter.unchosen = [action for name, action in ACTIONS.items() if name not in ids]
        models = recorder.model
        models.before_training = experimenter.at_start
        if models.explicit and recorder.timeline.ring.count == 0:  # named models: no discovery to wait for
            for model in models.root_models():
                experimenter.at_start(model)
        return experimenter

    def at_start(self, model: Any) -> None:
        """Before `model`'s first training forward: the changes that only work from the start
        (cudnn.benchmark: actions' `at_start`), applied now, recorded as set at start, and kept
        while their `check()` finds nothing against them."""
        if not (self.on and self.accepting):
            return
        with self._lock:
            try:
                for action in self.actions:
                    start = getattr(action, "at_start", None)
                    change = start(self.job, model) if start is not None and not action.done else None
                    if action.not_applicable is not None:
                        self._note(action, "not applicable", action.not_applicable)
                        action.not_applicable = None
                    if change is None:
                        continue
                    step = self.job.timeline.ring.count + 1
                    record = self._record(change, action, step, step)  # before that step's forward
                    change.apply()
                    record.update(decision="set at start", criterion="kept while its check finds nothing against it",
                                  reason="it only works from the start: " + (change.at_start_reason or
                                                                             "set before the job's first step"),
                                  applied_at=time.time())
                    self.applied.append((change, action, record))
                    self._emit(record)
            except Exception as exc:
                self._fail(exc)

    def publish(self, findings: list[dict[str, Any]], system: dict[str, Any] | None,
                config: dict[str, Any] | None) -> None:
        """The background thread's latest findings, host sample and configuration, which the
        actions' propose() reads."""
        self.job.findings = {finding["rule"]: finding for finding in findings}
        self.job.system, self.job.config = system or {}, config or {}
        self._worth_looking = self._anything_to_try()
        if self.unchosen and self.on and self.accepting:
            with self._lock:  # (records are appended on the training thread too)
                self._say_unchosen()

    def _job_gpus(self) -> list[Any] | None:
        """The GPUs the job holds memory on, per the latest system sample (None: every one)."""
        samples = ((self.job.system or {}).get("gpu") or {}).get("samples") or []
        return [device["gpu"] for device in samples if device.get("process_memory_bytes")] or None

    def _anything_to_try(self) -> bool:
        """Whether an action is in the middle of a sequence or has a finding to fix."""
        return any(action.busy or (not action.done and action.wanted(self.job)) for action in self.actions)

    # --- the training thread ---------------------------------------------------------

    def on_close(self, step: int) -> None:
        """At a step close; the ring holds the steps before `step`."""
        if not self.on or not (self.applied or self.trial is not None or self._revert_request is not None
                               or self._worth_looking):
            return  # idle: nothing in effect, nothing asked for, nothing worth trying
        self.training_thread = threading.get_ident()
        with self._lock:
            try:
                if self._revert_request is not None:
                    reason, done, kept_reached = self._revert_request
                    self._revert_request = None
                    self._revert_now(reason, kept_reached)
                    done.set()
                    return
                self._check_guards(step)
                trial = self.trial
                if trial is not None and trial.energy_start is None and step >= trial.first - 1 and self.energy.on:
                    trial.energy_start = self.energy.mark(step)
                if self.trial is not None:
                    if self.trial.due(step):
                        self._decide(step)
                elif self.accepting:
                    self._maybe_start(step)
                self._plan(step)
            except Exception as exc:
                self._fail(exc)

    def _check_guards(self, step: int) -> None:
        detail = self.job.timeline.detail
        for change, action, record in list(self.applied):
            if not any(entry[0] is change for entry in self.applied):
                continue  # taken back meanwhile (a rollback ends the trial beside it)
            if step <= record["applied_step"] + change.guard_steps or detail or change.rollback_reason:
                reason = change.check(step)
                if reason:
                    self._roll_back(change, action, record, reason, step)

    def _ordered(self) -> list[Action]:
        """Actions still to run: those without a trial judged yet first (every action gets its
        turn before another takes a second one: in a 400-step run the DataLoader's climb, its
        second trial looked at twice, held the experimenter until detach and the zero_grad
        action, offered from the start, was never tried); then one in the middle of a
        sequence, then by the estimated gain of the finding that starts them; a deferred one
        (a long trial) last."""
        def gain(action: Action) -> float:
            finding = self.job.finding(*action.fixes)
            return (finding or {}).get("gain") or 0.0

        judged = {record["action"] for record in self.records if record.get("trial")}
        waiting = [action for action in self.actions if not action.done]
        return sorted(waiting, key=lambda action: (action.deferred, action.id in judged, not action.busy,
                                                   -gain(action)))

    def _say_unchosen(self) -> None:
        """A record, once per action, for a finding that says apply mode can make it where its
        action is not among those chosen for this run."""
        for kind in list(self.unchosen):
            finding = self.job.finding(*kind.fixes)
            if finding is None or not finding.get("can_apply"):
                continue
            self.unchosen.remove(kind)
            chosen = ", ".join(self.chosen) or "none"
            opt_in = " (it is opt-in: `all,` does not include it)" if kind.opt_in else ""
            self._note(kind, "not chosen",
                       f"the {kind.id} action is not among the actions chosen for this run ({chosen}){opt_in}: "
                       f"add it with --actions / TUNEUP_ACTIONS, e.g. {','.join(self.chosen + (kind.id,))}")

    def _not_worth_a_trial(self, action: Action, recent: dict[str, Any] | None, steps: int) -> str | None:
        """Why another trial of `action` cannot pay for itself (None: it may). Once two or more
        of its trials were undone, what they cost (the trial windows' and settle steps' time over
        their baselines') is what another is expected to cost where it fails; what it may save
        is its finding's gain over a run as long again as the one so far (how long a job runs is
        unknown: the steps so far are the estimate that errs least in the long run), at the
        chance of a keep its trials have had so far ((kept + 1) / (tried + 2))."""
        finding = self.job.finding(*action.fixes)
        gain = (finding or {}).get("gain")
        step_seconds = ((recent or {}).get("step_seconds") or {}).get("mean")
        judged = [r for r in self.records if r.get("action") == action.id and r.get("trial") and r.get("baseline")]
        undone = [r for r in judged if r["decision"] != "kept"]
        if len(undone) < MIN_UNDONE_TO_STOP or not gain or not step_seconds:
            return None
        cost = sum(_trial_cost(r) for r in undone)
        chance = (len(judged) - len(undone) + 1) / (len(judged) + 2)
        may_save = gain * step_seconds * steps * chance
        expected_cost = (1 - chance) * cost / len(undone)
        if expected_cost <= may_save:
            return None
        return (f"its {len(undone)} trials undone cost the job {cost:.2f} s; another would be expected to cost "
                f"{expected_cost:.2f} s against {may_save:.2f} s it may save ({gain:.0%} of a step over a run as long "
                f"again as the {steps} steps so far, at a {chance:.0%} chance of a keep)")

    def _undo_settled(self, last: int) -> None:
        """The settle steps after an undo, once closed (`last`: the newest step in the ring): their
        time goes into the undone trial's record (`undo_settle`), and so into its cost."""
        ring = self.job.timeline.ring
        for entry in [entry for entry in self._undo_settling if entry[2] <= last]:
            self._undo_settling.remove(entry)
            record, first, end = entry
            if ring.holds(first):
                settle = ring.columns(first, end)["step_seconds"]
                record["undo_settle"] = {"steps": len(settle), "seconds": sum(settle)}

    def _maybe_start(self, step: int) -> None:
        last = step - 1
        if self._undo_settling:
            self._undo_settled(last)
        if last - self.stable_since + 1 < MIN_WINDOW or step < self._next_look:
            return
        if not self._anything_to_try():
            return
        waiting = [action for action in self._ordered() if action.busy or action.wanted(self.job)]
        if not waiting:
            return
        if self.energy.on and not self.energy.marked(self.stable_since - 1, step - ENERGY_STEPS):
            # A baseline's energy needs the counter read in its configuration a few steps back.
            self.energy.mark(step)
            self._next_look = step + ENERGY_STEPS
            return
        self._next_look = step + LOOK_EVERY_STEPS  # if nothing starts now
        ring = self.job.timeline.ring
        recent = summarize(ring.columns(max(self.stable_since, last - RECENT_STEPS + 1), last))
        for action in waiting:
            unpaid = self._not_worth_a_trial(action, recent, last)
            if unpaid is not None:
                action.done = True
                self._note(action, "stopped", unpaid)
                continue
            try:
                change = action.propose(self.job, recent)
            except Exception as exc:
                action.done = True
                self._note(action, "failed", f"could not propose a change: {type(exc).__name__}: {exc}")
                self.warn(f"action:{action.id}", f"apply mode: the {action.id} action failed and is off "
                                                 f"({type(exc).__name__}: {exc})")
                continue
            if action.not_applicable is not None:
                self._note(action, "not applicable", action.not_applicable)
                action.not_applicable = None
            if change is not None:
                break
        else:
            return
        times = list(ring.columns(max(self.stable_since, last - RECENT_STEPS + 1), last)["step_seconds"])
        detect = self._first_look_detect(action, change)
        window = change.window_steps or default_window(times, detect)
        # A second look: after a first sized for a predicted gain, either way; after any other,
        # only where it read faster.
        longer = second_look_window(times, window) if not change.window_steps and change.keep == FASTER else None
        if_faster = detect <= DETECT
        first = last - window + 1
        if first >= self.stable_since:
            baseline = ring.columns(first, last)
        else:
            baseline = self._reused_baseline(window, last)
            if baseline is None:
                # Too few steps in this configuration yet: propose again once they are there
                self._next_look = min(self._next_look, self.stable_since + window)
                return
        self._reusable = None
        # The first step that runs with the change: the next, unless the close came at an
        # optimizer step, after the next step's forward (a loop without a fetch); its trial's
        # steps start there (after the settle steps), so no step of the old setting is judged.
        effective = step + (2 if self.job.timeline.closed_at_update else 1)
        record = self._record(change, action, step, effective)
        before = self.energy.mark(step)
        baseline_energy = self.energy.since(max(baseline["step"][0], self.stable_since), before) if before else None
        try:
            change.apply()
        except Exception as exc:
            try:
                change.revert()
            except Exception:
                pass  # reported below with the apply failure
            action.done = True
            record.update(decision="failed", reason=f"could not apply: {type(exc).__name__}: {exc}")
            self._emit(record)
            return
        record["applied_at"] = time.time()
        self.applied.append((change, action, record))
        expected = (change.settle_steps + window) * sum(baseline["step_seconds"]) / len(baseline["step_seconds"])
        self.trial = _Trial(change, action, record, baseline, effective + change.settle_steps,
                            effective + change.settle_steps + window - 1,
                            DEADLINE_FACTOR * max(expected, MIN_SECONDS), baseline_energy=baseline_energy,
                            energy_start=before if not change.settle_steps else None,
                            **({"alpha": FIRST_LOOK_ALPHA, "longer": longer, "longer_if_faster": if_faster}
                               if longer and longer > window else {}))
        timeline = self.job.timeline
        timeline.detail_through(step + change.guard_steps)
        self._emit(record)

    def _first_look_detect(self, action: Action, change: Change) -> float:
        """The gain in mean step time `change`'s trial is sized to tell: for an action's first
        trial of a change kept for speed, half the gain its finding predicts where that is more
        than DETECT (a prediction off by half still shows; a smaller gain gets the second look,
        _look_again); else DETECT. On 8 DataLoader workers over 2 cores, data-stall predicts 44%
        shorter steps: a 100-step trial (the half second floor) in place of 210."""
        if change.keep != FASTER or change.window_steps:
            return DETECT
        if any(record.get("action") == action.id and record.get("trial") for record in self.records):
            return DETECT
        gain = (self.job.finding(*action.fixes) or {}).get("gain") or 0.0
        return max(DETECT, min(gain, 1.0) / 2)

    def _look_again(self, trial: _Trial, verdict: dict[str, Any], step: int) -> None:
        """A first look that read undecided (after one not sized for a predicted gain: faster):
        the trial goes on to `longer` steps (second_look_window), held to what is left of ALPHA,
        against a baseline reaching back as far (where the job ran the old configuration that
        long before the change)."""
        record = trial.record
        record["first_look"] = {"steps": step - trial.first, "speedup": verdict["speedup"],
                                "p_faster": verdict["p_faster"], "alpha": trial.alpha,
                                "sized": (f"then run on to {trial.longer}" if trial.longer_if_faster
                                          else "sized for the gain predicted")}
        longer = trial.longer or 0
        base_first, base_last = trial.baseline["step"][0], trial.baseline["step"][-1]
        reach = max(self.stable_since, base_last - longer + 1)
        if base_first >= self.stable_since and reach < base_first and self.job.timeline.ring.holds(reach):
            trial.baseline = self.job.timeline.ring.columns(reach, base_last)
        mean = sum(trial.baseline["step_seconds"]) / len(trial.baseline["step_seconds"])
        trial.allowance = DEADLINE_FACTOR * max((trial.first + longer - step) * mean, MIN_SECONDS)
        trial.deadline = None
        trial.last = trial.first + longer - 1
        trial.alpha, trial.longer = ALPHA - FIRST_LOOK_ALPHA, None
        self.trial = trial

    def _reused_baseline(self, window: int, last: int) -> dict[str, Any] | None:
        """W steps of the configuration in effect: those since the last trial was undone, after
        the end of that trial's baseline (the same configuration, measured a trial earlier),
        where that baseline is still recent (ended within REUSE_WINDOWS windows); so a run's
        trials are not spaced two windows apart."""
        baseline = self._reusable
        if baseline is None or last - baseline["step"][-1] > REUSE_WINDOWS * window:
            return None
        current = self.job.timeline.ring.columns(self.stable_since, last)
        # Where the noise of the few steps since asks for more than that baseline holds, all of
        # it: a window judged long enough a trial ago (a shorter one loses power, the p-value
        # still holds: more "not certain", not more wrong keeps).
        need = min(window - len(current["step_seconds"]), len(baseline["step_seconds"]))
        return {name: list(baseline[name])[len(baseline[name]) - need:] + list(values)
                for name, values in current.items()}

    def _record(self, change: Change, action: Action, step: int, effective: int) -> dict[str, Any]:
        record = {"id": len(self.records) + 1, "action": action.id, "title": action.title, "fixes": list(action.fixes),
                  "change": change.description, "before": dict(change.before), "after": dict(change.after),
                  "criterion": change.keep, "applied_step": step, "decision": "trying",
                  "effective_step": effective,  # the first step that runs with it
                  "reason": "on trial", "time": time.time()}
        self.records.append(record)
        return record

    def _note(self, action: Action | type[Action], decision: str, reason: str) -> None:
        record = {"id": len(self.records) + 1, "action": action.id, "title": action.title, "fixes": list(action.fixes),
                  "decision": decision, "reason": reason, "time": time.time()}
        self.records.append(record)
        self._emit(record)

    def _decide(self, step: int) -> None:
        trial = self.trial
        assert trial is not None
        self.trial = None
        columns = self.job.timeline.ring.columns(trial.first, min(trial.last, step - 1))
        verdict = trial.change.judged(judge(trial.baseline, columns, trial.change.keep, trial.change.affects_numerics,
                                            trial.change.cut_epoch_starts, alpha=trial.alpha))
        if verdict["undecided"] and trial.longer is not None and step > trial.last \
                and (not trial.longer_if_faster or verdict["speedup"] >= MIN_SPEEDUP):
            self._look_again(trial, verdict, step)
            return
        record = trial.record
        if trial.first > record["effective_step"]:  # the settle steps (new workers start): a trial's cost too
            settle = self.job.timeline.ring.columns(record["effective_step"], trial.first - 1)["step_seconds"]
            record["settle"] = {"steps": len(settle), "seconds": sum(settle)}
        if verdict.get("measured"):  # what a change's own reading of the trial measured (Change.judged)
            record["measured"] = verdict["measured"]
        record.update(decision="kept" if verdict["keep"] else "reverted", reason=verdict["reason"],
                      slower=verdict["slower"],
                      baseline=verdict["baseline"], trial=verdict["trial"], speedup=verdict["speedup"],
                      p_faster=verdict["p_faster"], p_slower=verdict["p_slower"], criterion=verdict["criterion"],
                      alpha=trial.alpha,  # what this look's p was held to (a second look: ALPHA's rest)
                      decided_step=step,
                      time=time.time())
        look = record.get("first_look")
        if look:
            record["reason"] += (f"; looked at twice: {look['speedup']:.2f}x after {look['steps']} steps, "
                                 f"{look['sized']}")
        self._energy_change(trial, step)
        if verdict["keep"]:
            self.stable_since = trial.first
        else:
            self._take_back(trial.change, step)
            self._reusable = trial.baseline
            if trial.change.settle_steps:  # the old setting settles again (workers restart): costed once closed
                self._undo_settling.append((record, step + 1, step + trial.change.settle_steps))
        trial.action.decided(trial.change, record)
        self._emit(record)

    def _energy_change(self, trial: _Trial, step: int) -> None:
        """The GPUs' joules a step (and watts) in the baseline and the trial, where NVML's energy
        counters were read at both ends of each: a faster step at the same power costs fewer
        joules; a change can also raise the power (more workers, a busier GPU).

        The power is the counter's joules over the seconds between its marks; a step's joules
        are that power times the judged window's mean step (the step time the speed-up is
        judged on). Joules over the marks' steps alone would be a different mean: the marks
        span only part of a window (on an H100 conv net with 1 s stalls among 10 ms steps they
        said 3.8 J a step where the window's power and mean step made 2.5)."""
        if trial.baseline_energy is None or trial.energy_start is None:
            return
        after = _Energy.between(trial.energy_start, self.energy.mark(step))
        before = trial.baseline_energy
        if after is None or not before["watts"]:
            return
        record = trial.record
        joules = {}
        for side, power, window in (("before", before, record.get("baseline")), ("after", after, record.get("trial"))):
            mean_step = (window or {}).get("mean_step_seconds")
            joules[side] = power["watts"] * mean_step if mean_step else power["joules_per_step"]
        record["energy"] = {
            "before_joules_per_step": joules["before"], "after_joules_per_step": joules["after"],
            "ratio": joules["after"] / joules["before"] if joules["before"] else None,
            "before_watts": before["watts"], "after_watts": after["watts"],
            "power_steps": [before["steps"], after["steps"]], "source": "NVML energy counter"}

    def _roll_back(self, change: Change, action: Action, record: dict[str, Any], reason: str, step: int) -> None:
        trial = self.trial
        self.trial = None
        if trial is not None and trial.change is not change:
            # Its window would span two configurations: it ends without a verdict.
            self._take_back(trial.change, step)
            trial.record.update(decision="reverted", reason=f"ended without a verdict: {change.description} "
                                                            "was rolled back during its trial",
                                decided_step=step, time=time.time())
            trial.action.decided(trial.change, trial.record)
            self._emit(trial.record)
        self._take_back(change, step)
        record.update(decision="rolled back", reason=reason, decided_step=step, time=time.time())
        action.decided(change, record)
        self._emit(record)

    def _take_back(self, change: Change, step: int) -> None:
        change.revert()  # first: a revert that fails stays in effect, for revert_all to try again
        self._reusable = None
        self.applied = [entry for entry in self.applied if entry[0] is not change]
        self.stable_since = step + 1 + change.settle_steps

    def _plan(self, step: int) -> None:
        if not self.applied and self.trial is None:
            self.wake_at = NEVER  # nothing in effect: the detail steps' closes are enough
            return
        guarded = [record["applied_step"] + change.guard_steps for change, _, record in self.applied]
        if any(step < end for end in guarded):
            self.wake_at = step + 1
        elif self.trial is not None:
            self.wake_at = self.trial.last + 1
            if self.trial.energy_start is None and self.energy.on:  # the counter at the trial's start
                self.wake_at = min(self.wake_at, max(step + 1, self.trial.first - 1))
        else:
            self.wake_at = NEVER

    def _emit(self, record: dict[str, Any]) -> None:
        self.events.append(dict(record))

    def _fail(self, exc: BaseException) -> None:
        self.on = False
        try:
            self.revert_all("apply mode stopped after an internal error")
        finally:
            self.warn("apply", f"apply mode turned off after an internal error ({type(exc).__name__}: {exc}); "
                               "every change it made was reverted")

    # --- any thread ------------------------------------------------------------------------

    def revert_all(self, reason: str = "revert_all()", wait: float = REVERT_WAIT_SECONDS,
                   kept_reached: Callable[[], None] | None = None) -> int:
        """Undo every change in effect, newest first, and try nothing more. Returns how many
        changes were undone. From a thread other than the training thread, the training
        thread does it at its next step close (a change flipped in the middle of a step can
        break that step: a GradScaler switched off between its scale() and step()); when no
        step closes within `wait` seconds, training has stopped and it is done here."""
        if (self.on and wait > 0 and self.training_thread is not None
                and threading.get_ident() != self.training_thread):
            done = threading.Event()
            with self._lock:
                self._revert_request = (reason, done, kept_reached)
                self.job.timeline.wake_at = 0  # the next close calls on_close
            if done.wait(wait):
                return self._undone
            with self._lock:
                self._revert_request = None
        return self._revert_now(reason, kept_reached)

    def _revert_now(self, reason: str, kept_reached: Callable[[], None] | None = None) -> int:
        """Undo newest first: the change on trial, then the kept ones; `kept_reached` runs once
        the trial is undone, before the first kept change is (detach: the configuration the
        kept settings give, for the final report)."""
        with self._lock:
            self.accepting = False
            step = self.job.timeline.ring.count + 1
            undone = 0
            errors = []
            for change, action, record in reversed(self.applied):
                if kept_reached is not None and record["decision"] != "trying":
                    try:
                        kept_reached()
                    except Exception as exc:  # the changes must still be undone
                        errors.append(f"before {change.description}: {type(exc).__name__}: {exc}")
                    kept_reached = None
                try:
                    change.revert()
                except Exception as exc:  # the others must still be undone
                    errors.append(f"{change.description}: {type(exc).__name__}: {exc}")
                undone += 1
                if record["decision"] == "trying":
                    record.update(decision="reverted", reason=f"{reason} before the trial ended", time=time.time())
                else:
                    record["undone"] = {"step": step, "reason": reason, "time": time.time()}
                self._emit(record)
            self.applied = []
            self.trial = None
            self.wake_at = NEVER
            if errors:
                self.warn("revert", "apply mode could not revert " + "; ".join(errors))
            self._undone = undone
            return undone

    def close(self) -> None:
        """At detach, after revert_all(): the actions let go of what they still hold."""
        with self._lock:
            for action in self.actions:
                try:
                    action.close()
                except Exception as exc:
                    self.warn("revert", f"apply mode could not clean up {action.id}: {type(exc).__name__}: {exc}")

    def state(self) -> dict[str, Any]:
        """What is in effect and on trial now (for snapshots and metrics)."""
        with self._lock:
            return {
                "on": self.on,
                "accepting": self.accepting,
                "in_effect": [record["id"] for _, _, record in self.applied],
                "on_trial": self.trial.record["id"] if self.trial is not None else None,
            }

    def drain(self) -> list[dict[str, Any]]:
        """The records changed since the last drain (background thread: to the run log)."""
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out
