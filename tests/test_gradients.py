"""The gradient norm the updates use (measure/gradients.py) and the no-grad-clipping rule that
reads it: judged on gradients, never on a loss that sits near zero or changes sign.

Ground truth comes from each loop itself: it computes the total gradient norm of every step
just before optimizer.step() (torch.nn.utils.get_total_norm, the figure clip_grad_norm_
returns), so tuneup's sampled norms are checked against the loop's own, step for step."""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tuneup
from tuneup.measure import gradients
from tuneup.measure.terms import SPIKE_FACTOR


def norm_of(parameters) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None]))


def regression(steps: int, bad_every: int = 0, bad_from: int = 0, attach: dict | None = None):
    """An MLP regression fed by a shuffling DataLoader and plain SGD, as the tutorials write
    it; from step `bad_from` on, the batch of every step one past a multiple of `bad_every`
    has targets 5x too large (a corrupt record). Returns (losses, norms by step, the model,
    the agent)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2048, 16)
    data = TensorDataset(x, x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    agent = tuneup.attach(**attach) if attach is not None else None
    losses, norms, step = [], {}, 0
    try:
        while step < steps:
            for inputs, targets in loader:
                step += 1
                if bad_every and step >= bad_from and step % bad_every == 1:
                    targets = targets * 5
                loss = nn.functional.mse_loss(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                norms[step] = norm_of(model.parameters())
                optimizer.step()
                losses.append(loss.item())
                if step == steps:
                    break
    finally:
        if agent is not None:
            agent.detach()
    return losses, norms, model, agent


def attach_options(run_dir, **extra):
    return dict(dict(run_dir=run_dir, port=0, interval=0.1, cpu_bf16=False), **extra)


def habits(agent):
    return agent.snapshot()["habits"]


def spikes_in(sampled: list[tuple[int, float]]) -> list[tuple[float, int]]:
    """(ratio, step) of each norm over SPIKE_FACTOR x the median of the 8 before it (4 at least)
    and at least a tenth of the largest before it."""
    out = []
    for i in range(4, len(sampled)):
        before = statistics.median(value for _, value in sampled[max(0, i - 8):i])
        floor = 0.1 * max(value for _, value in sampled[:i])
        if sampled[i][1] > SPIKE_FACTOR * before and sampled[i][1] >= floor:
            out.append((sampled[i][1] / before, sampled[i][0]))
    return out


def test_a_corrupt_batch_is_a_gradient_spike_at_its_step_with_the_loops_own_norm(run_dir, monkeypatch):
    # Every step a detail step and no pacing by cost (however busy the machine): a norm every
    # MIN_EVERY (4) steps from step 1, so on steps 1, 5, 9, ...; the corrupt batches (201, 241,
    # ... 561) are among them.
    monkeypatch.setattr(gradients, "BUDGET", float("inf"))
    losses, norms, _, agent = regression(600, bad_every=40, bad_from=200, attach=attach_options(run_dir, detail_every=1))
    # Ground truth, from the loop's own norms on those steps: a spike at every corrupt batch
    # (its norm 50-90x the median before it, here) and none before step 200.
    sampled = [(step, norms[step]) for step in sorted(norms) if step % gradients.MIN_EVERY == 1]
    truth = spikes_in(sampled)
    assert {step for _, step in truth} == set(range(201, 600, 40))  # the premise
    found = habits(agent)["grad_norms"]
    assert found["samples"] == len(sampled) and found["spikes"] == len(truth)
    ratio, step = max(truth)
    assert found["largest_step"] == step
    assert found["largest_norm"] == pytest.approx(norms[step], rel=1e-6)  # the loop's figure, not an estimate
    assert found["largest_ratio"] == pytest.approx(ratio, rel=1e-6)
    finding = {f["rule"]: f for f in agent.findings()}["no-grad-clipping"]
    assert finding["evidence"]["largest_step"] == step and finding["evidence"]["spikes"] == len(truth)
    assert "clip_grad_norm_(model.parameters(), max_norm=" in finding["fix"]
    # The norms change nothing: the same losses and weights as without tuneup.
    plain_losses, _, plain_model, _ = regression(600, bad_every=40, bad_from=200)
    _, _, model, _ = regression(600, bad_every=40, bad_from=200,
                                attach=attach_options(run_dir.parent / "again", detail_every=1))
    assert plain_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(plain_model.state_dict().values(), model.state_dict().values()))


def reinforce(episodes: int, attach: dict | None = None):
    """REINFORCE on a contextual bandit, as the policy-gradient examples write it: a softmax
    policy, 4 samples an episode, returns normalized per episode, Adam. The loss is
    -(log-prob x normalized advantage).mean(): it sits near zero and changes sign."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    payoff = torch.randn(8, 4)
    agent = tuneup.attach(**attach) if attach is not None else None
    losses, norms = [], []
    try:
        for _ in range(episodes):
            states = torch.randn(4, 8)
            distribution = torch.distributions.Categorical(logits=policy(states))
            actions = distribution.sample()
            rewards = (states @ payoff).gather(1, actions[:, None]).squeeze(1) + 0.5 * torch.randn(4)
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
            loss = -(distribution.log_prob(actions) * advantages).mean()
            optimizer.zero_grad()
            loss.backward()
            norms.append(norm_of(policy.parameters()))
            optimizer.step()
            losses.append(loss.item())
    finally:
        if agent is not None:
            agent.detach()
    return losses, norms, agent


def leap(values: list[float], history: int = 8) -> float:
    """The largest size of a value over the median size of the `history` before it."""
    return max(abs(values[i]) / statistics.median(abs(v) for v in values[i - history:i])
               for i in range(history, len(values)))


def test_a_policy_gradient_loss_that_changes_sign_is_no_spike(run_dir, monkeypatch):
    monkeypatch.setattr(gradients, "BUDGET", float("inf"))  # a norm every 4 steps, however busy the machine
    losses, norms, agent = reinforce(300, attach=attach_options(run_dir, detail_every=1))
    # The premises, from the loop's own figures: the loss changes sign and leaps over 10x its
    # recent size; the gradient norm never does (under 10x the median of the 8 steps before).
    assert min(losses) < 0 < max(losses) and leap(losses) > SPIKE_FACTOR
    assert leap(norms) < SPIKE_FACTOR
    found = habits(agent)["grad_norms"]
    assert found["samples"] >= 8 and found["spikes"] == 0 and found["nonfinite"] == 0
    assert "no-grad-clipping" not in {f["rule"] for f in agent.findings()}


def test_a_hand_written_update_has_its_norms_read_after_the_backward(run_dir, monkeypatch):
    monkeypatch.setattr(gradients, "BUDGET", float("inf"))
    # Ground truth: no optimizer; `p -= lr * p.grad` under no_grad, then the gradients are cleared.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    own = {}
    with tuneup.attach(**attach_options(run_dir, detail_every=1)) as agent:
        for step in range(1, 201):
            x = torch.randn(32, 4)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            own[step] = norm_of(model.parameters())
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 0.05 * parameter.grad
                    parameter.grad = None
        found = habits(agent)["grad_norms"]
    assert found["series"] == 1 and found["samples"] >= 8
    assert found["median"] is not None and min(own.values()) <= found["median"] <= max(own.values())


def test_a_failing_norm_turns_itself_off_with_one_warning_and_training_goes_on(run_dir, monkeypatch):
    def broken(tensors):
        raise RuntimeError("no norm today")

    monkeypatch.setattr(gradients, "total_norm", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _, _, agent = regression(100, attach=attach_options(run_dir, detail_every=1))
    assert len(losses) == 100
    said = [w for w in caught if "gradients" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert habits(agent)["grad_norms"] == {"skipped": "failed: RuntimeError"}
    assert agent.snapshot()["totals"]["steps"] == 100  # the optimizer probe stayed on


def series_of(norms: list[float]) -> gradients.Series:
    series = gradients.Series()
    for step, value in enumerate(norms, 1):
        series.add(value, step)
    return series


def test_a_spike_is_over_ten_times_the_median_of_the_norms_before_it():
    assert series_of([1, 1, 1, 1, 11]).spikes == 1
    assert series_of([1, 1, 1, 1, 10]).spikes == 0  # exactly 10x is not over
    assert series_of([0.1, 5, 5, 5]).spikes == 0  # the first four are never judged (4 at least before)
    assert series_of([100, 100, 100, 100, 1]).spikes == 0  # a falling norm never counts
    # Still within the last 8: median(100 x 4, 1 x 4) = 50.5, so 11 is no spike; 8 later it is.
    assert series_of([100] * 4 + [1] * 4 + [11]).spikes == 0
    assert series_of([100] * 4 + [1] * 8 + [11]).spikes == 1
    # Converged a thousandfold from its largest norm: a tenfold leap of noise there is no spike.
    assert series_of([5.0] * 8 + [0.001] * 8 + [0.02]).spikes == 0
    assert series_of([5.0] * 8 + [0.001] * 8 + [2.0]).spikes == 1
    # A non-finite norm is counted as such, and left out of the medians.
    series = series_of([1, 1, float("inf"), 1, 1, float("nan"), 20])
    assert (series.nonfinite, series.spikes, series.largest[3]) == (2, 1, 7)
    # A step's, not a climb's: the next norm falls back under a third of it, or the spike is
    # withdrawn (the norms rose and stay up); a spike followed by a non-finite norm stands.
    assert series_of([1, 1, 1, 1, 12, 1]).spikes == 1
    assert series_of([1, 1, 1, 1, 12, 3.9]).spikes == 1
    assert series_of([1, 1, 1, 1, 12, 4.1]).spikes == 0
    assert series_of([1, 1, 1, 1, 12, 8, 7, 9]).spikes == 0
    assert series_of([1, 1, 1, 1, 12, float("nan")]).spikes == 1
    # The largest spike counted is the evidence: a withdrawn larger leap is not.
    climbed = series_of([1, 1, 1, 1, 1, 1, 1, 1, 30, 20] + [20] * 8 + [400, 10])
    assert climbed.spikes == 1 and climbed.largest_spike[1] == 400, (climbed.spikes, climbed.largest_spike)
