"""GPU state from NVML, behind one interface: `open_gpus()` returns a backend with
`available`, `reason`, `devices`, `sample()` and `close()`.

The NVML binding is a module with pynvml's functions (nvidia-ml-py's `pynvml` by default,
a fake with the same functions in tests: TUNEUP_NVML_MODULE names it). No driver ⇒
`NoGpus` with the reason; a field the GPU doesn't support is None; any other NVML error
propagates so the agent can turn the probe off with one warning.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# NVML return codes that mean "this GPU cannot tell you that": the field stays None.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4

# nvmlClocksEventReasons bits (nvml.h); idle and application-clock settings are not throttling.
THROTTLE_REASONS = {
    0x0000000000000004: "sw_power_cap",
    0x0000000000000008: "hw_slowdown",
    0x0000000000000020: "sw_thermal",
    0x0000000000000040: "hw_thermal",
    0x0000000000000080: "hw_power_brake",
    0x0000000000000010: "sync_boost",
    0x0000000000000100: "display_clocks",
}


class NoGpus:
    available = False
    devices: list[dict[str, Any]] = []

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def sample(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class NvmlGpus:
    available = True
    reason = None

    def __init__(self, nvml: Any, every_device: bool = False) -> None:
        self.nvml = nvml
        self.pid = os.getpid()
        # Renamed in newer NVML; the old name remains as an alias in older bindings.
        self._clock_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons"
        )
        self._unsupported: set[tuple[int, str]] = set()
        self.handles: list[tuple[int, Any]] = []
        self.devices: list[dict[str, Any]] = []
        indices = list(range(nvml.nvmlDeviceGetCount())) if every_device else self._visible_indices()
        for index in indices:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self.handles.append((index, handle))
            self.devices.append(
                {
                    "gpu": index,
                    "name": _text(self._field(index, "name", nvml.nvmlDeviceGetName, handle)),
                    "uuid": _text(self._field(index, "uuid", nvml.nvmlDeviceGetUUID, handle)),
                }
            )

    def _visible_indices(self) -> list[int]:
        count = self.nvml.nvmlDeviceGetCount()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return list(range(count))
        indices: list[int] = []
        uuids = None
        for entry in (part.strip() for part in visible.split(",")):
            if not entry:
                continue
            if entry.isdigit():
                if int(entry) >= count:
                    break  # CUDA stops at the first invalid entry too
                indices.append(int(entry))
                continue
            if uuids is None:
                uuids = {
                    _text(self.nvml.nvmlDeviceGetUUID(self.nvml.nvmlDeviceGetHandleByIndex(i))): i
                    for i in range(count)
                }
            match = [i for uuid, i in uuids.items() if uuid.startswith(entry) or entry.startswith(uuid)]
            if not match:
                break
            indices.append(match[0])
        return indices

    def _field(self, index: int, name: str, read: Any, *args: Any) -> Any:
        if (index, name) in self._unsupported:
            return None
        try:
            return read(*args)
        except Exception as exc:
            if getattr(exc, "value", None) in (_NOT_SUPPORTED, _NO_PERMISSION):
                self._unsupported.add((index, name))
                return None
            raise

    def sample(self) -> list[dict[str, Any]]:
        nvml = self.nvml
        samples = []
        for index, handle in self.handles:
            field = self._field
            utilization = field(index, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = field(index, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = field(index, "power", nvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = field(index, "power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            sm_clock = field(index, "sm_clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            sm_max = field(index, "sm_clock_max", nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM)
            temperature = field(
                index, "temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
            )
            reasons = field(index, "throttle", self._clock_reasons, handle)
            rx_kb = field(index, "pcie_rx", nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
            tx_kb = field(index, "pcie_tx", nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
            processes = field(index, "processes", nvml.nvmlDeviceGetComputeRunningProcesses, handle)
            own = None
            if processes is not None:
                own = sum(p.usedGpuMemory or 0 for p in processes if p.pid == self.pid) or 0
            samples.append(
                {
                    "gpu": index,
                    "utilization_ratio": utilization.gpu / 100 if utilization is not None else None,
                    "memory_utilization_ratio": utilization.memory / 100 if utilization is not None else None,
                    "memory_used_bytes": memory.used if memory is not None else None,
                    "memory_total_bytes": memory.total if memory is not None else None,
                    "power_watts": power_mw / 1000 if power_mw is not None else None,
                    "power_limit_watts": limit_mw / 1000 if limit_mw is not None else None,
                    "sm_clock_hz": sm_clock * 1e6 if sm_clock is not None else None,
                    "sm_clock_max_hz": sm_max * 1e6 if sm_max is not None else None,
                    "temperature_celsius": temperature,
                    "throttle_reasons": _reasons(reasons),
                    "pcie_rx_bytes_per_second": rx_kb * 1024 if rx_kb is not None else None,
                    "pcie_tx_bytes_per_second": tx_kb * 1024 if tx_kb is not None else None,
                    "process_memory_bytes": own,
                }
            )
        return samples

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


def _reasons(mask: int | None) -> list[str] | None:
    if mask is None:
        return None
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def open_gpus(module_name: str = "pynvml", enabled: bool = True, every_device: bool = False) -> NvmlGpus | NoGpus:
    """The GPU backend for this process (the GPUs CUDA_VISIBLE_DEVICES leaves it, or with
    `every_device` all of the machine's: the node daemon's view); never raises."""
    if not enabled:
        return NoGpus("GPU sampling turned off (TUNEUP_GPU=0)")
    try:
        nvml = importlib.import_module(module_name)
    except Exception as exc:
        return NoGpus(f"NVML binding {module_name!r} could not be imported ({type(exc).__name__}: {exc})")
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return NoGpus(f"no NVIDIA driver: NVML did not start ({_describe(exc)})")
    try:
        gpus = NvmlGpus(nvml, every_device)
    except Exception as exc:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
        return NoGpus(f"NVML failed while listing GPUs ({_describe(exc)})")
    if not gpus.handles:
        gpus.close()
        return NoGpus("NVML sees no GPU visible to this process")
    return gpus


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
