"""Advise mode changes nothing: the same seed gives bit-identical losses and weights."""

from __future__ import annotations

import pytest
import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train

OVERFLOWS = frozenset({3, 8})


def run(with_agent: bool, run_dir, workers: int):
    torch.manual_seed(1234)
    model = mlp(hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
    generator = torch.Generator().manual_seed(99)
    loader = loader_for(SlowDataset(size=1024), batch_size=16, shuffle=True, num_workers=workers,
                        generator=generator)
    if with_agent:
        # Sample syncs on every step: the most intrusive setting the agent has.
        with tuneup.attach(run_dir=run_dir, sync_sample_every=1):
            truth = train(loader, model, optimizer, steps=40, scaler=scaler, host_reads=1,
                          overflow_at=OVERFLOWS, accumulate=2)
    else:
        truth = train(loader, model, optimizer, steps=40, scaler=scaler, host_reads=1,
                      overflow_at=OVERFLOWS, accumulate=2)
    weights = [p.detach().clone() for p in model.parameters()]
    return truth.losses, weights, scaler.get_scale()


@pytest.mark.parametrize("workers", [0, 2])
def test_same_seed_gives_bit_identical_losses_with_and_without_the_agent(run_dir, workers):
    plain_losses, plain_weights, plain_scale = run(False, run_dir, workers)
    agent_losses, agent_weights, agent_scale = run(True, run_dir, workers)
    assert len(plain_losses) == 40
    assert agent_losses == plain_losses  # exact float equality, step by step
    assert all(torch.equal(a, b) for a, b in zip(agent_weights, plain_weights))
    assert agent_scale == plain_scale
