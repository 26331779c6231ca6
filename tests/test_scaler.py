"""GradScaler: skipped steps, back-offs and growths counted exactly, without extra syncs."""

from __future__ import annotations

import pytest
import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train

OVERFLOWS = frozenset({4, 9, 10, 11, 30, 31})


def job(optimizer_class=torch.optim.SGD, **optimizer_kwargs):
    torch.manual_seed(0)
    model = mlp(hidden=32)
    loader = loader_for(SlowDataset(size=4096), batch_size=8)
    return loader, model, optimizer_class(model.parameters(), lr=0.01, **optimizer_kwargs)


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [(torch.optim.SGD, {}), (torch.optim.Adam, {"fused": True})],  # fused: skips on the device
    ids=["skip-by-not-stepping", "fused-found-inf"],
)
def test_skipped_steps_growth_and_backoff_counted_exactly(run_dir, optimizer_class, kwargs):
    loader, model, optimizer = job(optimizer_class, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5)
    with tuneup.attach(run_dir=run_dir) as agent:
        truth = train(loader, model, optimizer, steps=60, scaler=scaler, overflow_at=OVERFLOWS)
    snapshot = agent.snapshot()
    summary = snapshot["scaler"]
    assert truth.skipped_steps == len(OVERFLOWS)
    assert summary["present"] and summary["enabled"]
    assert summary["steps"] == 60
    assert summary["skipped_steps"] == truth.skipped_steps
    assert summary["longest_skip_run"] == 3
    assert summary["backoff_events"] == truth.backoff_events
    assert summary["growth_events"] == truth.growth_events > 0
    assert summary["scale"] == scaler.get_scale()
    assert summary["skip_rate"] == pytest.approx(len(OVERFLOWS) / 60)
    # A skipped step is still a step of the loop, and the per-step records carry the skips.
    assert snapshot["totals"]["steps"] == 60
    assert snapshot["totals"]["skipped_steps"] == len(OVERFLOWS)


def test_disabled_scaler_is_reported_as_disabled(run_dir):
    loader, model, optimizer = job()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with tuneup.attach(run_dir=run_dir) as agent:
        train(loader, model, optimizer, steps=10, scaler=scaler)
    summary = agent.snapshot()["scaler"]
    assert summary["present"] is True
    assert summary["enabled"] is False
    assert summary["skipped_steps"] == 0
    assert agent.snapshot()["config"]["grad_scaler"] == {"present": True, "enabled": False}


def test_no_scaler_means_no_scaler_section(run_dir):
    loader, model, optimizer = job()
    with tuneup.attach(run_dir=run_dir) as agent:
        train(loader, model, optimizer, steps=5)
    assert agent.snapshot()["scaler"]["present"] is False


def test_nonfinite_losses_are_counted(run_dir):
    torch.manual_seed(0)
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 64)
    with tuneup.attach(run_dir=run_dir, detail_every=1) as agent:  # read the loss on every step
        for step in range(1, 21):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            if step in (5, 6, 15):
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    snapshot = agent.snapshot()
    assert snapshot["totals"]["nonfinite_losses"] == 3
    assert snapshot["totals"]["losses_read"] == 20
    assert snapshot["scaler"]["skipped_steps"] == 3
    assert snapshot["window"]["loss"]["nonfinite_steps"] == 3


def test_an_unmeasured_optimizer_never_counts_as_a_skip(run_dir):
    """attach(opt_a) while the loop also steps opt_b through the same scaler: opt_b's steps
    ran, so none of them is a skip."""
    torch.manual_seed(0)
    first, second = mlp(hidden=16), mlp(hidden=16)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(second.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 64)
    with tuneup.attach(opt_a, run_dir=run_dir) as agent:
        for _ in range(20):
            loss = first(x).mean() + second(x).mean()
            scaler.scale(loss).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            opt_a.zero_grad()
            opt_b.zero_grad()
    summary = agent.snapshot()["scaler"]
    assert summary["skipped_steps"] == 0 and summary["steps"] == 40


def test_a_new_scaler_per_epoch_is_not_a_back_off(run_dir):
    """A fresh GradScaler each epoch may reuse the old one's id(): no phantom events."""
    import gc

    loader, model, optimizer = job()
    with tuneup.attach(run_dir=run_dir) as agent:
        for _ in range(3):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
            train(loader, model, optimizer, steps=8, scaler=scaler)
            del scaler
            gc.collect()
    summary = agent.snapshot()["scaler"]
    assert summary["backoff_events"] == 0
    assert summary["growth_events"] == 3 * 2  # 8 clean steps with growth_interval=4, per scaler


def test_each_loss_is_recorded_against_its_own_step(run_dir):
    """Without a DataLoader a step closes at the next optimizer step: the loss the update
    consumed must still land on that step, also across steps that read no loss."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    with tuneup.attach(run_dir=run_dir) as agent:
        for step in range(1, 41):
            optimizer.zero_grad()
            loss = weight.sum() + float(step)  # the loss is the step number
            loss.backward()
            optimizer.step()
    columns = agent.recorder.timeline.ring.columns(1, 40)
    recorded = {step: loss for step, loss, known in zip(columns["step"], columns["loss"], columns["loss_known"])
                if known}
    assert len(recorded) >= 10
    assert all(loss == step for step, loss in recorded.items()), recorded
