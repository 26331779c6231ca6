"""amp-off's measured gain (measure/precision.py): the job's own model timed once, forward +
backward on its own batch, in fp32 and under bf16 autocast, between two steps, leaving the job
exactly as it was.

Ground truth, from the loop below: one model (a Sequential MLP with BatchNorm and Dropout)
trained in train() mode with autograd on, a batch of 64 rows of 64 features a step. Dropout
and a shuffling DataLoader draw from torch's random stream every step, and BatchNorm updates
its running statistics every training forward, so a trial that drew from the stream, ran a
forward the job could see, or reached its gradients would change the losses or the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tuneup
from tuneup.measure.precision import FROM_STEP


def mlp(width: int = 1024) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8), nn.Linear(8, 1))


def train(steps: int, options: dict | None = None, *, autocast: bool = False, compiled: bool = False, hook=None,
          width: int = 1024, model=None):
    """(losses, the model, the agent or None); `model`: a class to train instead of mlp(width)."""
    torch.manual_seed(0)
    net = model() if model is not None else mlp(width)
    if hook is not None:
        net.register_forward_hook(lambda module, args, output: hook(output.shape))
    trained = torch.compile(net, backend="eager") if compiled else net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = TensorDataset(torch.randn(1024, 64), torch.randn(1024, 1))
    loader = DataLoader(data, batch_size=64, shuffle=True, drop_last=True)
    agent = tuneup.attach(**options) if options is not None else None
    losses = []
    try:
        while len(losses) < steps:
            for x, y in loader:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = nn.functional.mse_loss(trained(x).float(), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if len(losses) == steps:
                    break
    finally:
        if agent is not None:
            agent.detach()
    return losses, net, agent


def options(run_dir, **extra):
    return dict(dict(run_dir=run_dir, port=0, interval=0.1, cpu_bf16=True), **extra)


def trial_of(agent):
    return (agent.snapshot().get("habits") or {}).get("amp_trial")


STEPS = FROM_STEP + 2 * 64 + 10  # past the first lifecycle close at or after FROM_STEP, and the one after


def test_the_model_is_timed_once_and_the_job_is_untouched(run_dir):
    plain, plain_net, _ = train(STEPS)
    seen = []
    losses, net, agent = train(STEPS, options(run_dir), hook=seen.append)
    assert losses == plain  # bit-identical: no draw from the job's random stream, no gradient of ours
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), plain_net.state_dict().values()))
    assert len(seen) == STEPS  # the job's own forward hook saw its forwards and no other
    trial = trial_of(agent)
    assert trial is not None and "skipped" not in trial, trial
    assert trial["device"] == "cpu" and trial["dtype"] == "bfloat16" and trial["model"] == "Sequential"
    assert trial["fp32_seconds"] > 0 and trial["reduced_seconds"] > 0 and trial["pairs"] >= 1
    assert trial["speedup"] == pytest.approx(trial["fp32_seconds"] / trial["reduced_seconds"])
    assert list(net._forward_pre_hooks.values()) == []  # its capture hook is gone
    assert agent.recorder.timeline.ring.count == STEPS  # and no step of its own was counted


class Queued(nn.Module):
    """A forward that keeps Python state in its attributes, as MoCo-style memory banks and
    running statistics do: a call counter, a mean kept as a plain tensor (reassigned) and one
    updated in place, and a queue of recent features that the output reads."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(64, 256), nn.ReLU()), nn.Linear(256, 1)
        self.mean, self.total, self.queue, self.calls = torch.zeros(256), torch.zeros(256), [], 0

    def forward(self, x):
        self.calls += 1
        h = self.body(x)
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * h.detach().mean(0)
            self.total += h.detach().sum(0)
            self.queue.append(h.detach().mean(0))
            self.queue = self.queue[-4:]
        return self.head(h - torch.stack(self.queue).mean(0) - self.mean)


def test_a_forward_that_keeps_state_in_its_attributes_finds_it_as_it_left_it(run_dir):
    plain, plain_net, _ = train(STEPS, model=Queued)
    losses, net, agent = train(STEPS, options(run_dir), model=Queued)
    trial = trial_of(agent)
    assert trial is not None and "skipped" not in trial and trial["pairs"] >= 1, trial  # its forwards ran
    assert net.calls == plain_net.calls == STEPS
    assert losses == plain  # bit-identical, the trial's forwards after the job's state included
    assert torch.equal(net.mean, plain_net.mean) and torch.equal(net.total, plain_net.total)
    assert len(net.queue) == 4 and all(torch.equal(a, b) for a, b in zip(net.queue, plain_net.queue))


class Chatty(nn.Module):
    """A model that prints what it is given, as a script being debugged does."""

    def __init__(self):
        super().__init__()
        self.net = mlp(256)

    def forward(self, x):
        print("forward", tuple(x.shape))
        return self.net(x)


def test_what_a_forward_prints_is_printed_as_often_as_the_job_runs_it(run_dir, capsys):
    """Ground truth: one line a step, STEPS steps. The precision trial runs the forward some 50
    times more, the FLOP count once: none of those prints reaches the job's stdout."""
    train(STEPS, model=Chatty)
    plain = capsys.readouterr().out
    _, _, agent = train(STEPS, options(run_dir), model=Chatty)
    tuned = capsys.readouterr().out
    trial = trial_of(agent)
    assert trial is not None and "skipped" not in trial and trial["pairs"] >= 1, trial  # its forwards ran
    assert agent.snapshot()["habits"]["flops"]["flops"] > 0  # and the count's
    assert plain == tuned and plain.count("forward (64, 64)") == STEPS


@pytest.mark.parametrize("case", ["autocast", "no bf16 units", "compiled"])
def test_never_timed_where_amp_off_cannot_fire(run_dir, case):
    """A job already under autocast, a CPU without bf16 units, a compiled model (a hook on it
    would recompile it): the trial never runs (for the compiled one, it says why)."""
    extra = {"cpu_bf16": False} if case == "no bf16 units" else {}
    # (Under autocast 128 wide: bf16 on a CPU without bf16 units runs the 1024-wide MLP's steps
    # over 10x slower, 43 s of the suite; what is looked at, whether the job is under autocast,
    # is the same.)
    _, _, agent = train(STEPS, options(run_dir, **extra), autocast=case == "autocast", compiled=case == "compiled",
                        width=128 if case == "autocast" else 1024)
    expected = {"skipped": "the model is compiled (its graphs run the step, not its forward)"} if case == "compiled" else None
    assert trial_of(agent) == expected


class Paced(nn.Module):
    """A model whose forward takes 5 ms in fp32; under autocast 2 ms, or 8 ms on the reduced
    passes listed in `slow` (counted from 1 after the warm-up pair's), by the trial's clock,
    which only the forward advances: which pass of a pair is faster is set by the model, not by
    the machine (sleeps were not: beside busy processes a 2 ms sleep woke after a 5 ms one)."""

    def __init__(self, slow: set[int]):
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.slow, self.reduced_calls = slow, -1  # the warm-up pair's reduced pass is call 0
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            self.reduced_calls += 1
            self.now += 0.008 if self.reduced_calls in self.slow else 0.002
        else:
            self.now += 0.005
        return self.linear(x)


@pytest.mark.parametrize("slow, pairs, faster", [
    (set(), 12, 12),  # clear in the first block: no more pairs
    ({2, 5, 8, 11}, 24, 20),  # 8 of 12: unclear, 12 more pairs settle it (20 of 24)
    ({1, 2, 3, 5, 6, 7, 9, 10, 11}, 12, 3),  # slower in most: clear the other way, no more pairs
])
def test_an_unclear_first_block_of_pairs_gets_a_second(slow, pairs, faster, monkeypatch):
    from types import SimpleNamespace

    from tuneup.measure import precision
    from tuneup.measure.hotpath import StepTimeline

    class Probe:
        on = True

    trial = precision.PrecisionTrial(StepTimeline(16, fail=lambda name, exc: None), Probe())
    model = Paced(slow)
    monkeypatch.setattr(precision, "time", SimpleNamespace(perf_counter=model.perf_counter))
    result = trial._time(model, ((torch.randn(2, 4),), {}), {"hardware": {"cpu_bf16": True}}, budget=10.0)
    assert (result["pairs"], result["faster_pairs"]) == (pairs, faster), result
