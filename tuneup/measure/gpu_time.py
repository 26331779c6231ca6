"""GPU time per step from CUDA events, read lazily (event.query(), never synchronize()).

An event is recorded when the step's first forward starts and another when the step
closes, on the current stream of the device the model trains on; their elapsed time is the
GPU's time on the step from its first forward kernel to its last queued work, excluding the
GPU idle time spent waiting for the next batch. Measured on detail steps (when the forward
is timed).
"""

from __future__ import annotations

from collections import deque

import torch

from .hotpath import StepTimeline


class CudaStepTimer:
    name = "gpu_time"

    def __init__(self, timeline: StepTimeline, device: torch.device | None, capacity: int = 64) -> None:
        self.timeline = timeline
        self.device = device  # None: the current device
        self.capacity = capacity
        self._free: list[torch.cuda.Event] = []
        self._made = 0
        self._start: torch.cuda.Event | None = None
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    def _record(self) -> torch.cuda.Event | None:
        if self._free:
            event = self._free.pop()
        elif self._made < 2 * self.capacity:
            self._made += 1
            event = torch.cuda.Event(enable_timing=True)
        else:
            return None  # every event is still in flight: skip this step rather than wait
        event.record(torch.cuda.current_stream(self.device))
        return event

    def forward_started(self) -> None:
        if self._start is None:
            self._start = self._record()

    def on_close(self, step: int) -> None:
        self.poll()
        start, self._start = self._start, None
        if start is None:
            return
        end = self._record()
        if end is None:
            self._free.append(start)
            return
        self._pending.append((step, start, end))

    def poll(self) -> None:
        pending = self._pending
        while pending and pending[0][2].query():
            step, start, end = pending.popleft()
            self.timeline.ring.put("gpu_seconds", step, start.elapsed_time(end) / 1000.0)
            self._free.extend((start, end))

    def oldest_pending_step(self) -> int | None:
        return self._pending[0][0] if self._pending else None
