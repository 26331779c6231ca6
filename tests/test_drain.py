"""The background drain: late device values reach the totals, and an overflowing ring is
accounted for exactly."""

from __future__ import annotations

import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tuneup.measure import recorder as recorder_module


class EventNotYetDone:
    """Stands in for a torch.cuda.Event (no GPU here): query() says whether it completed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_steps_with_device_values_in_flight_wait_for_them(run_dir):
    """A GradScaler found-inf flag copied from the GPU arrives steps after its step closed:
    the totals must still count that skip (the GPU runs a few steps behind the CPU)."""
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = loader_for(SlowDataset(size=4096), batch_size=8)
    with tuneup.attach(run_dir=run_dir, interval=60) as agent:
        train(loader, model, optimizer, steps=5)
        # A device read for step 5, still in flight: exactly what DeviceValues queues on CUDA.
        values = agent.recorder.values
        values._host = torch.zeros(values.capacity)
        event = EventNotYetDone()
        values._pending.append((0, event, lambda found: agent.recorder.scaler._resolved(found > 0, 5), 5))
        values.pending = 1
        values._host[0] = 1.0  # the flag: inf found
        train(loader, model, optimizer, steps=10)
        agent.ticker.tick()
        assert agent.recorder._drained == 4  # steps from 5 on wait for the value
        event.done = True
        agent.recorder.values.poll()
        agent.ticker.tick()
        assert agent.recorder._drained >= 14
    totals = agent.snapshot()["totals"]
    assert totals["skipped_steps"] == 1
    assert totals["steps"] == 15


def test_steps_lost_to_a_full_ring_are_counted(run_dir, monkeypatch):
    monkeypatch.setattr(recorder_module, "RING_CAPACITY", 64)
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, interval=60) as agent:  # no background read meanwhile
        train(loader_for(SlowDataset(size=4096), batch_size=8), model, optimizer, steps=200)
    totals = agent.snapshot()["totals"]
    assert totals["steps"] + totals["dropped_steps"] == 200
    assert totals["steps"] == 63  # the ring's capacity, less the record the first one needs


def test_steps_a_snapshot_drains_reach_the_history_and_the_run_log(run_dir):
    """snapshot() drains the closed steps; they must reach the history and the run log like
    the background thread's drains (they used to count in the totals only)."""
    import json

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, interval=60) as agent:  # no background drain while it trains
        train(loader_for(SlowDataset(size=512)), model, optimizer, steps=20)
        assert agent.snapshot()["totals"]["steps"] == 19  # the 20th step is still open
        assert agent.state.history.steps == 19
        train(loader_for(SlowDataset(size=512)), model, optimizer, steps=10)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    logged = [event for event in events if event["event"] == "steps"]
    assert sum(event["steps"] for event in logged) == 30 == agent.snapshot()["totals"]["steps"]
    assert [(e["first_step"], e["last_step"]) for e in logged][0] == (1, 19)


def test_a_drain_paces_the_detail_steps_by_the_median_step(run_dir):
    """Each drain sets the automatic detail rate from its steps' median (StepTimeline.pace): a
    loop of sub-millisecond steps gets fewer detail steps than one in 4 once past
    PACED_FROM_STEP; detail_every set by the job is kept."""
    import math

    from tuneup.measure.hotpath import DETAIL_SPACING, MAX_DETAIL_EVERY

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 64), torch.randn(8, 1)) for _ in range(8)]
    for chosen in (None, 4):
        with tuneup.attach(run_dir=run_dir / str(chosen), interval=60, detail_every=chosen) as agent:
            for step in range(1100):
                x, y = data[step % 8]
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            interval = agent.recorder.drain()
            median = interval["step_seconds"]["median"]
            every = agent.recorder.timeline.detail_every
        if chosen is None:
            assert every == max(4, min(MAX_DETAIL_EVERY, math.ceil(DETAIL_SPACING / median))), (median, every)
        else:
            assert every == 4


def test_tuneup_s_own_work_at_a_close_is_neither_the_loops_wait_nor_its_step(run_dir):
    """Ground truth: a loop of cheap steps fetching from a DataLoader of in-memory tensors, its
    own timer around iter() and next() and around the whole loop, and a listener of tuneup's taking 50 ms
    at one close (as a precision trial does between two steps): the loop's timers see it in one
    fetch; tuneup's data wait and step times leave it out, and count it as its own. (Bounds, not
    a fetch's size: on a busy machine any fetch may take tens of ms.)"""
    import time

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = loader_for(SlowDataset(size=4096, latency=0.0), batch_size=8)
    waits = []
    with tuneup.attach(run_dir=run_dir, interval=60, detail_every=1) as agent:
        agent.recorder.timeline.add_listener("slow", lambda step: time.sleep(0.05) if step == 30 else None)
        started = time.perf_counter()
        iterator = iter(loader)  # waiting on data too (tuneup counts it: hotpath.StepTimeline.waited)
        waits.append(time.perf_counter() - started)
        for _ in range(60):
            began = time.perf_counter()
            x, y = next(iterator)
            waits.append(time.perf_counter() - began)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        elapsed = time.perf_counter() - started
    snapshot = agent.snapshot()  # after detach: the last step closed at its optimizer step
    assert max(waits) >= 0.05  # the premise: the loop's timer saw the 50 ms in a fetch
    totals = snapshot["totals"]
    assert totals["steps"] == 60
    assert totals["tuneup_seconds"] >= 0.05
    # tuneup's waits are inside the loop's timed fetches, less its own 50 ms; its steps inside the loop's time.
    assert totals["data_wait_seconds"] <= sum(waits) - 0.05 + 1e-6
    assert totals["seconds"] <= elapsed - 0.05 + 1e-6
