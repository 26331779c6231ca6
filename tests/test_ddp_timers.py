"""DDP's all-reduce wait from DDP's own timers (measure/ddp.py), on a real DistributedDataParallel
model in this process (gloo, world size 1: the timers run as in any job; the wait between
ranks is tests/test_distributed.py's, with two real ranks)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import tuneup
from tuneup.measure.ddp import EARLY_ITERATIONS, FIRST_ITERATION, STEADY_SAMPLES, AllReduceWait

FORWARD_SLEEP = 0.004  # seconds each forward sleeps: DDP's forward time must read at least this


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x):
        time.sleep(FORWARD_SLEEP)
        return self.layer(x)


def train(model, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_the_timers_of_sampled_iterations_in_seconds_from_the_third(one_rank):
    # Ground truth: DDP times iterations 1-10 (then every 100th); each forward sleeps 4 ms.
    model = nn.parallel.DistributedDataParallel(Slow())
    wait = AllReduceWait()
    assert wait.sample([model]) == {"iterations_sampled": 0}  # nothing sampled before the first step
    train(model, 2)
    assert wait.sample([model])["iterations_sampled"] == 0  # iterations 1-2 are left out
    seen = set()
    for _ in range(10):
        train(model, 1)
        summary = wait.sample([model])
        seen.add(summary.get("last_iteration"))
    assert min(i for i in seen if i is not None) >= FIRST_ITERATION
    # Iterations 3..10 were sampled (DDP records iteration N at the N+1st forward).
    assert summary["iterations_sampled"] == 10 - FIRST_ITERATION + 1
    assert FORWARD_SLEEP <= summary["forward_seconds"] < 1.0
    assert 0 <= summary["allreduce_wait_seconds"] <= summary["allreduce_seconds"] < 1.0
    assert wait.sample([nn.Linear(2, 2)]) is None  # no DDP model: no figures at all


class Timed:
    """A stand-in DDP model's logging data: only `_get_ddp_logging_data` is read (as the real one's)."""

    def __init__(self) -> None:
        self.data: dict = {}

    def _get_ddp_logging_data(self) -> dict:
        return self.data


def test_the_median_leaves_the_first_ten_iterations_once_the_steady_state_has_samples(monkeypatch):
    # Ground truth: iterations 3-10 wait 20 ms (start-up), every 100th after 2 ms.
    model = Timed()
    monkeypatch.setattr("tuneup.measure.ddp.is_ddp", lambda m: m is model)
    wait = AllReduceWait()

    def sampled(iteration, wait_ms):
        model.data = {"iteration": iteration, "backward_comm_time": int((wait_ms + 1) * 1e6),
                      "backward_compute_comm_overlap_time": int(1e6)}
        return wait.sample([model])

    for iteration in range(FIRST_ITERATION, EARLY_ITERATIONS + 1):
        summary = sampled(iteration, 20)
    assert summary["allreduce_wait_seconds"] == pytest.approx(0.020)
    for k in range(1, STEADY_SAMPLES + 1):
        summary = sampled(100 * k, 2)
        # Until STEADY_SAMPLES are in, the start-up's eight samples still hold the figure.
        assert summary["allreduce_wait_seconds"] == pytest.approx(0.002 if k == STEADY_SAMPLES else 0.020)
        assert summary["steady"] is (k == STEADY_SAMPLES)


def test_the_wait_is_the_one_a_rank_has_at_nearly_every_iteration(monkeypatch):
    # Ground truth: a rank that waits for a straggler waits at every iteration (15 ms and more);
    # one on a crowded host waits at some iterations only, when the other rank was held back:
    # 0.3 ms at most iterations, 9 ms at a third of them. Its lower quartile is its usual
    # 0.3 ms; its median of 6 iterations would read 4.65 ms.
    model = Timed()
    monkeypatch.setattr("tuneup.measure.ddp.is_ddp", lambda m: m is model)

    def summary(waits_ms):
        wait = AllReduceWait()
        for k, wait_ms in enumerate(waits_ms, start=1):
            model.data = {"iteration": 100 * k, "backward_comm_time": int((wait_ms + 1) * 1e6),
                          "backward_compute_comm_overlap_time": int(1e6)}
            out = wait.sample([model])
        return out["allreduce_wait_seconds"]

    assert summary([0.3, 9, 0.3, 9, 0.3, 0.3]) == pytest.approx(0.0003)
    assert summary([15, 16, 15.5, 30, 15.2, 15]) == pytest.approx(0.015)  # (sorted: the 2nd of 6)
    assert summary([4, 2, 3]) == pytest.approx(0.002)  # up to four: the smallest


def test_an_attached_ddp_job_reports_its_wait_in_the_system_sample(one_rank, run_dir):
    model = nn.parallel.DistributedDataParallel(Slow())
    agent = tuneup.attach(model, interval=0.05, run_dir=str(run_dir))
    try:
        train(model, 30)
        ddp = agent.snapshot()["system"]["ddp"]
    finally:
        agent.detach()
    assert ddp["iterations_sampled"] >= 1 and ddp["forward_seconds"] >= FORWARD_SLEEP
    assert agent.snapshot()["probes"]["ddp"] == "on"
