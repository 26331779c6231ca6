"""DataLoader probe: time blocked in `next(iterator)` (hotpath.py: loader_next) and in
`iter(loader)`, batch sizes.

Patched at class level (DataLoader.__iter__ and the base iterator's __next__) so loaders
created after attach() are measured too. With explicit objects, only the iterators of the
loaders given are measured: __iter__ tags them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from time import perf_counter, thread_time
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .._patching import PatchSet, unwind
from .habits import HabitsProbe
from .host import ThreadRunQueue
from .hotpath import TAG, StepTimeline, loader_next

RNG_CHECKS = (12, 40, 120, 400)  # fetches on which the global RNG is compared around the fetch


def ready_schedule(fetch: int) -> int:
    """The fetch after `fetch` on which a worker iterator's queue is looked at: each one to the
    64th (data-stall reads the share early: apply mode's first trial starts near step 50), every
    7th to the 512th, then every 101st (the share is the run's: later looks add little, and each
    costs the hot path some 150 operations). The strides are prime, never a multiple of the
    worker count, which torch hands batches out to in turn: every second fetch of two workers
    that deliver in pairs looks at the same one of each pair. Four looks at the inspected
    fetches alone read 4 of 4 ready beside busy processes, where each second fetch waited
    40-60 ms for the making (tests/test_apply.py: the I/O-bound workers)."""
    return fetch + (1 if fetch < 64 else 7 if fetch < 512 else 101)


def batch_size(batch: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor; len() of a list of samples."""
    for _ in range(4):
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, (list, tuple)):
            if not batch:
                return 0
            first = batch[0]
            if isinstance(first, (torch.Tensor, list, tuple)) or isinstance(batch, tuple):
                batch = first
                continue
            return len(batch)  # a list of samples (dicts, strings, ...)
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
            continue
        return 0
    return 0


def remember_loader(iterator: Any, loader: DataLoader) -> None:
    """Let an iterator lead back to its loader (apply mode rebuilds iterators from it): for
    the epoch, so `for batch in DataLoader(...)` keeps its loader while it runs. A persistent
    iterator, which its loader holds, gets a weak reference: no cycle."""
    if loader._iterator is iterator:
        iterator._tuneup_loader = weakref.ref(loader)
    else:
        iterator._tuneup_loader = lambda: loader


def loader_of(iterator: Any) -> DataLoader | None:
    find = getattr(iterator, "_tuneup_loader", None)
    return find() if find is not None else None


class LoaderProbe:
    name = "dataloader"
    clock = staticmethod(perf_counter)
    batch_size = staticmethod(batch_size)  # batches the hot path's fast case does not cover

    def __init__(self, timeline: StepTimeline, tracked: weakref.WeakSet | None, habits: HabitsProbe) -> None:
        # `every`: on, and every loader measured (the hot path's one test where both hold).
        self._on, self._tracked, self.every = True, tracked, tracked is None
        self.habits = habits  # inspects a few batches (pinned? shapes? normalized?)
        self.timeline = timeline
        self.tracked = tracked  # None: every loader
        self.loaders: weakref.WeakSet[DataLoader] = weakref.WeakSet()  # seen, for the config probe
        # ... those an evaluation phase fetched from (evaluation_fetch): the configuration lists
        # them apart, and apply mode leaves them alone.
        self.evaluation_loaders: weakref.WeakSet[DataLoader] = weakref.WeakSet()
        timeline.evaluation_fetched = self.evaluation_fetch
        self.iterators: weakref.WeakSet[_BaseDataLoaderIter] = weakref.WeakSet()  # for worker pids
        self.worker_starts = 0  # iterators with workers started (for their CPU time: host.py WorkerTime)
        # Whether the dataset (or collate_fn) draws from torch's global RNG when it runs in the
        # main process: checked on a few fetches of single-process iterators (apply mode must
        # know before it moves that work into worker processes).
        self.rng_check_at = RNG_CHECKS[0]
        self.main_process_rng_draws: bool | None = None
        # The hot path's one test for both and for the ready looks below: the fetch count
        # (before the fetch) at which one of them wants to see a fetch.
        self.next_look = 0
        # Fetches of single-process iterators among those looked at: their wall, this thread's
        # CPU and its run-queue wait (Linux): how much of making a batch is CPU, how much
        # waiting for a core (other processes hold them), and the rest, asleep on storage,
        # the network or a sleep (which workers overlap however busy the cores are).
        self._looked: tuple[float, float, float | None] | None = None
        self.fetch_wall = self.fetch_thread_cpu = self.fetch_core_wait = 0.0
        self.fetches_timed = 0
        self.core_wait_known = True  # on every fetch timed
        self.run_queue = ThreadRunQueue()
        # Fetches of worker iterators past their start looked at: how many found a batch already
        # waiting in the data queue (made ahead: the wait, if any, is receiving it).
        self.ready_checked = self.ready_found = 0
        # ... and how full the queue was: workers ahead of the loop idle on the prefetch limit
        # with nearly all their batches made; workers that just keep up hand over each as it
        # is made (a batch or two waiting of the prefetch_factor x workers asked for).
        self.queue_fill = 0.0
        self.ready_look_at = ready_schedule(0)  # the next fetch (its number) looked at for that
        # ... and how long those that found none waited: a moment where the next batch was in
        # transit, a worker's whole making where the workers fall behind. Workers started
        # together finish together: with two of them each second fetch finds the other's batch
        # waiting (a ready share of one half) while the first waits out the making (70 ms).
        self.unready_wait = 0.0
        self.unready_checked = 0
        # the looked fetch's start, the batches waiting and the queue's fill, until its batch comes
        self._ready_look: tuple[float, int, float] | None = None
        # Per loader (id), the step its latest epoch began in: that step's data wait holds
        # iter() (worker start-up) and the epoch's first fetch (apply mode's persistent_workers).
        self.epoch_steps: dict[int, int] = {}
        # Per loader (id), the job's own settings where apply mode has others in effect
        # (act/actions/dataloader.py sets them on the loader for its next iterators): the
        # configuration marks the knobs that differ as tuneup's, with the job's values.
        self.job_own: dict[int, dict[str, Any]] = {}
        self.settings_changes = 0  # apply mode's setting changes so far: the configuration is read again after each

    def focus(self, loaders: weakref.WeakSet) -> None:
        """Measure only these loaders from now on, their iterators already running included
        (a framework may start iterating before it tells us which loaders train)."""
        for iterator in list(self.iterators):
            if loader_of(iterator) in loaders:
                try:
                    setattr(iterator, TAG, True)
                except Exception:
                    pass
        self.tracked = loaders

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = value
        self.every = value and self._tracked is None

    @property
    def tracked(self) -> weakref.WeakSet | None:
        return self._tracked

    @tracked.setter
    def tracked(self, loaders: weakref.WeakSet | None) -> None:
        self._tracked = loaders
        self.every = self._on and loaders is None

    def install(self, patches: PatchSet) -> None:
        probe = self
        tl = self.timeline

        def wrap_iter(original):
            @functools.wraps(original)
            def __iter__(loader):
                if not probe.on or (probe.tracked is not None and loader not in probe.tracked):
                    try:
                        return original(loader)
                    except BaseException as exc:
                        unwind(exc)  # the job's own traceback (_patching.py)
                        raise
                began = perf_counter()
                tl.in_loader = True
                try:
                    iterator = original(loader)
                except BaseException as exc:  # a worker that cannot start, a sampler's error
                    unwind(exc)
                    raise
                finally:
                    tl.in_loader = False
                    try:
                        tl.iter_ended(tl.waited(began, perf_counter()))
                        probe.loaders.add(loader)
                        probe.epoch_steps[id(loader)] = tl.ring.count + 1
                        tl.ring.put("epoch_starts", tl.ring.count + 1, 1.0, add=True)
                    except Exception as exc:
                        probe.fail(exc)
                try:
                    probe.iterators.add(iterator)
                    if getattr(iterator, "_num_workers", 0):
                        probe.worker_starts += 1
                    remember_loader(iterator, loader)
                    if probe.tracked is not None:
                        setattr(iterator, TAG, True)
                except Exception:
                    pass  # an iterator type we cannot tag: measured in auto mode only
                return iterator

            return __iter__

        patches.replace(DataLoader, "__iter__", wrap_iter)
        patches.replace(_BaseDataLoaderIter, "__next__", lambda original: loader_next(self, original))  # hotpath.py

    def evaluation_fetch(self, iterator: Any) -> None:
        """A batch fetched while an evaluation phase was open (after its first forward) and taken
        by an evaluation forward (StepTimeline.evaluation_batch): its loader is an evaluation's."""
        loader = loader_of(iterator)
        if loader is not None:
            self.evaluation_loaders.add(loader)

    def look_before(self, iterator: Any) -> torch.Tensor | None:
        """Ahead of a fetch the RNG check or the habits probe wants to see: the global RNG
        state, where this fetch is an RNG check."""
        workers = getattr(iterator, "_num_workers", 1)
        if not workers:
            self._looked = (perf_counter(), thread_time(), self.run_queue.waited())
        elif getattr(iterator, "_num_yielded", 0) >= workers and not self._after_own_work():
            try:  # multiprocessing.Queue.qsize: its semaphore's count (Linux); queue.Queue's too
                queued = iterator._data_queue.qsize()
            except Exception:  # NotImplementedError on macOS
                queued = None
            if queued is not None:
                # Of the batches asked for and not yet received (torch keeps prefetch_factor x
                # workers of them asked for: dataloader.py, _try_put_index), those made.
                asked = getattr(iterator, "_tasks_outstanding", 0) or 1
                self._ready_look = (perf_counter(), queued, min(1.0, queued / asked))
        return self.rng_before(iterator) if self.timeline.fetches >= self.rng_check_at else None

    def _after_own_work(self) -> bool:
        """Whether tuneup's own listeners took time at the close since the last fetch (a
        one-off measurement): the workers had that time to get ahead, so a batch waiting now
        says nothing of the job's own pace (a loop always behind its one worker read 1 in 7
        ready beside busy processes)."""
        ring = self.timeline.ring
        return ring.side("own_seconds", ring.count + 1) > 0.0

    def fetch_looked(self, iterator: Any, original: Callable[[Any], Any]) -> Any:
        """A fetch the RNG check or the habits probe wants to see (the hot path's `next_look`):
        `original(iterator)` with the looks before and after it, inside its wait."""
        rng = self.look_before(iterator)
        try:
            batch = original(iterator)
        except BaseException as exc:  # the end of an epoch (StopIteration), a Dataset's error
            self._looked = self._ready_look = None  # no batch: nothing to time
            unwind(exc)  # the job's own traceback, without this frame (_patching.py)
            raise
        self.look_after(rng, batch)
        return batch

    def look_after(self, rng: torch.Tensor | None, batch: Any) -> None:
        """After that fetch (before it is counted): the RNG compared, the batch inspected where due."""
        if self._looked is not None:
            wall, cpu, queued = self._looked
            self._looked = None
            self.fetch_thread_cpu += thread_time() - cpu
            self.fetch_wall += perf_counter() - wall
            self.fetches_timed += 1
            queued_now = self.run_queue.waited() if queued is not None else None
            if queued_now is None:
                self.core_wait_known = False
            else:
                self.fetch_core_wait += queued_now - queued
        if self._ready_look is not None:  # counted once a batch came (not an epoch's end)
            began, queued, fill = self._ready_look
            self._ready_look = None
            self.ready_checked += 1
            self.ready_found += queued > 0
            self.queue_fill += fill
            if not queued:
                self.unready_wait += perf_counter() - began
                self.unready_checked += 1
        if rng is not None:
            self.rng_after(rng)
        habits, fetch = self.habits, self.timeline.fetches + 1  # (counted after the look)
        if fetch >= habits.next_inspect:
            habits.inspect(batch, fetch)
        if fetch >= self.ready_look_at:
            self.ready_look_at = ready_schedule(fetch)
        self.next_look = min(self.rng_check_at, habits.next_inspect - 1, self.ready_look_at - 1)

    def close(self) -> None:
        """Close the run-queue reads' file (detach; in a forked child, the parent thread's)."""
        self.run_queue.close()

    def fetch_cpu(self) -> dict[str, Any] | None:
        """The single-process fetches looked at: how many, the share of their time this thread
        spent on the CPU, and the share it waited for one (None: not known, off Linux); the
        rest it slept (on files, the network, a sleep)."""
        if not self.fetches_timed or self.fetch_wall <= 0.0:
            return None
        cpu = min(1.0, self.fetch_thread_cpu / self.fetch_wall)
        return {"timed": self.fetches_timed, "seconds": self.fetch_wall, "cpu_share": cpu,
                "core_wait_share": min(1.0 - cpu, self.fetch_core_wait / self.fetch_wall)
                if self.core_wait_known else None}

    def ready_batches(self) -> dict[str, Any] | None:
        """The worker iterators' fetches looked at, the share that found a batch waiting, and the
        mean wait of those that found none."""
        if not self.ready_checked:
            return None
        return {"checked": self.ready_checked, "ready_share": self.ready_found / self.ready_checked,
                "queue_fill": self.queue_fill / self.ready_checked,
                "unready_wait_seconds": self.unready_wait / self.unready_checked if self.unready_checked else None}

    def rng_before(self, iterator: Any) -> torch.Tensor | None:
        """On a checked fetch: the global RNG state, when this fetch runs the dataset in the
        main process (not an epoch's first, where a shuffling sampler draws its order)."""
        done = self.rng_check_at
        self.rng_check_at = next((at for at in RNG_CHECKS if at > done), 1 << 62)
        if getattr(iterator, "_num_workers", 1) or not getattr(iterator, "_num_yielded", 0):
            return None
        return torch.default_generator.get_state()

    def rng_after(self, before: torch.Tensor) -> None:
        drew = not torch.equal(before, torch.default_generator.get_state())
        self.main_process_rng_draws = bool(self.main_process_rng_draws) or drew

    def worker_pids(self) -> list[int]:
        pids = []
        for iterator in list(self.iterators):
            if getattr(iterator, "_shutdown", False):  # its workers are gone or going (a switched-out iterator)
                continue
            for worker in getattr(iterator, "_workers", ()):
                if worker.pid is not None:  # psutil skips the ones that have exited
                    pids.append(worker.pid)
        return pids

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.in_loader = False
        self.timeline.fail(self.name, exc)
