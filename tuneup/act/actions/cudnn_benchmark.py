"""cudnn.benchmark = True for a convolutional CUDA job whose input shapes stay the same.

The finding (`cudnn-benchmark-off`) already requires convolutions, static shapes over the
sampled batches and cudnn.deterministic off; the change itself re-checks what may have
changed since: the flags, and a job that asked for deterministic algorithms (benchmarking
picks algorithms by timing, so two runs may pick differently).
"""

from __future__ import annotations

from typing import Any

import torch

from ..action import FASTER, Action, Change, LiveJob

SETTLE_STEPS = 10  # the first steps with benchmark on time every candidate algorithm


class CudnnBenchmarkChange(Change):
    action = "cudnn-benchmark"
    description = "torch.backends.cudnn.benchmark False -> True"
    settle_steps = SETTLE_STEPS
    keep = FASTER

    def __init__(self) -> None:
        super().__init__()
        self.before = {"cudnn.benchmark": bool(torch.backends.cudnn.benchmark)}
        self.after = {"cudnn.benchmark": True}

    def apply(self) -> None:
        torch.backends.cudnn.benchmark = True

    def revert(self) -> None:
        torch.backends.cudnn.benchmark = self.before["cudnn.benchmark"]


class CudnnBenchmark(Action):
    id = "cudnn-benchmark"
    title = "Turn on cuDNN's autotuner"
    fixes = ("cudnn-benchmark-off",)
    summary = "torch.backends.cudnn.benchmark = True (never with deterministic algorithms); kept only when faster."

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        if job.finding(*self.fixes) is None:
            return None
        if torch.backends.cudnn.benchmark:
            self.done = True  # the job turned it on itself
            return None
        if torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled():
            self.refuse("the job asked for deterministic algorithms; benchmarking would let runs pick differently")
            return None
        return CudnnBenchmarkChange()
