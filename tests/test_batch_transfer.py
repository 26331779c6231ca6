"""What shipping a batch from a DataLoader worker costs (measure/transfer.py) and how much of a
single-process fetch is CPU (measure/loader.py): the inputs of data-stall's predicted gain.

Ground truth, from the loop below: a map-style Dataset whose __getitem__ sleeps 0.5 ms (a file
read) and returns two tensors, 16 float32 features and a float32 target; the default collate
makes a batch of 32 of them: two tensors, 32 x 16 and 32 x 1 floats (2,176 bytes); num_workers=0,
so every batch is made in the training process, most of it asleep."""

from __future__ import annotations

import multiprocessing.resource_sharer
import os
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup
from tuneup.measure import transfer


class Files(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int):
        time.sleep(0.0005)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=generator), torch.randn(1, generator=generator)


def test_the_shipping_of_the_jobs_batch_is_measured_once_and_the_fetches_are_mostly_asleep(run_dir):
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Files(), batch_size=32, shuffle=True)
    own_cpu = own_wall = own_queued = 0.0
    fds = open_fds()
    with tuneup.attach(run_dir=run_dir, port=0, interval=0.1) as agent:
        for _ in range(3):
            iterator = iter(loader)
            while True:
                wall, cpu, queued = time.perf_counter(), time.thread_time(), run_queue_wait()
                try:
                    x, y = next(iterator)
                except StopIteration:
                    break
                own_cpu, own_wall = own_cpu + time.thread_time() - cpu, own_wall + time.perf_counter() - wall
                own_queued += run_queue_wait() - queued
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        habits = agent.snapshot()["habits"]
    assert open_fds() == fds  # the run-queue reads' file (and the run log's) closed at detach
    shipped = habits["batch_transfer"]
    assert (shipped["tensors"], shipped["bytes"]) == (2, 32 * 16 * 4 + 32 * 4)
    assert shipped["main_seconds"] > 0 and shipped["worker_seconds"] > 0 and shipped["reps"] == transfer.REPS
    fetched = habits["main_process_fetches"]
    assert fetched["timed"] >= 3
    # The loop's own measure of all its fetches: asleep most of the time, whatever the load.
    assert own_cpu / own_wall < 0.5 and fetched["cpu_share"] < 0.5
    # ... and how much of the rest it waited for a core (a busy machine's share): every one of
    # the 24 fetches is looked at (loader.py ready_schedule), so tuneup's split is the loop's.
    assert fetched["timed"] == 24 and fetched["core_wait_share"] is not None
    assert fetched["core_wait_share"] == pytest.approx(own_queued / own_wall, abs=0.1), (fetched, own_queued / own_wall)


def run_queue_wait() -> float:
    """This thread's run-queue wait so far (Linux: schedstat's second field, in ns)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_measuring_leaves_the_process_as_it_was():
    sharer = multiprocessing.resource_sharer._resource_sharer  # the one a job's own sharing uses
    listening, threads, fds = sharer._listener, threading.active_count(), open_fds()
    layout = transfer.layout({"ids": torch.zeros(8, 128, dtype=torch.long), "mask": torch.ones(8, 128),
                              "label": torch.zeros(8), "name": ["a"] * 8, "empty": torch.zeros(0)})
    assert layout == [((8, 128), torch.long), ((8, 128), torch.float32), ((8,), torch.float32),
                      ((0,), torch.float32)]
    shipped = transfer.measure(layout)
    assert shipped["tensors"] == 4 and shipped["bytes"] == 8 * 128 * 8 + 8 * 128 * 4 + 8 * 4
    assert sharer._listener is listening and threading.active_count() == threads and open_fds() == fds
    assert transfer.layout(["no", "tensors"]) is None


class Slow(Dataset):
    """A sample that takes `seconds` to read (a file, a decode)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        time.sleep(self.seconds)
        return torch.full((4,), float(index))


def ready_share(run_dir, sample_seconds: float, step_seconds: float, workers: int, epochs: int) -> dict:
    """Batches of 2; the loop's step is a sleep of `step_seconds`."""
    loader = DataLoader(Slow(sample_seconds), batch_size=2, num_workers=workers, persistent_workers=True)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, port=0, interval=0.1) as agent:
        for _ in range(epochs):
            for x in loader:
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                time.sleep(step_seconds)
        habits = agent.snapshot()["habits"]
    return dict(habits["worker_fetches"], transfer=habits.get("batch_transfer") or {"main_seconds": None})


def test_worker_fetches_tell_batches_made_ahead_from_batches_waited_for(run_dir):
    # Ground truth: cheap samples and a 40 ms step: two workers (4 batches in flight, a
    # millisecond of work each) are always ahead, a batch waits in the queue at every fetch past
    # an epoch's first. 50 ms samples (100 ms a batch) from one worker and a bare step: the loop
    # always asks before the next is made (two workers would hand over their batches in pairs,
    # the second of each waiting). Load only slows the workers: "behind" stays behind.
    ahead = ready_share(run_dir / "ahead", 0.0, 0.04, workers=2, epochs=2)
    behind = ready_share(run_dir / "behind", 0.05, 0.0, workers=1, epochs=1)
    assert ahead["checked"] >= 3 and ahead["ready_share"] == 1.0
    assert behind["checked"] >= 3 and behind["ready_share"] == 0.0
    # Ahead, the workers idle on the prefetch limit: at least 3 of the 4 batches asked for made
    # at each look (one may be a moment from its queue); behind, none.
    assert ahead["queue_fill"] >= 0.75 and behind["queue_fill"] == 0.0, (ahead, behind)
    # The fetches that found none waited out the making: 100 ms a batch against a bare step,
    # half of it at least (load only slows the worker); where every fetch found one, nothing.
    assert ahead["unready_wait_seconds"] is None
    assert behind["unready_wait_seconds"] >= 0.05, behind


def test_workers_that_hand_over_in_pairs_are_told_behind_by_their_wait(run_dir):
    """Ground truth: two workers of 100 ms batches (50 ms samples) started together, a bare step:
    they deliver together, so a fetch may find the other's batch waiting while the loop still
    waits out the making on the rest. What the fetches that found none waited says behind: the
    making on at least every other one (a fetch may also find its batch a moment from arriving),
    so a mean of 25 ms at least, many times what shipping a batch of 2 costs (measured here:
    data-stall reads a wait within 1.5x of it as the shipping)."""
    from tuneup.diagnose.rules.input import SHIPPING_BOUND

    pairs = ready_share(run_dir, 0.05, 0.0, workers=2, epochs=1)
    assert pairs["checked"] >= 3 and pairs["ready_share"] < 1.0, pairs
    # Of the 4 batches asked for, at most the other worker's is made when the loop asks: the
    # queue is never more than a quarter full, short of what data-stall reads as idling ahead.
    from tuneup.diagnose.rules.input import QUEUE_FULL

    assert pairs["queue_fill"] <= 0.25 < QUEUE_FULL, pairs
    assert pairs["unready_wait_seconds"] >= 0.025, pairs
    shipping = pairs["transfer"]["main_seconds"]
    assert pairs["unready_wait_seconds"] > 5 * SHIPPING_BOUND * shipping, pairs
