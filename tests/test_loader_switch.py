"""Switching a live DataLoader iterator to other settings mid-epoch: the same samples in the
same order, the job's random streams untouched, worker failures re-fetched in order."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from tuneup.act.loader_switch import settings_of, switch_loader, why_not_switchable
from tuneup.measure.loader import remember_loader


class Indexed(Dataset):
    """Sample i is the tensor [i]: a batch says exactly which samples it holds."""

    def __init__(self, size: int = 96, fail_in_workers_from: int | None = None) -> None:
        self.size = size
        self.fail_in_workers_from = fail_in_workers_from

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.fail_in_workers_from is not None and index >= self.fail_in_workers_from \
                and get_worker_info() is not None:
            raise RuntimeError("this dataset cannot be read in a worker process")
        return torch.tensor([index])


def epochs_of(loader: DataLoader, epochs: int, switches: dict[tuple[int, int], dict] | None = None,
              failures: list | None = None) -> tuple[list[list[int]], torch.Tensor]:
    """The index batches of `epochs` epochs, switching settings before the (epoch, batch)
    keys of `switches`; then a draw from the global RNG (did anything else draw from it?)."""
    torch.manual_seed(123)
    job = settings_of(loader)
    live: weakref.WeakSet = weakref.WeakSet()
    seen = []
    for epoch in range(epochs):
        iterator = iter(loader)
        remember_loader(iterator, loader)  # as the agent's DataLoader probe does
        live.add(iterator)
        batch_number = 0
        while True:
            change = (switches or {}).get((epoch, batch_number))
            if change is not None:
                switch_loader(loader, dict(settings_of(loader), **change), live, job,
                              on_failure=(failures if failures is not None else []).append, on_source=lambda s: None)
            try:
                batch = next(iterator)
            except StopIteration:
                break
            seen.append(batch.flatten().tolist())
            batch_number += 1
    return seen, torch.rand(4)


def test_switching_workers_mid_epoch_keeps_every_batch_and_the_order():
    plain, plain_rng = epochs_of(DataLoader(Indexed(), batch_size=4, shuffle=True), epochs=3)
    switches = {(0, 3): {"num_workers": 2, "prefetch_factor": 2},
                (0, 9): {"num_workers": 1, "prefetch_factor": 4},
                (1, 5): {"num_workers": 0, "prefetch_factor": None},
                (2, 0): {"num_workers": 2, "prefetch_factor": 2},
                (2, 20): {"num_workers": 2, "prefetch_factor": 4}}
    tuned, tuned_rng = epochs_of(DataLoader(Indexed(), batch_size=4, shuffle=True), epochs=3, switches=switches)
    assert tuned == plain
    assert sorted(sum(plain[:24], [])) == list(range(96))  # a real shuffled epoch
    assert torch.equal(tuned_rng, plain_rng)  # building workers drew nothing from the job's RNG


def test_the_next_epoch_is_built_with_the_new_settings():
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
    epochs_of(loader, epochs=1, switches={(0, 2): {"num_workers": 2, "prefetch_factor": 2}})
    assert loader.num_workers == 2
    assert type(iter(loader)).__name__ == "_MultiProcessingDataLoaderIter"


def test_a_persistent_loader_switches_and_its_old_workers_stop():
    def make():
        return DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)

    plain, _ = epochs_of(make(), epochs=2)
    loader = make()
    job = settings_of(loader)
    torch.manual_seed(123)
    iterator = iter(loader)
    remember_loader(iterator, loader)
    old_workers = list(iterator._workers)
    tuned = [next(iterator).flatten().tolist() for _ in range(4)]
    switch_loader(loader, dict(job, num_workers=2), weakref.WeakSet([iterator]), job, [].append, lambda s: None)
    tuned += [batch.flatten().tolist() for batch in iterator]
    tuned += [batch.flatten().tolist() for batch in loader]
    assert tuned == plain
    assert loader._iterator is not None and loader._iterator._num_workers == 2
    for worker in old_workers:
        worker.join(timeout=5)
        assert not worker.is_alive()


def test_a_failing_worker_source_is_refetched_in_order_with_the_jobs_settings():
    plain, _ = epochs_of(DataLoader(Indexed(), batch_size=4, shuffle=True), epochs=1)
    failures: list = []
    tuned, _ = epochs_of(DataLoader(Indexed(fail_in_workers_from=0), batch_size=4, shuffle=True), epochs=1,
                         switches={(0, 5): {"num_workers": 2, "prefetch_factor": 2}}, failures=failures)
    assert tuned == plain
    assert len(failures) == 1 and "cannot be read in a worker" in str(failures[0])


def test_an_error_with_the_jobs_own_settings_is_the_jobs():
    class Broken(Indexed):
        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 50:
                raise ValueError("corrupt sample 50")
            return super().__getitem__(index)

    loader = DataLoader(Broken(), batch_size=4)
    with pytest.raises(ValueError, match="corrupt sample 50"):
        epochs_of(loader, epochs=1, switches={(0, 2): {"num_workers": 2, "prefetch_factor": 2},
                                              (0, 6): {"num_workers": 0, "prefetch_factor": None}})


def test_iterable_datasets_and_unordered_loaders_are_not_switched():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    assert "IterableDataset" in why_not_switchable(DataLoader(Stream()))
    assert "in_order=False" in why_not_switchable(DataLoader(Indexed(), num_workers=1, in_order=False))
    assert why_not_switchable(DataLoader(Indexed(), batch_size=4, shuffle=True)) is None


# --- a main-process dataset's own random streams (_OwnStreams) --------------------------------

class Augmenting(Indexed):
    """Draws from Python's `random` and numpy's global stream per sample, as albumentations-style
    augmentation does; the draws ride along in the sample."""

    def __getitem__(self, index: int) -> torch.Tensor:
        import numpy
        import random

        return torch.tensor([index, random.random(), numpy.random.rand()], dtype=torch.float64)


def test_a_main_process_dataset_drawing_from_random_and_numpy_leaves_the_jobs_streams_as_workers_would():
    """Ground truth from the code: with two workers, each worker's `random` and numpy streams are
    its own (torch's _worker_loop seeds them), so the job's own streams do not move however
    many samples are drawn. Switched to the main process mid-epoch, the dataset draws from
    streams of its own: the job's next draws from `random` and numpy are what they are without
    the switch, after 97 main-process fetches (past the watched ones)."""
    import numpy
    import random

    def job_draws(switches):
        random.seed(7)
        numpy.random.seed(7)
        loader = DataLoader(Augmenting(size=400), batch_size=4, shuffle=True, num_workers=2)
        seen, _ = epochs_of(loader, epochs=1, switches=switches)  # (later epochs: the agent's epoch_iterator)
        return [batch[0::3] for batch in seen], (random.random(), numpy.random.rand())

    plain_order, plain_draws = job_draws(None)
    order, draws = job_draws({(0, 3): {"num_workers": 0, "prefetch_factor": None}})
    assert order == plain_order  # (the indices; every sample's draws ride along)
    assert draws == plain_draws


def test_a_stream_the_dataset_starts_drawing_from_late_is_its_own_from_the_next_check():
    """Ground truth: a fetch that draws one number from `random` from its 40th call on (after
    the WATCH_FETCHES watched fetches, where it drew nothing). The check at fetch 48 (every
    CHECK_EVERY-th) finds it drawing: fetches 40-47 drew from the job's stream (8 numbers), and
    none after."""
    import random

    from tuneup.act.loader_switch import _OwnStreams

    assert _OwnStreams.WATCH_FETCHES == 32 and _OwnStreams.CHECK_EVERY == 16
    calls = []

    def fetch(index):
        calls.append(index)
        return random.random() if len(calls) >= 40 else None

    random.seed(11)
    wrapped = _OwnStreams(5).around(fetch)
    for index in range(100):
        wrapped(index)
    after = random.random()
    random.seed(11)
    for _ in range(8):
        random.random()
    assert after == random.random()


def test_the_host_probe_samples_only_the_workers_of_iterators_still_running(tmp_path):
    """An iterator switched out (or shut down by the job) keeps its `_workers` list; its
    processes are exiting or gone. The host probe's worker count is the live iterator's: a
    400-step apply run once reported "5 loader workers" with 2 in effect."""
    import tuneup

    loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2)
    with tuneup.attach(run_dir=tmp_path / "run", port=0) as agent:
        old = iter(loader)
        next(old)
        old_pids = [worker.pid for worker in old._workers]
        old._shutdown_workers()
        new = iter(loader)
        next(new)
        pids = agent.recorder.loader.worker_pids()
        assert sorted(pids) == sorted(worker.pid for worker in new._workers), (pids, old_pids)
        del new
