"""Samples of the input batches the advice rules need: whether they are pinned, on which
device, whether their shapes change (cudnn.benchmark needs static shapes), and value
statistics of the float inputs (normalization) — on a few fetches only (1-5, then sparser),
never on the GPU.

The other code habits are measured where they happen: `torch.tensor(ndarray)` copies and
gradient clipping by the call watch (calls.py), evaluation forwards that build autograd
graphs by the model probe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .device_values import raw_item
from .hotpath import StepTimeline
from .transfer import layout

MAX_SHAPES = 64
SAMPLE_ROWS = 8  # rows of a batch read for its statistics


def _inspect_schedule(fetch: int) -> int:
    """The fetch after `fetch` to inspect: 1-5, 10, 20, 50, 100, then every 100th."""
    if fetch < 5:
        return fetch + 1
    for mark in (10, 20, 50, 100):
        if fetch < mark:
            return mark
    return fetch + 100


def _tensors(batch: Any, limit: int = 8) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    pending = [batch]
    while pending and len(out) < limit:
        item = pending.pop(0)
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            pending.extend(item[:limit])
        elif isinstance(item, Mapping):
            pending.extend(list(item.values())[:limit])
    return out


class HabitsProbe:
    name = "habits"

    def __init__(self, timeline: StepTimeline) -> None:
        self.on = True
        self.timeline = timeline
        self.next_inspect = 1
        self.inspected = 0
        self.pinned = 0
        self.pin_known = 0
        self.devices: set[str] = set()
        self.shapes: set[tuple] = set()
        self.shape_changes = 0
        self._last_shape: tuple | None = None
        self.inputs: dict[str, Any] | None = None  # the newest float-input statistics
        self.layout: list | None = None  # the first inspected batch's CPU tensors (transfer.py)

    def inspect(self, batch: Any, fetch: int) -> None:
        """Called by the loader probe on scheduled fetches (off the common path): `batch` is
        the loop's `fetch`th."""
        self.next_inspect = _inspect_schedule(fetch)
        if not self.on:
            return
        try:
            tensors = _tensors(batch)
            if not tensors:
                return
            self.inspected += 1
            if self.layout is None:
                self.layout = layout(batch)
            shape = tuple(tuple(t.shape) for t in tensors)
            if self._last_shape is not None and shape != self._last_shape:
                self.shape_changes += 1
            self._last_shape = shape
            if len(self.shapes) < MAX_SHAPES:
                self.shapes.add(shape)
            self.devices.update(t.device.type for t in tensors)
            if torch.cuda.is_initialized():  # is_pinned() would initialize CUDA otherwise
                self.pin_known += 1
                if all(t.is_pinned() for t in tensors if t.device.type == "cpu"):
                    self.pinned += 1
            first = next((t for t in tensors if t.is_floating_point() and t.dim() >= 2 and t.is_cpu), None)
            if first is not None:
                rows = first[:SAMPLE_ROWS].detach().float()
                if rows.numel() > 1:
                    finite = rows[torch.isfinite(rows)]
                    if finite.numel() > 1:
                        # raw_item: tuneup's own reads are not the job's host-device syncs
                        self.inputs = {
                            "mean": raw_item(finite.mean()),
                            "std": raw_item(finite.std()),
                            "abs_max": raw_item(finite.abs().max()),
                            "shape": list(first.shape),
                            "dtype": str(first.dtype).replace("torch.", ""),
                        }
        except Exception as exc:
            self.fail(exc)

    def summary(self) -> dict[str, Any]:
        return {
            "batches": {
                "inspected": self.inspected,
                "devices": sorted(self.devices),
                "pinned": self.pinned if self.pin_known else None,
                "pin_checked": self.pin_known,
                "distinct_shapes": len(self.shapes),
                "shape_changes": self.shape_changes,
                "inputs": self.inputs,
            },
        }

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.fail(self.name, exc)

