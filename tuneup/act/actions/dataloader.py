"""DataLoader tuning: a runtime AUTOTUNE for PyTorch's input pipeline.

Started by a data stall (or, on CUDA, pageable copies), it searches one knob at a time, each
move an experiment of its own, on the loader the training loop is reading:

1. num_workers, while the stall is above STALL_TARGET, both ways:
   - up: the next count is estimated from the measured split (a batch takes about `wait` to
     load in-process, or `workers x step` with workers; one must be ready every
     `step - wait`), then verified by the trial; after a rejected count, the count halfway
     between the current one and it (0 -> 2 rejected: 1); not where data-stall found the wait
     to be the shipping (more workers ship every batch still), nor from none where data-stall
     found the job's own threads keeping the cores busy (a worker's making takes its CPU from
     the step: `cpu_bound` with no gain);
   - down, where no count above the job's own was faster (or the job has more workers than
     usable cores): to the usable cores, then to 0 (where the batches are cheaper to make than
     to ship between processes, none is best, whatever one worker measured; first, where
     data-stall measured that, or that the wait is the shipping), then halfway to the count
     rejected below. Once a
     count below the job's is kept, no workers are added back. In the main process the dataset draws
     from random streams of its own, seeded as a worker's are (`_OwnStreams`: torch's always,
     Python's and numpy's once it is seen drawing from them), not from the job's, and it is
     not tried where the loader has a worker_init_fn;
2. pin_memory=True on a CUDA job;
3. prefetch_factor doubled, while the stall stays (bursty loads);
4. persistent_workers=True when epochs are short enough to put an epoch start in each
   window (otherwise its gain, one worker start-up per epoch, is not measurable); kept
   unless slower, as its gain sits in one step per epoch, below what a block test resolves.
   Its trial waits for an epoch start, so it goes after every other action's turn.

A rejected move closes its knob (num_workers: that direction, once its neighbours are
tried). A search that tries nothing says why, in one record. Workers are not added to a
loader that runs in the main process when they would not fork (spawn re-imports the script) or
when its dataset draws from torch's global RNG while the same RNG orders its samples (later
epochs would come in another order). Bounds: no more workers than usable cores (affinity and
cgroup quota) unless data-stall measured the job's workers waiting rather than computing and
advises more (then its count), and no more than half the free RAM at the measured size of a worker (the
main process's until a worker was measured). Changes land mid-epoch through a LoaderSwitch (see
`act/loader_switch.py`): the sequence of samples the model sees does not change, and the global
RNG is not drawn from. While tuneup's settings are in effect, each epoch's iterator is
built by tuneup too, so a worker that fails in a later epoch is recovered the same way; each
epoch start draws from the job's random streams what the job's own settings would have
drawn (`_EpochStarts`: persistence decides whether a worker seed is drawn, and a shuffling
sampler without a generator draws from the same global RNG); and persistent workers whose
dataset's attributes were reassigned between epochs (`dataset.epoch = e`) are started
afresh, since they hold the dataset they started with.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import weakref
from statistics import median
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler,
                              SubsetRandomSampler, WeightedRandomSampler)

from ..._patching import PatchSet, unwind
from ...measure.host import usable_cores
from ...measure.loader import loader_of
from ..action import FASTER, NOT_SLOWER, Action, Change, LiveJob
from ..loader_switch import (KNOBS, Settings, TapedSampler, build_iterator, effective, epoch_iterator, live_iterators,
                        persistent, settings_of, shut_down, switch_loader, why_not_switchable)

STALL_TARGET = 0.05  # below this share of step time, more loading capacity is not worth a trial
MAX_WORKERS = 32
MAX_PREFETCH = 8
WORKER_MARGIN = 1.25  # workers estimated from the split, plus this much for jitter
RAM_SHARE = 0.5  # workers may take at most this share of the free RAM
PERSISTENT_MAX_EPOCH = 600  # steps: longer epochs put no epoch start in a trial window
PERSISTENT_WORTH = 0.01  # of an epoch's time, a start-up saved worth saying so where not tried
RECENT_START_UP = 64  # steps whose median data wait is a step's own, beside an epoch start's
_LATER = object()  # a move that must wait for a better moment (the next epoch to start)


def order_uses_global_rng(loader: DataLoader) -> bool:
    """Whether the order of the loader's samples comes from torch's global RNG (a shuffling
    sampler without a generator of its own, or a sampler tuneup does not know)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return True
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    if type(sampler) in (SequentialSampler, DistributedSampler):
        return False
    if type(sampler) in (RandomSampler, SubsetRandomSampler, WeightedRandomSampler):
        return getattr(sampler, "generator", None) is None
    return True


def _fingerprint(value: Any, depth: int = 0) -> tuple:
    """A dataset's attributes as bound now: identity, the value of plain scalars, the length
    of containers, and the same for the datasets it wraps (Subset, ConcatDataset...)."""
    items = []
    for name, attribute in sorted(getattr(value, "__dict__", {}).items()):
        scalar = attribute if isinstance(attribute, (int, float, str, bool)) else None
        size = len(attribute) if isinstance(attribute, (list, tuple, dict, set)) else None
        inner: Any = None
        if depth < 3:
            if isinstance(attribute, Dataset):
                inner = _fingerprint(attribute, depth + 1)
            elif isinstance(attribute, (list, tuple)) and attribute and all(isinstance(a, Dataset) for a in attribute):
                inner = tuple(_fingerprint(a, depth + 1) for a in attribute)
        items.append((name, id(attribute), scalar, size, inner))
    return tuple(items)


@dataclass
class _Watched:
    loader: weakref.ref
    job_settings: Settings
    fingerprint: tuple
    quiet: bool = False  # all changes reverted; the job's persistent iterator is rebuilt once, drawing nothing


class _EpochStarts:
    """How each epoch of the loader being tuned starts.

    `DataLoader._get_iterator`: while tuneup's settings are in effect, a new epoch's iterator
    is built by tuneup (`epoch_iterator`), so a failure of its workers is recovered with the
    job's own settings, and it draws from the job's random streams what the job's own
    iterator would have (see loader_switch.TapedSampler). When every change was reverted but the
    job's persistent iterator had to go, the next one is rebuilt once drawing nothing, as
    the job's reset would have. `DataLoader.__iter__`: where tuneup made the loader
    persistent and the dataset's attributes were reassigned between epochs
    (`dataset.epoch = e`), the workers, which hold the dataset they started with, start afresh."""

    def __init__(self) -> None:
        self.watched: dict[int, _Watched] = {}
        self.patches = PatchSet()
        self.on_failure: Callable[[BaseException], None] = lambda exc: None
        self.on_source: Callable[[Any], None] = lambda iterator: None

    def watch(self, loader: DataLoader, job_settings: Settings, on_failure: Callable[[BaseException], None],
              on_source: Callable[[Any], None]) -> None:
        if not self.watched:
            self.patches.replace(DataLoader, "__iter__", self._wrap_iter)
            self.patches.replace(DataLoader, "_get_iterator", self._wrap_get_iterator)
        self.watched[id(loader)] = _Watched(weakref.ref(loader), dict(job_settings), _fingerprint(loader.dataset))
        self.on_failure, self.on_source = on_failure, on_source

    def forget(self, loader: DataLoader, final: bool = False) -> None:
        watched = self._of(loader)
        if watched is not None and not final and persistent(watched.job_settings) and loader._iterator is None:
            watched.quiet = True
            return
        self.watched.pop(id(loader), None)
        if not self.watched:
            self.patches.undo_all()

    def close(self) -> None:
        self.watched.clear()
        self.patches.undo_all()

    def _of(self, loader: DataLoader) -> _Watched | None:
        watched = self.watched.get(id(loader))
        return watched if watched is not None and watched.loader() is loader else None

    def _wrap_iter(self, original):
        starts = self

        @functools.wraps(original)
        def __iter__(loader):
            watched = starts._of(loader)
            if (watched is not None and not persistent(watched.job_settings) and persistent(settings_of(loader))
                    and loader._iterator is not None):  # tuneup's persistent iterator, about to be reset
                fingerprint = _fingerprint(loader.dataset)
                if fingerprint != watched.fingerprint:
                    watched.fingerprint = fingerprint
                    stale, loader._iterator = loader._iterator, None
                    shut_down(stale)
            try:
                return original(loader)
            except BaseException as exc:
                unwind(exc)  # the job's own traceback (_patching.py)
                raise

        return __iter__

    def _wrap_get_iterator(self, original):
        starts = self

        @functools.wraps(original)
        def _get_iterator(loader):
            try:
                watched = starts._of(loader)
                if watched is None:
                    return original(loader)
                if settings_of(loader) != watched.job_settings:
                    return epoch_iterator(loader, watched.job_settings, starts.on_failure, starts.on_source)
                if watched.quiet:
                    starts.forget(loader, final=True)
                    return build_iterator(loader, watched.job_settings, TapedSampler(loader, watched.job_settings))
                return original(loader)  # the job's own settings: built as the job builds it
            except BaseException as exc:
                unwind(exc)  # the job's own traceback (_patching.py)
                raise

        return _get_iterator


class LoaderChange(Change):
    action = "dataloader"
    keep = FASTER
    affects_numerics = False

    def __init__(self, tuning: "DataLoaderTuning", job: LiveJob, loader: DataLoader, knob: str,
                 before: Settings, after: Settings) -> None:
        super().__init__()
        self.tuning = tuning
        self.job = job
        self.loader = weakref.ref(loader)
        self.knob = knob
        self.before, self.after = dict(before), dict(after)
        changed = [knob for knob in KNOBS if before[knob] != after[knob] and
                   not (knob == "prefetch_factor" and not before["num_workers"])]
        self.description = ", ".join(f"{knob} {before[knob]} -> {after[knob]}" for knob in changed)
        # The old iterator serves the batches its workers hold (num_workers x prefetch_factor)
        # and then stops them (joining each: tens of ms, once), new workers start and fill
        # their queues: all before the trial's window, whose mean would carry those one-offs.
        held = before["num_workers"] * (effective(before)["prefetch_factor"] or 0)
        self.settle_steps = max(5, 2 + held + after["num_workers"] * (after["prefetch_factor"] or 0))

    def apply(self) -> None:
        loader = self.loader()
        if loader is not None:
            self.tuning.now_in_effect(self, loader)
            self._set(self.after)

    def revert(self) -> None:
        loader = self.loader()
        if loader is not None:
            self._set(self.tuning.job_settings if self.tuning.failed else self.before)
            self.tuning.no_longer_in_effect(self, loader)

    def _set(self, settings: Settings) -> None:
        loader = self.loader()
        if loader is None:
            return
        switch_loader(loader, settings, self.job.loaders.iterators, self.tuning.job_settings,
                      self.tuning.source_failed, self.job.loaders.iterators.add)
        # The configuration marks what apply mode set, with the job's own values beside it (read
        # again at the next tick: a trial undone showed its settings for ten more ticks).
        self.job.loaders.settings_changes += 1
        if effective(settings) == effective(self.tuning.job_settings):
            self.job.loaders.job_own.pop(id(loader), None)
        else:
            self.job.loaders.job_own[id(loader)] = dict(self.tuning.job_settings)


def _one_line(exc: BaseException) -> str:
    """The error as one line: a worker's error arrives with its whole traceback in the
    message, whose last line is the original `Type: message`."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and "Traceback" in str(exc):
        return lines[-1][:300]
    return f"{type(exc).__name__}: {' '.join(lines)[:300]}"


class DataLoaderTuning(Action):
    id = "dataloader"
    title = "Tune the DataLoader (workers, prefetch, pinning, persistence)"
    fixes = ("data-stall", "pageable-copies")
    summary = ("num_workers (sized from the measured split, at most the usable cores, or data-stall's count for workers "
               "that wait on I/O, and half the free RAM), "
               "then pin_memory (CUDA), persistent_workers (short epochs; kept unless slower) and "
               "prefetch_factor; switched mid-epoch with the same batches in the same order; the other "
               "moves kept only when faster.")

    def __init__(self) -> None:
        super().__init__()
        self.target: weakref.ref | None = None
        self.job_settings: Settings = {}
        self.settings: Settings = {}
        self.closed: set[str] = set()  # knobs whose last move was rejected
        self.rejected: set[int] = set()  # worker counts measured slower than another
        self.raised = False  # a count above the job's own was kept: fewer workers would be slower
        self.lowered = False  # a count below was kept: the job's workers cost more than they saved, none are added
        self.tried = 0  # changes proposed
        self.passed_over: list[str] = []  # why knobs were not tried (said when nothing was)
        self.bound_said = "the usable cores"  # what bounds num_workers (max_workers)
        self.failed = False
        self.epoch_starts = _EpochStarts()
        self.in_effect: list[LoaderChange] = []
        self.dataset_seen: tuple[Any, int, tuple] | None = None  # (dataset, step, _fingerprint), first looked at

    def now_in_effect(self, change: LoaderChange, loader: DataLoader) -> None:
        """The epoch-start hooks live while any change is in effect."""
        if not self.in_effect:
            self.epoch_starts.watch(loader, self.job_settings, self.source_failed, change.job.loaders.iterators.add)
        self.in_effect.append(change)

    def no_longer_in_effect(self, change: LoaderChange, loader: DataLoader) -> None:
        self.in_effect = [known for known in self.in_effect if known is not change]
        if not self.in_effect:
            self.epoch_starts.forget(loader)

    def close(self) -> None:
        self.epoch_starts.close()

    def source_failed(self, exc: BaseException) -> None:
        """A source with tuneup's settings failed (the switch already fetches with the job's
        own): every change in effect goes, and the climb ends."""
        self.failed = True
        reason = (f"the loader failed with tuneup's settings ({_one_line(exc)}); the batches it had not "
                  "delivered were fetched again, in order, with the job's own settings")
        for change in self.in_effect:
            if change.rollback_reason is None:
                change.rollback_reason = reason

    # --- which loader -------------------------------------------------------------------

    @staticmethod
    def _reading(job: LiveJob) -> DataLoader | None:
        """The loader whose live iterator has served the most batches: the training loop's (an
        evaluation's loader is none: a validation pass serves more batches than an epoch's part)."""
        best, served = None, -1
        evaluation = job.loaders.evaluation_loaders
        for iterator in list(job.loaders.iterators):
            loader = loader_of(iterator)
            if (loader is not None and loader not in evaluation and iterator._num_yielded > served
                    and iterator in live_iterators(loader, job.loaders.iterators)):
                best, served = loader, iterator._num_yielded
        return best

    def wanted(self, job: LiveJob) -> bool:
        if self.dataset_seen is None:  # (_why_no_workers: whether the dataset changes as the job trains)
            loader = self._reading(job)
            if loader is not None:
                self._see_dataset(job, loader)
        return super().wanted(job)

    def _see_dataset(self, job: LiveJob, loader: DataLoader) -> None:
        self.dataset_seen = loader.dataset, job.timeline.ring.count, _fingerprint(loader.dataset)

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        if job.finding(*self.fixes) is None and not self.busy:
            return None
        if recent is None or recent.get("stall_ratio") is None:
            return None
        if self.target is None:
            loader = self._reading(job)
            if loader is None:
                return None  # between epochs: look again at the next step
            reason = why_not_switchable(loader)
            if reason:
                return self.refuse(f"the DataLoader is left as it is: {reason}")
            self.target = weakref.ref(loader)
            self.job_settings = settings_of(loader)
            self.settings = dict(self.job_settings)
            self.busy = True
        loader = self.target()
        if loader is None or self.failed:
            return self._finish()
        change = self._next(job, loader, recent)
        if change is _LATER:
            return None
        if change is None:
            return self._finish()
        self.tried += 1
        return change

    def _finish(self) -> None:
        self.done, self.busy, self.deferred = True, False, False
        if not self.tried and self.passed_over:
            self.not_applicable = "nothing to try on the DataLoader: " + "; ".join(self.passed_over)
        return None

    def _pass_over(self, reason: str) -> None:
        if reason not in self.passed_over:
            self.passed_over.append(reason)

    def _next(self, job: LiveJob, loader: DataLoader, recent: dict[str, Any]) -> Any:
        """The next move, None when the search is over, or _LATER."""
        settings = self.settings
        workers = settings["num_workers"]
        stalled = recent["stall_ratio"] >= STALL_TARGET
        if stalled and "num_workers" not in self.closed:
            count = self._workers_target(job, loader, recent)
            if count is _LATER:
                return _LATER
            if count is not None:
                return self._change(job, loader, "num_workers", num_workers=count)
        if job.on_cuda and torch.cuda.is_available() and not settings["pin_memory"] \
                and "pin_memory" not in self.closed:
            return self._change(job, loader, "pin_memory", pin_memory=True)
        if stalled and workers and "prefetch_factor" not in self.closed:
            prefetch = effective(settings)["prefetch_factor"]
            if prefetch < MAX_PREFETCH:
                return self._change(job, loader, "prefetch_factor", prefetch_factor=2 * prefetch)
            self._pass_over(f"prefetch_factor is at {prefetch}, the most tuneup tries")
        elif not stalled:
            self._pass_over(f"the stall is {recent['stall_ratio']:.0%} of step time now, under the "
                            f"{STALL_TARGET:.0%} where loading capacity is worth a trial")
        if workers and not settings["persistent_workers"] and "persistent_workers" not in self.closed:
            return self._persistent(job, loader)
        return None

    def _workers_target(self, job: LiveJob, loader: DataLoader, recent: dict[str, Any]) -> Any:
        """The worker count to try next: up while no count above was rejected, then the
        neighbour of a rejected one; down where going up found nothing (see the module
        docstring). None: nothing left to try; _LATER."""
        workers, most = self.settings["num_workers"], self.max_workers(job)
        above = [count for count in self.rejected if count > workers]
        ceiling = min(above + [most + 1]) - 1
        finding = job.finding("data-stall") or {}
        evidence = finding.get("evidence") or {}
        # The wait is the shipping (see below): more workers ship every batch still, so up is not tried.
        shipping = bool(workers and evidence.get("shipping_bound"))
        if not workers and evidence.get("cpu_bound") and not finding.get("gain") and not self.rejected:
            # data-stall: the job's own threads keep the cores busy, and a worker's making would
            # take its CPU from the step (augment_classifier.py on 2 cores: 0 -> 2 and 0 -> 1
            # measured 0.90x and 0.71x); the move it advises is to make samples cheaper. (Nothing
            # rejected yet: no move made, so 0 is the job's own count.)
            self.closed.add("num_workers")
            self.not_applicable = (f"num_workers stays 0: the job's own threads want "
                                   f"{evidence.get('job_cores', 0):.1f} of the {evidence.get('usable_cores')} "
                                   "usable cores, and workers would take the CPU they make batches with from the step")
            return None
        if workers < ceiling and not self.lowered and not shipping:
            refusal = self._why_no_workers(job, loader) if workers == 0 else None
            if refusal is _LATER:
                return _LATER
            if refusal is None:
                if above:
                    return min(ceiling, (workers + min(above)) // 2)  # between the current count and the rejected one
                return min(ceiling, self._workers_needed(recent, workers, most))
            self.closed.add("num_workers")
            if not self.job_settings["num_workers"]:  # the job's own 0, not one apply mode found faster
                self.not_applicable = f"num_workers stays 0: {refusal}"
            return None
        if self.raised:
            return None
        # Down: the usable cores first (fewer workers than the job's, not fewer than it can
        # run), then none at all (no batch crosses between processes: not a neighbour of one
        # worker, as the shipping it saves is there with any), then halfway to a rejected count.
        lowest = 1 if loader.worker_init_fn is not None else 0  # the job sets its workers up itself
        to_none = lowest == 0 and workers > 0 and 0 not in self.rejected
        if to_none and (evidence.get("suggested_workers") == 0 or shipping):
            # data-stall measured it: a batch costs less to make here than to ship from a
            # worker; or the wait is the shipping (batches were waiting in the queue, or it is
            # within the measured cost of receiving one): fewer workers ship every batch still,
            # only none takes that out of the step (8 workers on 2 cores went 8 -> 2, 0.90x,
            # before 8 -> 0, 1.77x: benchmarks/apply_scripts/many_workers.py)
            return 0
        if most < workers and most not in self.rejected and most >= lowest:
            return most
        if to_none:
            return 0
        floor = max([count for count in self.rejected if count < workers] + [lowest - 1]) + 1
        if workers <= floor:
            if workers >= most and not self.rejected:
                self._pass_over(f"num_workers is at {self.bound_said}" if workers else
                                "num_workers is 0 and no worker would fit")
            return None
        return max(floor, min(workers - 1, (workers + floor) // 2))  # halfway to the count rejected below

    def _why_no_workers(self, job: LiveJob, loader: DataLoader) -> Any:
        """Why the loader's work must stay in the main process (None: it may move), or _LATER."""
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        if method != "fork":
            return (f"worker processes would start with {method!r}, which imports the training script again in "
                    "each worker; add workers yourself, with the script's code under `if __name__ == \"__main__\":`")
        # A dataset whose attributes change while the job trains (the loop sets a curriculum's
        # `dataset.noise`, __getitem__ counts or caches): each worker holds the copy it forked,
        # so the batches would stop following the changes. Its attributes as first seen (wanted)
        # against now; first seen now, it is looked at again at the next proposal.
        step = job.timeline.ring.count
        if self.dataset_seen is None or self.dataset_seen[0] is not loader.dataset or self.dataset_seen[1] == step:
            self._see_dataset(job, loader)
            return _LATER
        _, seen_step, seen = self.dataset_seen
        now = _fingerprint(loader.dataset)
        if seen != now:
            before, after = {item[0]: item for item in seen}, {item[0]: item for item in now}
            changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
            return (f"the dataset's {', '.join(changed[:3])} changed while the job trained (steps {seen_step} to "
                    f"{step}): workers would each hold the copy they started with, and their batches would not "
                    "follow the changes; add workers yourself where the dataset reads what changes from shared state")
        draws = job.loaders.main_process_rng_draws
        if draws is None:
            return _LATER  # not checked on a fetch yet
        if draws and order_uses_global_rng(loader):
            return ("the dataset draws from torch's global RNG (random augmentation), and the loader shuffles "
                    "with that same RNG: in workers those draws would leave the main process and later epochs "
                    "would be shuffled differently. Give the DataLoader its own generator "
                    "(generator=torch.Generator().manual_seed(seed)) and tuneup can add workers")
        return None

    def _change(self, job: LiveJob, loader: DataLoader, knob: str, **values: Any) -> LoaderChange:
        after = effective(dict(self.settings, **values))
        return LoaderChange(self, job, loader, knob, self.settings, after)

    def _persistent(self, job: LiveJob, loader: DataLoader) -> Any:
        """Measured across epoch starts: the baseline's last epoch start paid the workers'
        start-up, the trial's (the second after the change) reuses them. Its trial waits for
        an epoch start and runs an epoch, so it goes last: other actions take their turn first."""
        try:
            epoch = len(loader)
        except TypeError:
            epoch = 0
        if not epoch or epoch > PERSISTENT_MAX_EPOCH or not hasattr(loader.dataset, "__dict__"):
            self.closed.add("persistent_workers")
            said = (self._start_up_said(job, loader, epoch) if epoch else
                    "persistent_workers: the loader's epoch length is unknown")
            if self.tried:  # a record of its own: the knobs tried have theirs (_finish says it where none was)
                self.not_applicable = said
            else:
                self._pass_over(said)
            return None
        if not self.deferred:
            self.deferred, self.busy = True, False  # the other actions' turn first
            return _LATER
        live = live_iterators(loader, job.loaders.iterators)
        if not live:
            return _LATER  # between epochs: the position in the epoch decides the windows
        change = self._change(job, loader, "persistent_workers", persistent_workers=True)
        # What it buys is one worker start-up per epoch, a cost in one step of the window:
        # kept unless it makes steps slower (it costs idle workers' memory, bounded above).
        change.keep = NOT_SLOWER
        change.cut_epoch_starts = False  # its windows are whole epochs, each with its start
        remaining = epoch - max(iterator._num_yielded for iterator in live)
        change.settle_steps = remaining + 2  # the first epoch after the change starts its workers
        change.window_steps = epoch * max(1, math.ceil(24 / epoch))
        return change

    @staticmethod
    def _start_up_said(job: LiveJob, loader: DataLoader, epoch: int) -> str:
        """Why persistent_workers is not tried on long epochs, with what it would save where an
        epoch start was seen: the data wait of the step the latest epoch began in (iter()'s
        worker start-up and the first fetch) over the median step's, against an epoch's time."""
        said = f"persistent_workers saves one worker start-up per epoch, which epochs of {epoch} steps make too rare to measure"
        ring = job.timeline.ring
        began = job.loaders.epoch_steps.get(id(loader))
        recent = ring.columns(max(1, ring.count - RECENT_START_UP + 1), ring.count)
        if began is None or began > ring.count or not ring.holds(began) or not recent["step_seconds"]:
            return said
        start_up = ring.columns(began, began)["data_wait_seconds"][0] - median(recent["data_wait_seconds"])
        epoch_seconds = epoch * sum(recent["step_seconds"]) / len(recent["step_seconds"])
        if start_up <= 0 or epoch_seconds <= 0:
            return said
        share = start_up / epoch_seconds
        return (f"{said}: the latest epoch's start cost {start_up * 1e3:.0f} ms beyond a step's wait, {share:.1%} of "
                f"an epoch ({epoch_seconds:.1f} s)" + (", worth setting yourself: DataLoader(..., persistent_workers=True)"
                                                      if share >= PERSISTENT_WORTH else ""))

    # --- sizing ------------------------------------------------------------------------

    @staticmethod
    def _workers_needed(recent: dict[str, Any], workers: int, most: int) -> int:
        step = recent["seconds"] / recent["steps"]
        wait = recent["data_wait_seconds"]["mean"]
        compute = max(step - wait, 1e-6)
        load = wait if workers == 0 else workers * step  # one batch's loading time
        needed = math.ceil(WORKER_MARGIN * load / compute)
        return min(most, max(workers + 1, needed))

    def max_workers(self, job: LiveJob) -> int:
        """At most the usable cores; more where data-stall measured the job's workers idle for
        most of their time (waiting on storage or a network: not CPU-bound) and advises more
        than the cores (sleeping workers need no core of their own: the demo's reads went
        from 2 workers on 2 cores to data-stall's 3 only by hand). Never over MAX_WORKERS, nor
        half the free RAM at the measured size of a worker."""
        host = job.system.get("host") or {}
        cores = int(host.get("usable_cores") or usable_cores())
        bound = min(cores, MAX_WORKERS)
        evidence = (job.finding("data-stall") or {}).get("evidence") or {}
        advised = evidence.get("advised_workers")
        self.bound_said = f"the {bound} usable cores"
        # (Not where its plan found fewer workers better, or the wait to be the shipping.)
        if (evidence.get("num_workers") and evidence.get("workers_cpu_bound") is False
                and "suggested_workers" not in evidence and not evidence.get("shipping_bound")
                and isinstance(advised, int) and advised > bound):
            bound = min(advised, MAX_WORKERS)
            self.bound_said = f"the {bound} data-stall advises for workers that wait on I/O"
        available = host.get("memory_available_bytes")
        measured = host.get("workers") or 0
        per_worker = (host.get("workers_rss_bytes") or 0) / measured if measured else host.get("rss_bytes")
        if available and per_worker:
            bound = min(bound, self.settings["num_workers"] + int(RAM_SHARE * available / per_worker))
        return bound

    def decided(self, change: Change, record: dict[str, Any]) -> None:
        assert isinstance(change, LoaderChange)
        self.busy = not self.deferred
        if record["decision"] == "kept":
            self.settings = dict(change.after)
            if change.knob == "num_workers":
                self.rejected.add(change.before["num_workers"])  # it lost to the new count
                self.raised = self.raised or change.after["num_workers"] > change.before["num_workers"]
                self.lowered = self.lowered or change.after["num_workers"] < change.before["num_workers"]
        elif change.knob == "num_workers":
            self.rejected.add(change.after["num_workers"])
        else:
            self.closed.add(change.knob)
        if self.failed:
            self._finish()
