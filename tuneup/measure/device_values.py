"""Read scalar tensors (loss, scaler scale, found-inf flags) without a host-device sync.

CPU tensors are read at once. CUDA tensors are copied with non_blocking=True into a slot of
a pinned host buffer and a CUDA event is recorded behind the copy, on the tensor's own
device (a DDP rank may train on cuda:3 while the current device is 0); `poll()` hands the
value to its callback once the event has completed. Nothing ever waits on the GPU: when
all slots are busy the read is dropped and counted. The agent polls on the training
thread, so callbacks may update per-step state without locks.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

# Tensor.item as torch defines it, bypassing any wrapper on it (the sync counter's).
raw_item = torch._C.TensorBase.item

Callback = Callable[[float], None]


class DeviceValues:
    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.dropped = 0
        self.pending = 0  # reads in flight; 0 lets the caller skip poll()
        self._pending: deque[tuple[int, torch.cuda.Event, Callback, int | None]] = deque()
        self._host: torch.Tensor | None = None
        self._events: dict[int, list[torch.cuda.Event]] = {}  # per device: events are device-bound
        self._next = 0

    def read(self, tensor: torch.Tensor, callback: Callback, step: int | None = None) -> None:
        """`tensor` holds one element; `callback(value)` runs now (CPU) or from a later
        poll(). `step`, when given, is the step the value belongs to (see oldest_pending_step)."""
        if tensor.is_cuda:
            self._read_cuda(tensor.detach(), callback, step)
        elif tensor.is_cpu:
            callback(float(raw_item(tensor)))
        # Other devices (mps, xla): no non-blocking read path yet; the value stays unknown.

    def _read_cuda(self, value: torch.Tensor, callback: Callback, step: int | None) -> None:
        if len(self._pending) >= self.capacity:
            self.dropped += 1
            return
        if self._host is None:
            self._host = torch.empty(self.capacity, dtype=torch.float32, pin_memory=True)
        slot = self._next
        self._next = (slot + 1) % self.capacity
        device = value.device
        events = self._events.get(device.index)
        if events is None:
            events = self._events[device.index] = [torch.cuda.Event() for _ in range(self.capacity)]
        with torch.cuda.device(device):  # the copy and the event on that device's current stream
            self._host[slot].copy_(value.reshape(()).to(torch.float32), non_blocking=True)
            event = events[slot]
            event.record()
        self._pending.append((slot, event, callback, step))
        self.pending = len(self._pending)

    def poll(self) -> int:
        """Deliver every value whose copy has completed; returns how many are still pending."""
        pending = self._pending
        while pending:
            slot, event, callback, _ = pending[0]
            if not event.query():
                break
            pending.popleft()
            callback(float(raw_item(self._host[slot])))  # type: ignore[index]
        self.pending = len(pending)
        return self.pending

    def oldest_pending_step(self) -> int | None:
        """The earliest step that still waits for a value (reads are delivered in order)."""
        for _, _, _, step in self._pending:
            if step is not None:
                return step
        return None
