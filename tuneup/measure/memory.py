"""Torch caching-allocator statistics (host-side counters: reading them never syncs).

Only read once CUDA is initialized by the job; tuneup never initializes CUDA itself
(that would break fork-based DataLoader workers and take GPU memory)."""

from __future__ import annotations

from typing import Any

import torch

_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "allocated_peak_bytes": "allocated_bytes.all.peak",
    "reserved_bytes": "reserved_bytes.all.current",
    "reserved_peak_bytes": "reserved_bytes.all.peak",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def allocator_stats() -> dict[str, Any]:
    if not torch.cuda.is_initialized():  # is_available() alone would initialize the driver
        return {"available": False, "reason": "CUDA is not in use: no device allocator"}
    devices = []
    for index in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(index)
        if not stats.get("reserved_bytes.all.peak"):
            continue  # a device this process never allocated on
        entry: dict[str, Any] = {"device": index}
        entry.update({name: int(stats.get(key, 0)) for name, key in _KEYS.items()})
        entry["total_bytes"] = int(torch.cuda.get_device_properties(index).total_memory)
        devices.append(entry)
    return {"available": True, "devices": devices}
