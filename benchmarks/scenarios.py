"""Real training loops with injected bottlenecks and independently measured ground truth.

Used by the tests (does tuneup measure what happened?) and by benchmarks/bench_accuracy.py
(how close, over the whole scenario set). The loop times its own `next()` calls and counts
its own host reads and injected overflows, so the truth never comes from tuneup.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info


def sample(index: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic sample: the same index always gives the same tensors."""
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(features, generator=generator)
    y = x[:4].sum().reshape(1)
    return x, y


class SlowDataset(Dataset):
    """Map-style dataset with a fixed per-sample latency (an I/O-bound read)."""

    def __init__(self, size: int = 4096, features: int = 64, latency: float = 0.0, fail_at: int | None = None):
        self.size = size
        self.features = features
        self.latency = latency
        self.fail_at = fail_at

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail_at is not None and index == self.fail_at:
            raise ValueError(f"corrupt sample {index}")
        if self.latency:
            time.sleep(self.latency)
        return sample(index, self.features)


class SlowStream(IterableDataset):
    """Iterable dataset, sharded across workers, with a per-sample latency."""

    def __init__(self, size: int = 4096, features: int = 64, latency: float = 0.0):
        self.size = size
        self.features = features
        self.latency = latency

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, self.size, step):
            if self.latency:
                time.sleep(self.latency)
            yield sample(index, self.features)


def mlp(features: int = 64, hidden: int = 256, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = []
    width = features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


@dataclass
class Truth:
    """What the loop itself saw."""

    steps: int = 0  # optimizer steps taken or skipped (one per loop iteration)
    batches: int = 0
    samples: int = 0
    seconds: float = 0.0  # first fetch to last optimizer step
    data_wait_seconds: float = 0.0
    host_reads_per_step: int = 0
    skipped_steps: int = 0
    growth_events: int = 0
    backoff_events: int = 0
    losses: list[float] = field(default_factory=list)

    @property
    def stall_ratio(self) -> float:
        return self.data_wait_seconds / self.seconds if self.seconds else math.nan


def train(
    loader: DataLoader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    accumulate: int = 1,
    host_reads: int = 0,
    scaler: torch.amp.GradScaler | None = None,
    overflow_at: frozenset[int] = frozenset(),
    extra_optimizer: torch.optim.Optimizer | None = None,
    compute: Callable[[], None] | None = None,
    epochs: int = 1_000_000,
) -> Truth:
    """Run `steps` optimizer steps (or until the epochs run out) and record the truth.

    host_reads: `.item()` calls per step in the loop body. overflow_at: step numbers
    (1-based) whose gradients get an injected inf, so an enabled GradScaler must skip them.
    """
    truth = Truth()
    loss_fn = nn.MSELoss()
    started = None
    growth_tracker = 0
    growth_interval = scaler.get_growth_interval() if scaler is not None and scaler.is_enabled() else 0
    micro = 0
    # Waits count once a step follows them: the wait for the StopIteration that ends the
    # last epoch belongs to no step.
    waited = 0.0
    for _ in range(epochs):
        began = time.perf_counter()
        started = began if started is None else started
        iterator = iter(loader)  # starts worker processes: the loop waits for data here too
        waited += time.perf_counter() - began
        while True:
            began = time.perf_counter()
            try:
                x, y = next(iterator)
            except StopIteration:
                waited += time.perf_counter() - began
                break
            waited += time.perf_counter() - began
            truth.batches += 1
            truth.samples += x.shape[0]
            output = model(x)
            loss = loss_fn(output, y) / accumulate
            if compute is not None:
                compute()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            micro += 1
            if micro % accumulate:
                continue
            step = truth.steps + 1
            if step in overflow_at:
                with torch.no_grad():
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
            if scaler is not None:
                scaler.step(optimizer)
                if extra_optimizer is not None:
                    scaler.step(extra_optimizer)
                scaler.update()
                if scaler.is_enabled():
                    if step in overflow_at:
                        truth.skipped_steps += 1
                        truth.backoff_events += 1
                        growth_tracker = 0
                    else:
                        growth_tracker += 1
                        if growth_tracker == growth_interval:
                            truth.growth_events += 1
                            growth_tracker = 0
            else:
                optimizer.step()
                if extra_optimizer is not None:
                    extra_optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if extra_optimizer is not None:
                extra_optimizer.zero_grad(set_to_none=True)
            for _ in range(host_reads):
                truth.losses.append(loss.item())
            truth.host_reads_per_step = host_reads
            truth.data_wait_seconds += waited
            waited = 0.0
            truth.steps = step
            truth.seconds = time.perf_counter() - started
            if truth.steps >= steps:
                return truth
    return truth


def spin(seconds: float) -> Callable[[], None]:
    """Busy compute for a fixed time (a GIL-holding stand-in for a forward pass)."""

    def busy() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return busy


def loader_for(dataset: Any, **kwargs: Any) -> DataLoader:
    kwargs.setdefault("batch_size", 16)
    return DataLoader(dataset, **kwargs)


class SpinLayer(nn.Module):
    """A layer whose forward takes a known time (a stand-in for a heavy model)."""

    def __init__(self, features: int, seconds: float):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spin(self.seconds)()
        return self.linear(x)
