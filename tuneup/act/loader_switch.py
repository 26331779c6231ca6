"""Switch a live DataLoader iterator to other settings in the middle of an epoch, without
changing which samples come next or in what order.

A DataLoader's settings (num_workers, prefetch_factor, pin_memory) are fixed when its
iterator is made, once per epoch. To tune within a few hundred steps rather than a few
epochs, a `LoaderSwitch` takes over the live iterator's `_next_data` and serves its batches from a
chain of iterators ("sources"): the iterator itself first, then one built with the new
settings. The index sampler's iterator, the one that decides the epoch's order, is handed
from source to source: the old source stops taking indices and serves what it was already
given (its workers' outstanding batches, in order), the new one continues from the next
index. A source is built from a shallow copy of the loader whose sampler resumes the epoch
and whose generator is a private one: an iterator draws its workers' base seed from the
loader's generator (or the global RNG), and a source must draw nothing from the job's
random streams. (The sampler keeps its own generator: a shuffling sampler that has not
started yet draws its permutation exactly when it would have.) At the end of the epoch a
persistent source becomes the loader's persistent iterator, as the job's own would have.
Later epochs of a loader with tuneup's settings get iterators built the same way
(`epoch_iterator`), so everything below holds for them too.

Every index an iterator tuneup built takes is written on a `_Tape` until its batch is
served. When one with tuneup's settings fails (a worker that crashed, was killed or cannot
start, a dataset that breaks in a subprocess), the indices it had not served are fetched
again by a source with the job's own settings, in order, and the failure is reported: the
job sees the same batches, only later. A source with the job's own settings is the job's:
its errors are raised as they would be without tuneup.

Only map-style datasets are switched: each worker of an IterableDataset iterates its own
copy, so the worker count decides what data exists.
"""

from __future__ import annotations

import copy
import itertools
import random
import sys
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from ..measure.config import DEFAULT_PREFETCH_FACTOR as DEFAULT_PREFETCH, LOADER_KNOBS as KNOBS
from ..measure.device_values import raw_item
from ..measure.loader import loader_of

_ITERATORS = (_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter)

Settings = dict[str, Any]


def settings_of(loader: DataLoader) -> Settings:
    return {knob: getattr(loader, knob) for knob in KNOBS}


def set_settings(loader: DataLoader, settings: Settings) -> None:
    """Set the knobs for the loader's next iterator. Through __dict__: DataLoader refuses to
    have persistent_workers set after construction, and nothing else guards these."""
    vars(loader).update(settings)


def effective(settings: Settings) -> Settings:
    """Settings a multi-process iterator accepts (a loader made with num_workers=0 has no prefetch_factor)."""
    if settings["num_workers"] > 0 and not settings["prefetch_factor"]:
        return dict(settings, prefetch_factor=DEFAULT_PREFETCH)
    return settings


def needs_switch(old: Settings, new: Settings) -> bool:
    """Whether a live iterator must be rebuilt: persistence only matters at an epoch's end."""
    if old["num_workers"] != new["num_workers"] or bool(old["pin_memory"]) != bool(new["pin_memory"]):
        return True
    return new["num_workers"] > 0 and old["prefetch_factor"] != new["prefetch_factor"]


def why_not_switchable(loader: DataLoader) -> str | None:
    """Why a loader's live iterators cannot be switched safely, or None."""
    from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

    dataset = loader.dataset
    if isinstance(dataset, (IterDataPipe, MapDataPipe)):
        return "its dataset is a DataPipe, which shards itself across workers"
    if isinstance(dataset, IterableDataset):
        return ("its dataset is an IterableDataset: each worker iterates its own copy, so the number of "
                "workers decides what data the steps see")
    if getattr(loader, "in_order", True) is False:
        return "it was made with in_order=False: its batch order is not fixed to begin with"
    for cls in type(loader).__mro__:
        if cls is DataLoader:
            break
        if {"__iter__", "_get_iterator"} & set(vars(cls)):
            return f"{type(loader).__name__} builds its own iterators"
    return None


class _Tape:
    """One pass's index iterator, remembering what it handed out until it is served."""

    def __init__(self, indices: Iterator[Any]) -> None:
        self.indices = indices
        self.unserved: deque[Any] = deque()
        self.started = False

    def __iter__(self) -> "_Tape":
        return self

    def __next__(self) -> Any:
        self.started = True
        index = next(self.indices)
        self.unserved.append(index)
        return index


def persistent(settings: Settings) -> bool:
    return bool(settings["persistent_workers"]) and settings["num_workers"] > 0


_WORKER_SEEDS: "weakref.WeakKeyDictionary[DataLoader, torch.Generator]" = weakref.WeakKeyDictionary()


def worker_seeds(loader: DataLoader) -> torch.Generator:
    """The private generator the iterators tuneup builds for `loader` draw their workers'
    base seed from: one per loader, advancing with every iterator, so no two share a seed
    (random augmentation in workers must not repeat from epoch to epoch)."""
    generator = _WORKER_SEEDS.get(loader)
    if generator is None:
        generator = _WORKER_SEEDS[loader] = torch.Generator().manual_seed(
            (torch.initial_seed() ^ id(loader)) & ((1 << 63) - 1))
    return generator


def draw_seed(generator: torch.Generator | None) -> int:
    """A seed drawn as a DataLoader iterator draws its workers' base seed (from `generator`, or
    the global RNG), as a non-negative int64."""
    return int(raw_item(torch.empty((), dtype=torch.int64).random_(generator=generator))) & ((1 << 63) - 1)


class TapedSampler:
    """The loader's index sampler as the iterators tuneup builds see it.

    Every pass over it (every epoch, a persistent iterator's too) is taped; the first pass
    may continue an epoch already under way (`first`). A pass that starts afresh does what
    the job's own iterator would at that moment: it starts the sampler (an eager sampler
    draws its order now), then, where the job's settings would have built a new iterator
    (`job_draws`), draws the workers' base seed from the job's generator, whose value then
    seeds this iterator's workers."""

    def __init__(self, loader: DataLoader, job_settings: Settings, first: Iterator[Any] | None = None) -> None:
        self.sampler = loader._index_sampler
        self.job_generator = loader.generator
        self.job_draws = not persistent(job_settings)
        self.job_workers = job_settings["num_workers"]
        self.seeds = worker_seeds(loader)
        self.first = first
        self.tape: _Tape | None = None

    def __iter__(self) -> _Tape:
        if self.tape is not None and not self.tape.started:
            return self.tape  # asked twice before the pass began (a multi-process iterator's set-up)
        if self.first is not None:
            indices, self.first = self.first, None
        else:
            indices = iter(self.sampler)
            if self.job_draws:
                self.seeds.manual_seed(draw_seed(self.job_generator))
        self.tape = _Tape(indices)
        return self.tape

    def __len__(self) -> int:
        return len(self.sampler)


def tape_of(iterator: Any) -> _Tape | None:
    sampler = getattr(iterator, "_index_sampler", None)
    return sampler.tape if isinstance(sampler, TapedSampler) else None


# What _OwnStreams learnt of each dataset it wrapped a fetch of: {"fetches", "swapped": the names
# of the streams swapped around every fetch (torch's, and those the dataset was seen drawing from)}
_LEARNT: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


class _Stream:
    """One random stream a main-process dataset may draw from: how to read and set the job's
    (module-level) state, and the dataset's own state, seeded as a worker's is."""

    def __init__(self, name: str, get: Callable[[], Any], put: Callable[[Any], None], own: Any,
                 same: Callable[[Any, Any], bool]) -> None:
        self.name, self.get, self.put, self.own, self.same = name, get, put, own, same


class _OwnStreams:
    """The random streams a dataset loaded in the main process draws from, where the job's
    own settings load it in workers: its own, seeded as a worker's are (torch's
    `_worker_loop` seeds torch, `random` and numpy from the iterator's base seed), swapped in
    around a fetch, so the job's streams (dropout, its shuffling) move as they would have.

    torch's is swapped around every fetch (a state read and set: about 1 µs). Python's
    `random` and numpy's legacy global stream cost more (getstate/setstate 10 µs, numpy's
    get_state/set_state 60 µs: 128 µs a fetch in all, 5% of a 2.5 ms step): each is swapped
    and compared around the first WATCH_FETCHES fetches, and one the dataset drew from there is
    swapped around every fetch; one it never drew from is swapped and compared around every
    CHECK_EVERY-th fetch after that, and from the first such check that finds a draw, around
    every fetch. A dataset that draws from one of those two only after its first
    WATCH_FETCHES fetches, and not at a check, draws that many fetches' worth from the job's
    stream (as it would with num_workers=0 in the job) before it gets its own. What was learnt
    of a dataset (its fetches, the streams it draws from) lasts across its epochs' iterators
    (`_LEARNT`); each epoch's own streams are seeded afresh, as a worker's are."""

    WATCH_FETCHES = 32
    CHECK_EVERY = 16

    def __init__(self, seed: int, dataset: Any = None) -> None:
        try:
            self.learnt = _LEARNT.setdefault(dataset, {"fetches": 0, "swapped": {"torch"}})
        except Exception:  # no weak reference, unhashable, an __eq__ that raises: learnt for this iterator only
            self.learnt = {"fetches": 0, "swapped": {"torch"}}
        self.streams = [_Stream("torch", torch.get_rng_state, torch.set_rng_state,
                                torch.Generator().manual_seed(seed).get_state(), torch.equal),
                        _Stream("random", random.getstate, random.setstate, random.Random(seed).getstate(),
                                lambda a, b: a == b)]
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            self.streams.append(_Stream(
                "numpy", numpy.random.get_state, numpy.random.set_state,
                numpy.random.RandomState(seed % (1 << 32)).get_state(),
                lambda a, b: a[2:] == b[2:] and bool((a[1] == b[1]).all())))

    def around(self, fetch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        streams, learnt = self, self.learnt
        always = learnt["swapped"]

        def fetch_with_own_streams(index: Any) -> Any:
            count = learnt["fetches"] = learnt["fetches"] + 1
            checking = count <= streams.WATCH_FETCHES or count % streams.CHECK_EVERY == 0
            swapped = [(stream, stream.get()) for stream in streams.streams if checking or stream.name in always]
            for stream, _ in swapped:
                stream.put(stream.own)
            try:
                return fetch(index)
            finally:
                for stream, job in swapped:
                    own = stream.get()
                    if stream.name not in always and not stream.same(own, stream.own):
                        always.add(stream.name)  # the dataset draws from it: swapped from now on
                    stream.own = own
                    stream.put(job)

        return fetch_with_own_streams


def build_iterator(loader: DataLoader, settings: Settings, sampler: TapedSampler) -> Any:
    """An iterator of `loader` with `settings` reading its indices from `sampler`, built from
    a shallow copy of the loader whose generator (the workers' base seed) is the sampler's
    private one. In the main process where the job loads in workers, the dataset draws from
    streams of its own (`_OwnStreams`)."""
    proxy = copy.copy(loader)
    set_settings(proxy, effective(settings))
    vars(proxy)["batch_sampler" if loader.batch_sampler is not None else "sampler"] = sampler
    vars(proxy)["generator"] = sampler.seeds
    if settings["num_workers"] > sampler.job_workers:
        # More workers than the job's are apply mode's (past the cores only for workers that wait
        # on I/O, as data-stall advises): torch's warning that the count exceeds the CPUs
        # (DataLoader._get_iterator calls check_worker_number_rationality) would be a line in the
        # job's output about a setting it never made. The trial's record says what was set.
        vars(proxy)["check_worker_number_rationality"] = lambda: None
    iterator = proxy._get_iterator()
    if settings["num_workers"] == 0 and sampler.job_workers > 0:
        fetcher = iterator._dataset_fetcher
        fetcher.fetch = _OwnStreams(draw_seed(sampler.seeds), loader.dataset).around(fetcher.fetch)
    return iterator


def shut_down(iterator: Any) -> None:
    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()


@dataclass
class _Source:
    iterator: Any  # None: the live iterator itself (the switch's owner)
    settings: Settings
    own: bool  # the job's own settings: its errors are the job's


class LoaderSwitch:
    """Serves a live iterator's batches from a chain of sources (see the module docstring)."""

    def __init__(self, owner: Any, owner_settings: Settings, loader: DataLoader, job_settings: Settings,
                 on_failure: Callable[[BaseException], None], on_source: Callable[[Any], None]) -> None:
        self.owner = weakref.ref(owner)  # the owner holds the switch: no cycle back to it
        self.loader = weakref.ref(loader)
        self.job_settings = dict(job_settings)
        self.on_failure = on_failure
        self.on_source = on_source
        self.sources = [_Source(None, dict(owner_settings), own=owner_settings == self.job_settings)]
        self.pending: Settings | None = None
        self.detached_owner = False  # the owner was the loader's persistent iterator: stop its workers

    def switch(self, settings: Settings) -> None:
        """Serve from a source with `settings` from the next batch on."""
        self.pending = None if settings == self.sources[-1].settings else dict(settings)

    def next_data(self) -> Any:
        if self.pending is not None:
            settings, self.pending = self.pending, None
            self._switch(settings)
        while True:
            source = self.sources[0]
            iterator = self._iterator(source)
            try:
                data = type(iterator)._next_data(iterator)
            except StopIteration:
                if len(self.sources) == 1:
                    self._end_of_epoch(source)
                    raise
                self._retire(self.sources.pop(0))
                continue
            except Exception as exc:
                if source.own or tape_of(iterator) is None:
                    raise
                self._recover(exc)
                continue
            tape = tape_of(iterator)
            if tape is not None and tape.unserved:
                tape.unserved.popleft()
            return data

    def _iterator(self, source: _Source) -> Any:
        return source.iterator if source.iterator is not None else self.owner()

    def _switch(self, settings: Settings) -> None:
        loader = self.loader()
        iterator = self._iterator(self.sources[-1])
        if loader is None or iterator is None:
            return
        tape = tape_of(iterator)
        underlying = tape.indices if tape is not None else iterator._sampler_iter
        sampler = TapedSampler(loader, self.job_settings, first=underlying)
        try:
            source = build_iterator(loader, settings, sampler)
        except Exception as exc:
            # Nothing was served from it: the indices it took go back in front, in order.
            restored = itertools.chain(list(sampler.tape.unserved) if sampler.tape else [], underlying)
            if tape is not None:
                tape.indices = restored
            else:
                iterator._sampler_iter = restored
            self.on_failure(exc)
            return
        iterator._sampler_iter = iter(())  # it serves what it was given, then ends
        source._tuneup_built = True  # a source, not an iterator of the job's
        self.sources.append(_Source(source, dict(settings), own=settings == self.job_settings))
        self.on_source(source)

    def _end_of_epoch(self, source: _Source) -> None:
        """A persistent source with the loader's settings stays, as the loader's persistent
        iterator (with a switch of its own): the next epoch resets it instead of starting
        workers (and drawing a seed)."""
        loader = self.loader()
        iterator = source.iterator
        if (iterator is not None and loader is not None and loader._iterator is None
                and isinstance(iterator, _MultiProcessingDataLoaderIter) and not iterator._shutdown
                and source.settings["persistent_workers"] and source.settings == settings_of(loader)):
            del iterator._tuneup_built  # the job's iterator from now on
            loader._iterator = iterator
            switch_of(iterator, source.settings, loader, self.job_settings, self.on_failure, self.on_source)
            return
        self._retire(source)

    def _retire(self, source: _Source) -> None:
        if source.iterator is not None:
            shut_down(source.iterator)
        elif self.detached_owner:
            shut_down(self.owner())

    def _recover(self, exc: BaseException) -> None:
        """A source with tuneup's settings failed: fetch what it and the sources after it had
        not served with the job's own settings, in order."""
        loader = self.loader()
        tapes = [tape_of(self._iterator(source)) for source in self.sources]
        unserved = [index for tape in tapes if tape is not None for index in tape.unserved]
        underlying = tapes[-1].indices if tapes[-1] is not None else iter(())
        for source in self.sources:
            self._retire(source)
        owner = self.owner()
        if self.sources[0].iterator is None and owner is not None:
            shut_down(owner)  # an iterator tuneup built for this epoch, the one that failed
            if loader is not None and loader._iterator is owner:
                loader._iterator = None
        if loader is None:
            raise exc
        source = build_iterator(loader, self.job_settings,
                                TapedSampler(loader, self.job_settings, first=itertools.chain(unserved, underlying)))
        source._tuneup_built = True
        self.sources = [_Source(source, dict(self.job_settings), own=True)]
        self.on_source(source)
        self.on_failure(exc)


def epoch_iterator(loader: DataLoader, job_settings: Settings, on_failure: Callable[[BaseException], None],
                   on_source: Callable[[Any], None]) -> Any:
    """A new epoch's iterator for a loader running with tuneup's settings: taped and switched,
    so that a failure of its workers is recovered like a switched source's. It draws from
    the job's random streams what the job's own iterator would have (see TapedSampler)."""
    settings = settings_of(loader)
    iterator = build_iterator(loader, settings, TapedSampler(loader, job_settings))
    switch_of(iterator, settings, loader, job_settings, on_failure, on_source)
    return iterator


def live_iterators(loader: DataLoader, iterators: Any) -> list[Any]:
    """The job's iterators of `loader` that are in the middle of an epoch."""
    live = []
    for iterator in list(iterators):
        if getattr(iterator, "_tuneup_built", False) or not isinstance(iterator, _ITERATORS):
            continue
        if loader_of(iterator) is not loader:
            continue
        try:
            remaining = len(iterator) - iterator._num_yielded
        except TypeError:
            remaining = 1  # a sampler without a length: assume the epoch goes on
        if remaining > 0:
            live.append(iterator)
    return live


def switch_of(iterator: Any, settings: Settings, loader: DataLoader, job_settings: Settings,
             on_failure: Callable[[BaseException], None], on_source: Callable[[Any], None]) -> LoaderSwitch:
    """The iterator's switch, installed on first use; `settings`: what the iterator was built with."""
    switch = vars(iterator).get("_tuneup_switch")
    if switch is None:
        switch = LoaderSwitch(iterator, settings, loader, job_settings, on_failure, on_source)
        iterator._tuneup_switch = switch
        iterator._next_data = switch.next_data  # the instance attribute wins over the class's method
    return switch


def switch_loader(loader: DataLoader, settings: Settings, iterators: Any, job_settings: Settings,
                  on_failure: Callable[[BaseException], None], on_source: Callable[[Any], None]) -> None:
    """Give `loader` these settings: its next epoch is built with them, and its live
    iterators switch at their next batch."""
    old = settings_of(loader)
    set_settings(loader, settings)
    switching = needs_switch(old, settings)
    live = live_iterators(loader, iterators)
    switches = {id(iterator): switch_of(iterator, old, loader, job_settings, on_failure, on_source)
              for iterator in live} if switching else {}
    for switch in switches.values():
        switch.switch(settings)
    persistent = loader._iterator
    if persistent is not None and (switching or old["persistent_workers"] != settings["persistent_workers"]):
        loader._iterator = None  # built again with the new settings at the next epoch
        if id(persistent) in switches:
            switches[id(persistent)].detached_owner = True  # stopped once it has served what it holds
        elif persistent not in live:
            shut_down(persistent)
