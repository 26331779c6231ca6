"""GPU time per step from CUDA events, read lazily (event.query(), never synchronize()).

On detail steps an event is recorded when the step's first forward starts and another where
the step's GPU work ends: at the end of its last optimizer step (for loops without an
optimizer step, at the close). Their elapsed time is the GPU's time on the step, from its
first forward kernel to its update's last kernel, on the current stream of the device the
model trains on.

Why not at the close: the step closes lazily, when the next batch arrives, so an end event
recorded there comes after the data wait. An event on an idle stream completes as soon as it
is recorded, so that figure grew to the whole step whenever the GPU starved for data, and the
host-syncs gain (1 - gpu/step - stall) collapsed to zero.

Events are never recorded or queried while the current stream captures a CUDA graph (a
query there invalidates the capture: torch/cuda/graphs.py); a step whose events cannot be
compared (elapsed_time raises when they ran on different streams or one was never reached)
is dropped on its own, the timer goes on.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch

from .hotpath import StepTimeline


class CudaStepTimer:
    name = "gpu_time"

    def __init__(self, timeline: StepTimeline, device: torch.device | None, capacity: int = 64,
                 event: Callable[[], Any] | None = None, stream: Callable[[Any], Any] | None = None,
                 capturing: Callable[[], bool] | None = None) -> None:
        self.timeline = timeline
        self.device = device  # None: the current device
        self.capacity = capacity
        # torch.cuda's own by default; a test without a GPU passes objects of the same interface.
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or torch.cuda.current_stream
        self._capturing = capturing or torch.cuda.is_current_stream_capturing
        self._free: list[Any] = []
        self._made = 0
        self._start: Any = None
        self._end: Any = None
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self.dropped = 0  # steps whose events could not be compared

    def _take(self) -> Any:
        if self._free:
            return self._free.pop()
        if self._made < 2 * self.capacity:
            self._made += 1
            return self._event()
        return None  # every event is still in flight: skip this step rather than wait

    def _record(self, event: Any = None) -> Any:
        """Record `event` (or a free one) on the current stream now; None when none is free or a
        graph is being captured."""
        if self._capturing():
            return event
        if event is None:
            event = self._take()
            if event is None:
                return None
        event.record(self._stream(self.device))
        return event

    def forward_started(self) -> None:
        if self._start is None:
            self._start = self._record()

    def optimizer_ended(self) -> None:
        """A detail step's optimizer step ended: its GPU work is queued up to here (recorded
        again at each optimizer of the step: the last one ends it)."""
        if self._start is not None:
            self._end = self._record(self._end)

    def on_close(self, step: int) -> None:
        self.poll()
        start, end = self._start, self._end
        self._start = self._end = None
        if start is None:
            if end is not None:
                self._free.append(end)
            return
        if end is None:  # no optimizer step in it (parameters updated by hand, tuneup.step())
            end = self._record()
            if end is None:
                self._free.append(start)
                return
        self._pending.append((step, start, end))

    def poll(self) -> None:
        pending = self._pending
        if pending and self._capturing():
            return
        while pending and pending[0][2].query():
            step, start, end = pending.popleft()
            try:
                seconds = start.elapsed_time(end) / 1000.0
            except RuntimeError:  # recorded on different streams, or one was never recorded
                self.dropped += 1
            else:
                self.timeline.ring.put("gpu_seconds", step, seconds)
            self._free.extend((start, end))

    def oldest_pending_step(self) -> int | None:
        return self._pending[0][0] if self._pending else None
