"""DataLoader tuning: a runtime AUTOTUNE for PyTorch's input pipeline.

Started by a data stall (or, on CUDA, pageable copies), it climbs one knob at a time, each
move an experiment of its own, on the loader the training loop is reading:

1. num_workers, while the stall is above STALL_TARGET: the next count is estimated from the
   measured split (a batch takes about `wait` to load in-process, or `workers x step` with
   workers; one must be ready every `step - wait`), then verified by the trial;
2. pin_memory=True on a CUDA job;
3. persistent_workers=True when epochs are short enough to put an epoch start in each
   window (otherwise its gain, one worker start-up per epoch, is not measurable); kept
   unless slower, as its gain sits in one step per epoch, below what a block test resolves;
4. prefetch_factor doubled, while the stall stays (bursty loads).

A rejected move closes its knob. Bounds: no more workers than usable cores (affinity and
cgroup quota), and no more than half the free RAM at the measured size of a worker (the
main process's until a worker was measured). Changes land mid-epoch through a relay (see
`act/handover.py`): the sequence of samples the model sees does not change, and the global
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
import weakref
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

from ..._patching import PatchSet
from ...measure.host import usable_cores
from ...measure.loader import loader_of
from ..action import FASTER, NOT_SLOWER, Action, Change, Job
from ..handover import (KNOBS, Settings, effective, epoch_iterator, live_iterators, settings_of, shut_down,
                        switch_loader, why_not_switchable)

STALL_TARGET = 0.05  # below this share of step time, more loading capacity is not worth a trial
MAX_WORKERS = 32
MAX_PREFETCH = 8
WORKER_MARGIN = 1.25  # workers estimated from the split, plus this much for jitter
RAM_SHARE = 0.5  # workers may take at most this share of the free RAM
PERSISTENT_MAX_EPOCH = 600  # steps: longer epochs put no epoch start in a trial window
_LATER = object()  # a move that must wait for a better moment (the next epoch to start)


def _fingerprint(dataset: Any) -> tuple:
    """The dataset's attributes as bound now (identity, and value for plain scalars)."""
    state = getattr(dataset, "__dict__", {})
    return tuple(sorted((name, id(value), value if isinstance(value, (int, float, str, bool)) else None)
                        for name, value in state.items()))


class _EpochStarts:
    """How each epoch of the loader being tuned starts, while its settings are tuneup's.

    `DataLoader._get_iterator`: a new epoch's iterator is built by tuneup (`epoch_iterator`),
    so a failure of its workers is recovered with the job's own settings, as mid-epoch.
    Both hooks draw from the job's random streams exactly what the job's own settings would
    have drawn: a new iterator draws its workers' base seed, a persistent one that is reset
    draws none. Where tuneup made the loader persistent, a reset draws the seed the job's
    new iterator would have (and a dataset whose attributes were reassigned gets fresh
    workers: the old ones hold the old dataset); where the job's loader was persistent but
    its iterator is rebuilt, nothing is drawn, as the job's reset would have drawn nothing."""

    def __init__(self) -> None:
        self.loaders: dict[int, tuple[weakref.ref, Settings]] = {}
        self.fingerprints: dict[int, tuple] = {}
        self.patches = PatchSet()
        self.on_failure: Callable[[BaseException], None] = lambda exc: None
        self.on_source: Callable[[Any], None] = lambda iterator: None

    def watch(self, loader: DataLoader, job_settings: Settings, on_failure: Callable[[BaseException], None],
              on_source: Callable[[Any], None]) -> None:
        if not self.loaders:
            self.patches.replace(DataLoader, "__iter__", self._wrap_iter)
            self.patches.replace(DataLoader, "_get_iterator", self._wrap_get_iterator)
        self.loaders[id(loader)] = (weakref.ref(loader), dict(job_settings))
        self.fingerprints[id(loader)] = _fingerprint(loader.dataset)
        self.on_failure, self.on_source = on_failure, on_source

    def forget(self, loader: DataLoader) -> None:
        self.loaders.pop(id(loader), None)
        self.fingerprints.pop(id(loader), None)
        if not self.loaders:
            self.patches.undo_all()

    def _job_settings(self, loader: DataLoader) -> Settings | None:
        entry = self.loaders.get(id(loader))
        return entry[1] if entry is not None and entry[0]() is loader else None

    def _wrap_iter(self, original):
        starts = self

        @functools.wraps(original)
        def __iter__(loader):
            job = starts._job_settings(loader)
            if (job is not None and not _persistent(job) and _persistent(settings_of(loader))
                    and loader._iterator is not None):  # tuneup's persistent iterator, about to be reset
                fingerprint = _fingerprint(loader.dataset)
                if fingerprint != starts.fingerprints.get(id(loader)):
                    starts.fingerprints[id(loader)] = fingerprint
                    stale, loader._iterator = loader._iterator, None
                    shut_down(stale)  # a new iterator below: it draws, as the job's would
                else:
                    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
            return original(loader)

        return __iter__

    def _wrap_get_iterator(self, original):
        starts = self

        @functools.wraps(original)
        def _get_iterator(loader):
            job = starts._job_settings(loader)
            if job is None or settings_of(loader) == job:
                return original(loader)  # the job's own settings: built as the job builds it
            if not _persistent(job):  # the job would have built a new iterator, drawing its seed first
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
            return epoch_iterator(loader, job, starts.on_failure, starts.on_source)

        return _get_iterator


def _persistent(settings: Settings) -> bool:
    return bool(settings["persistent_workers"]) and settings["num_workers"] > 0


class LoaderChange(Change):
    action = "dataloader"
    keep = FASTER
    affects_numerics = False

    def __init__(self, tuning: "DataLoaderTuning", job: Job, loader: DataLoader, knob: str,
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
        # New workers start and fill their queues first.
        self.settle_steps = max(5, 2 + after["num_workers"] * (after["prefetch_factor"] or 0))

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
    summary = ("num_workers (sized from the measured split, at most the usable cores and half the free RAM), "
               "then pin_memory (CUDA), persistent_workers (short epochs; kept unless slower) and "
               "prefetch_factor; switched mid-epoch with the same batches in the same order; the other "
               "moves kept only when faster.")

    def __init__(self) -> None:
        super().__init__()
        self.target: weakref.ref | None = None
        self.job_settings: Settings = {}
        self.settings: Settings = {}
        self.closed: set[str] = set()  # knobs whose last move was rejected
        self.failed = False
        self.epoch_starts = _EpochStarts()
        self.in_effect: list[LoaderChange] = []

    def now_in_effect(self, change: LoaderChange, loader: DataLoader) -> None:
        """The epoch-start hooks live while any change is in effect."""
        if not self.in_effect:
            self.epoch_starts.watch(loader, self.job_settings, self.source_failed, change.job.loaders.iterators.add)
        self.in_effect.append(change)

    def no_longer_in_effect(self, change: LoaderChange, loader: DataLoader) -> None:
        self.in_effect = [known for known in self.in_effect if known is not change]
        if not self.in_effect:
            self.epoch_starts.forget(loader)

    def source_failed(self, exc: BaseException) -> None:
        """A source with tuneup's settings failed (the relay already fetches with the job's
        own): every change in effect goes, and the climb ends."""
        self.failed = True
        reason = (f"the loader failed with tuneup's settings ({_one_line(exc)}); the batches it had not "
                  "delivered were fetched again, in order, with the job's own settings")
        for change in self.in_effect:
            if change.rollback_reason is None:
                change.rollback_reason = reason

    # --- which loader -------------------------------------------------------------------

    @staticmethod
    def _reading(job: Job) -> DataLoader | None:
        """The loader whose live iterator has served the most batches: the training loop's."""
        best, served = None, -1
        for iterator in list(job.loaders.iterators):
            loader = loader_of(iterator)
            if loader is not None and iterator._num_yielded > served and iterator in live_iterators(
                    loader, job.loaders.iterators):
                best, served = loader, iterator._num_yielded
        return best

    def propose(self, job: Job, recent: dict[str, Any] | None) -> Change | None:
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
        return change if change is not None else self._finish()

    def _finish(self) -> None:
        self.done, self.busy = True, False
        return None

    def _next(self, job: Job, loader: DataLoader, recent: dict[str, Any]) -> Any:
        """The next move, None when the climb is over, or _LATER."""
        settings = self.settings
        workers = settings["num_workers"]
        stalled = recent["stall_ratio"] >= STALL_TARGET
        if stalled and "num_workers" not in self.closed and workers < self.max_workers(job):
            count = self._workers_needed(recent, workers, self.max_workers(job))
            return self._change(job, loader, "num_workers", num_workers=count)
        if job.on_cuda and torch.cuda.is_available() and not settings["pin_memory"] \
                and "pin_memory" not in self.closed:
            return self._change(job, loader, "pin_memory", pin_memory=True)
        if workers and not settings["persistent_workers"] and "persistent_workers" not in self.closed:
            return self._persistent(job, loader)
        if stalled and workers and "prefetch_factor" not in self.closed:
            prefetch = effective(settings)["prefetch_factor"]
            if prefetch < MAX_PREFETCH:
                return self._change(job, loader, "prefetch_factor", prefetch_factor=2 * prefetch)
        return None

    def _change(self, job: Job, loader: DataLoader, knob: str, **values: Any) -> LoaderChange:
        after = effective(dict(self.settings, **values))
        return LoaderChange(self, job, loader, knob, self.settings, after)

    def _persistent(self, job: Job, loader: DataLoader) -> Any:
        """Measured across epoch starts: the baseline's last epoch start paid the workers'
        start-up, the trial's (the second after the change) reuses them."""
        try:
            epoch = len(loader)
        except TypeError:
            epoch = 0
        if not epoch or epoch > PERSISTENT_MAX_EPOCH or not hasattr(loader.dataset, "__dict__"):
            self.closed.add("persistent_workers")
            return None
        live = live_iterators(loader, job.loaders.iterators)
        if not live:
            return _LATER  # between epochs: the position in the epoch decides the windows
        change = self._change(job, loader, "persistent_workers", persistent_workers=True)
        # What it buys is one worker start-up per epoch, a cost in one step of the window:
        # kept unless it makes steps slower (it costs idle workers' memory, bounded above).
        change.keep = NOT_SLOWER
        remaining = epoch - max(iterator._num_yielded for iterator in live)
        change.settle_steps = remaining + 2  # the first epoch after the change starts its workers
        change.window_steps = epoch * max(1, math.ceil(24 / epoch))
        return change

    # --- sizing ------------------------------------------------------------------------

    @staticmethod
    def _workers_needed(recent: dict[str, Any], workers: int, most: int) -> int:
        step = recent["seconds"] / recent["steps"]
        wait = recent["data_wait_seconds"]["mean"]
        compute = max(step - wait, 1e-6)
        load = wait if workers == 0 else workers * step  # one batch's loading time
        needed = math.ceil(WORKER_MARGIN * load / compute)
        return min(most, max(workers + 1, needed))

    def max_workers(self, job: Job) -> int:
        host = job.system.get("host") or {}
        cores = int(host.get("usable_cores") or usable_cores())
        bound = min(cores, MAX_WORKERS)
        available = host.get("memory_available_bytes")
        measured = host.get("workers") or 0
        per_worker = (host.get("workers_rss_bytes") or 0) / measured if measured else host.get("rss_bytes")
        if available and per_worker:
            bound = min(bound, self.settings["num_workers"] + int(RAM_SHARE * available / per_worker))
        return bound

    def decided(self, change: Change, record: dict[str, Any]) -> None:
        assert isinstance(change, LoaderChange)
        if record["decision"] == "kept":
            self.settings = dict(change.after)
        else:
            self.closed.add(change.knob)
        if self.failed:
            self._finish()
