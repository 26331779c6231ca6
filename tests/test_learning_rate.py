"""The learning rate as the job ran it: read on detail steps, whoever sets it."""

from __future__ import annotations

import math

import torch
from prometheus_client import generate_latest
from torch import nn

import tuneup

STEPS = 150
WARMUP, LR_MAX, LR_MIN = 20, 6e-4, 6e-5


def get_lr(it: int) -> float:
    """Warm-up then cosine decay, as GPT training scripts write it by hand."""
    if it < WARMUP:
        return LR_MAX * (it + 1) / WARMUP
    ratio = (it - WARMUP) / (STEPS - WARMUP)
    return LR_MIN + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR_MAX - LR_MIN)


def train(run_dir, decay_lr: bool):
    # A loop without a DataLoader (batches built in the loop) and without an LRScheduler:
    # when decay_lr, it writes every param group's lr itself at the top of each iteration.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR_MAX)
    data = torch.randn(1024, 17)
    set_rates = []
    with tuneup.attach(run_dir=run_dir, serve=False, detail_every=4) as agent:
        for it in range(STEPS):
            lr = get_lr(it) if decay_lr else LR_MAX
            for group in optimizer.param_groups:
                group["lr"] = lr
            set_rates.append(lr)
            rows = torch.randint(0, len(data), (32,))
            x, y = data[rows, :16], data[rows, 16:]
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    snapshot = agent.snapshot()  # after detach: the last step closed, the configuration read again
    metrics = generate_latest(agent.outputs.metrics).decode()
    return agent, snapshot, metrics, set_rates


def test_a_learning_rate_the_loop_sets_itself_is_a_schedule(run_dir):
    agent, snapshot, metrics, set_rates = train(run_dir, decay_lr=True)
    assert snapshot["totals"]["steps"] == STEPS
    [optimizer] = snapshot["config"]["optimizers"]
    assert optimizer["lr_scheduler"] is False  # no LRScheduler: the rate was measured
    measured = optimizer["lr_measured"]
    # Read after the update of each detail step (steps 1-5, then one drawn from each block of
    # 4: the ring's detail flags say which); step s updates with get_lr(s - 1), a different
    # value at every read.
    flags = agent.recorder.timeline.ring.columns(1, STEPS)["detailed"]
    detail_steps = [step for step, flag in enumerate(flags, 1) if flag]
    assert detail_steps[:5] == [1, 2, 3, 4, 5] and len(detail_steps) >= 5 + STEPS // 4 - 2
    assert measured["reads"] == len(detail_steps)
    assert measured["changes"] == len(detail_steps) - 1
    assert measured["first"] == get_lr(0) and measured["last"] == get_lr(detail_steps[-1] - 1)
    assert measured["max"] == max(get_lr(s - 1) for s in detail_steps)  # the highest rate a read saw
    assert measured["min"] == min(get_lr(s - 1) for s in detail_steps)
    assert "no-lr-schedule" not in {finding["rule"] for finding in agent.findings()}
    # The curve reaches the run log's end event; /metrics shows the current rate.
    end = [event for event in _events(agent) if event["event"] == "end"][-1]
    [curve] = end["learning_rates"]
    assert curve["optimizer"] == "AdamW" and len(curve["curve"]) == measured["changes"] + 1
    assert curve["curve"] == [[s, get_lr(s - 1)] for s in detail_steps]
    line = next(line for line in metrics.splitlines() if line.startswith("tuneup_learning_rate{"))
    assert 'optimizer="AdamW"' in line and float(line.rsplit(" ", 1)[1]) in set_rates


def test_a_constant_learning_rate_is_still_reported(run_dir):
    agent, snapshot, _, _ = train(run_dir, decay_lr=False)
    measured = snapshot["config"]["optimizers"][0]["lr_measured"]
    assert measured["changes"] == 0 and measured["min"] == measured["max"] == LR_MAX
    [finding] = [finding for finding in agent.findings() if finding["rule"] == "no-lr-schedule"]
    assert f"AdamW ran {STEPS} steps at a constant learning rate" in finding["observed"]


def _events(agent):
    import json

    return [json.loads(line) for line in open(agent.state.run_log, encoding="utf-8")]
