"""The background drain: late device values reach the totals, and an overflowing ring is
accounted for exactly."""

from __future__ import annotations

import time

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


def test_a_drain_paces_the_detail_steps_by_the_median_step_and_their_cost(run_dir):
    """Each drain sets the automatic detail rate from its steps' median and a detail step's cost
    (StepTimeline.pace): a loop of sub-millisecond steps gets fewer detail steps than one in 4
    once past PACED_FROM_STEP, by DETAIL_COST at first (the early detail steps' cost is not
    the paced ones'), then by the cost measured on the paced steps of a later drain (their
    time and the next step's, over two plain steps': the loop's own timer agrees); detail_every
    set by the job is kept."""
    import math
    import statistics

    from tuneup.measure.hotpath import (DETAIL_BUDGET, DETAIL_COST, DETAIL_PERIOD, MAX_DETAIL_EVERY, MIN_PERIOD_EVERY,
                                        PACED_FROM_STEP)

    def paced(median, cost):
        most = min(MAX_DETAIL_EVERY, max(MIN_PERIOD_EVERY, int(DETAIL_PERIOD / median)))
        return max(4, min(most, math.ceil(cost / (DETAIL_BUDGET * median))))

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 64), torch.randn(8, 1)) for _ in range(8)]
    for chosen in (None, 4):
        with tuneup.attach(run_dir=run_dir / str(chosen), interval=60, detail_every=chosen) as agent:
            ends = []
            steps, step = PACED_FROM_STEP + 100 + 6000, 0
            while step < steps:  # at the paced rate, some 24 detail steps after the first drain
                x, y = data[step % 8]
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                ends.append(time.perf_counter())
                if step + 1 == PACED_FROM_STEP + 100:
                    interval = agent.recorder.drain()
                    first = (interval["step_seconds"]["median"], agent.recorder.timeline.detail_every,
                             agent.recorder.detail_cost)
                    steps = max(steps, step + 1 + 24 * first[1])
                step += 1
            ring = agent.recorder.timeline.ring
            later = ring.columns(PACED_FROM_STEP + 101, ring.count)
            detailed = dict(zip(later["step"], later["detailed"]))
            interval = agent.recorder.drain()
            median, every, cost = (interval["step_seconds"]["median"], agent.recorder.timeline.detail_every,
                                   agent.recorder.detail_cost)
        if chosen is None:
            assert first[2] is None and first[1] == paced(first[0], DETAIL_COST), first
            assert cost is not None and every == paced(median, cost), (median, cost, every)
            # The loop's own timer, from one optimizer.step's end to the next. Its iteration
            # boundaries are not tuneup's (a loop without a fetch: tuneup's step k closes as
            # iteration k + 1's update begins, after a detail step's gradient norm in that
            # update's pre-hook), so a detail step's cost is counted over the loop's
            # iterations around it: the one before, its own and the one after.
            own = {k: ends[k] - ends[k - 1] for k in detailed}
            steps = sorted(own)[1:-1]
            near = {k + shift for k in steps if detailed[k] for shift in (-1, 0, 1)}
            triples = [own[k - 1] + own[k] + own[k + 1] for k in steps if detailed[k] and not
                       (detailed[k - 1] or detailed[k + 1] or detailed.get(k - 2) or detailed.get(k + 2))]
            plain = [own[k] for k in steps if k not in near]
            by_the_loop = statistics.median(triples) - 3 * statistics.median(plain)
            spread = statistics.quantiles(plain, n=4)[2] - statistics.quantiles(plain, n=4)[0]
            # The two are medians of a few dozen detail steps each (tuneup's pairs, the loop's
            # triples), drawn from the same steps at different boundaries: each has a median's
            # standard error, ~0.93 IQR / sqrt(n) of its own draws (beside the suite's other
            # process a triple's IQR reached 0.2 ms, where 2 plain IQRs and 20% left 164 µs
            # and the two differed by 167 µs).
            quartiles = statistics.quantiles(triples, n=4)
            error = 0.93 * (quartiles[2] - quartiles[0]) / math.sqrt(len(triples))
            assert abs(cost - max(0.0, by_the_loop)) <= 2 * spread + 3 * error + 0.2 * abs(by_the_loop), (
                cost, by_the_loop, spread, error)
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
