"""GPU time per step from CUDA events, read lazily (event.query(), never synchronize()).

An event is recorded when the step's first forward starts and another when the step
closes; their elapsed time is the GPU's time on the step from its first forward kernel to
its last queued work, excluding the GPU idle time spent waiting for the next batch.
"""

from __future__ import annotations

from collections import deque

import torch

from .steps import StepTimeline


class CudaStepTimer:
    name = "gpu_time"

    def __init__(self, timeline: StepTimeline, capacity: int = 64) -> None:
        self.timeline = timeline
        self.capacity = capacity
        self._free: list[torch.cuda.Event] = []
        self._made = 0
        self._start: torch.cuda.Event | None = None
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    def _event(self) -> torch.cuda.Event | None:
        if self._free:
            return self._free.pop()
        if self._made >= 2 * self.capacity:
            return None  # every event is still in flight: skip this step rather than wait
        self._made += 1
        return torch.cuda.Event(enable_timing=True)

    def forward_started(self) -> None:
        if self._start is None:
            event = self._event()
            if event is not None:
                event.record()
                self._start = event

    def on_close(self, step: int) -> None:
        self.poll()
        start, self._start = self._start, None
        if start is None:
            return
        end = self._event()
        if end is None:
            self._free.append(start)
            return
        end.record()
        self._pending.append((step, start, end))

    def poll(self) -> None:
        pending = self._pending
        while pending and pending[0][2].query():
            step, start, end = pending.popleft()
            self.timeline.ring.put("gpu_seconds", step, start.elapsed_time(end) / 1000.0)
            self._free.extend((start, end))
