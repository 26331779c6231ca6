"""cudnn.benchmark = True for a convolutional CUDA job whose input shapes stay the same: set at
start, before the first convolution, because that is the only time it does anything.

cuDNN picks an algorithm per convolution shape the first time that shape runs and keeps it in a
cache keyed by the shape and the deterministic/TF32 flags but not by `benchmark`
(aten/src/ATen/native/cudnn/Conv_v7.cpp `AlgoIterator::try_all`: `cache.find(args.params, ...)`
before any search; Conv_v8.cpp's plan cache likewise). Switched on mid-run, benchmark changes
nothing for the shapes already seen: a trial of it would only measure noise, and a static-shape
job has seen all its shapes after one step. So:

- at the first training forward of a model with convolutions on a CUDA device (apply mode: the
  model probe calls `at_start` before the model's first module runs), benchmark is switched on,
  unless the job turned it on, asked for deterministic algorithms, or disabled cuDNN. The record
  says "set at start"; the first steps pay for the tuning once.
- it stays while the sampled batches' shapes stay static (<= 2 distinct: a smaller last batch),
  and is rolled back once they vary (every new shape would be tuned again);
- mid-run (the cudnn-benchmark-off finding: convolutions already ran with it off), nothing is
  tried: the action says why, and the finding's fix says to set it at start.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..action import FASTER, Action, Change, LiveJob

SETTLE_STEPS = 10  # the first steps with benchmark on time every candidate algorithm
MAX_SHAPES = 2  # distinct sampled batch shapes that still count as static (a smaller last batch)
MIN_BATCHES = 5  # sampled batches before the shapes are judged
MID_RUN = ("switched on mid-run it changes nothing: cuDNN keeps the algorithm it chose for each shape "
           "already seen (its cache is not keyed by the benchmark flag); set it before the first "
           "convolution (tuneup run --apply does)")


class CudnnBenchmarkChange(Change):
    action = "cudnn-benchmark"
    description = "torch.backends.cudnn.benchmark False -> True, before the first convolution"
    settle_steps = SETTLE_STEPS
    keep = FASTER
    at_start_reason = ("cuDNN tunes each input shape the first time it runs and keeps that choice; kept while the "
                       "sampled batch shapes stay static")

    def __init__(self, job: LiveJob) -> None:
        super().__init__()
        self.job = job
        self.before = {"cudnn.benchmark": bool(torch.backends.cudnn.benchmark)}
        self.after = {"cudnn.benchmark": True}

    def apply(self) -> None:
        torch.backends.cudnn.benchmark = True

    def revert(self) -> None:
        torch.backends.cudnn.benchmark = self.before["cudnn.benchmark"]

    def check(self, step: int) -> str | None:
        """Rolled back once the sampled batch shapes turn out not to be static."""
        habits = self.job.loaders.habits
        if habits.inspected >= MIN_BATCHES and len(habits.shapes) > MAX_SHAPES:
            return (f"the input shapes vary ({len(habits.shapes)} distinct over {habits.inspected} sampled "
                    "batches): cuDNN would tune every new shape again")
        return self.rollback_reason


def _convolutional(model: nn.Module) -> bool:
    return any(isinstance(module, nn.modules.conv._ConvNd) for module in model.modules())


def _on_cuda(model: nn.Module) -> bool:
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cuda"


class CudnnBenchmark(Action):
    id = "cudnn-benchmark"
    title = "Turn on cuDNN's autotuner"
    fixes = ("cudnn-benchmark-off",)
    summary = ("torch.backends.cudnn.benchmark = True, set before the first convolution of a CUDA model "
               "(never with deterministic algorithms); rolled back if the input shapes turn out to vary.")

    def at_start(self, job: LiveJob, model: nn.Module) -> Change | None:
        """Before `model`'s first training forward: the change, where it applies."""
        if self.done or not _convolutional(model) or not _on_cuda(model):
            return None
        if torch.backends.cudnn.benchmark or not torch.backends.cudnn.enabled:
            self.done = True  # the job decided itself
            return None
        if torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled():
            self.refuse("the job asked for deterministic algorithms; benchmarking would let runs pick differently")
            return None
        self.done = True
        return CudnnBenchmarkChange(job)

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        if job.finding(*self.fixes) is None:
            return None
        self.refuse(MID_RUN)
        return None
