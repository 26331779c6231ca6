"""GPU state from NVML, behind one interface: `open_gpus()` returns a backend with
`available`, `reason`, `devices`, `sample()` and `close()`.

The NVML binding is a module with pynvml's functions (nvidia-ml-py's `pynvml` by default,
a fake with the same functions in tests: TUNEUP_NVML_MODULE names it). No driver ⇒
`NoGpus` with the reason.

Each field is read on its own. A driver older or newer than the binding lacks functions or
changed their structs: nvidia-ml-py raises NVMLError(FUNCTION_NOT_FOUND) for a symbol the
library lacks (pynvml.py `_nvmlGetFunctionPointer`), NVMLLibraryMismatchError for an
unversioned call it cannot match (`throwOnVersionMismatch`: nvmlDeviceGetComputeRunningProcesses
is the v3 call, absent before driver 510), ARGUMENT_VERSION_MISMATCH for a struct version the
driver does not know; an old binding lacks the Python function itself (AttributeError). Any of
those, "not supported" and "no permission" make that field absent (None) from then on, never the
probe. Any other NVML error (the GPU is lost, the driver went away) propagates so the agent turns
the probe off with one warning.

Devices are labelled `gpu` by their CUDA ordinal in this process, as torch and the allocator
series name them (NVML's index is another numbering: CUDA_VISIBLE_DEVICES picks and reorders,
CUDA_DEVICE_ORDER may sort by speed). Until the job initializes CUDA, the ordinal is the
device's place in CUDA_VISIBLE_DEVICES; from then on each device is matched to torch's by UUID
(`match_cuda`). MIG instances named in CUDA_VISIBLE_DEVICES are found under their GPU and
sampled on their own handle (memory; the rest is not supported per instance).

This process's own GPU memory is matched by pid. NVML lists processes with the host's pids; in
a container the job has another one, so every pid of this process in the pid namespaces that
/proc/self/status `NSpid` shows is tried, and no match reads as unknown (None), not 0.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Collection

# NVML return codes that mean "this GPU or driver cannot tell you that": the field stays None.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_FUNCTION_NOT_FOUND = 13
_ARGUMENT_VERSION_MISMATCH = 25
_DEPRECATED = 26
FIELD_ABSENT = frozenset({_NOT_SUPPORTED, _NO_PERMISSION, _FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH, _DEPRECATED})

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
# The clock-reasons call was renamed (Throttle -> Event) in newer NVML; either may be missing.
_CLOCK_REASONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


class NoGpus:
    available = False
    devices: list[dict[str, Any]] = []

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def sample(self) -> list[dict[str, Any]]:
        return []

    def energy_joules(self, gpus: Collection[Any] | None = None) -> float | None:
        return None

    def close(self) -> None:
        pass


def field_absent(exc: BaseException) -> bool:
    """Whether an error of an NVML call means the field cannot be read here (see the module
    docstring), rather than that NVML failed."""
    return (isinstance(exc, AttributeError) or type(exc).__name__ == "NVMLLibraryMismatchError"
            or getattr(exc, "value", None) in FIELD_ABSENT)


def own_pids(status_file: str = "/proc/self/status") -> frozenset[int]:
    """This process's pid in every pid namespace /proc/self/status lists (NSpid: from the
    namespace /proc was mounted in, inward), and os.getpid()."""
    pids = {os.getpid()}
    try:
        with open(status_file, encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    pids.update(int(part) for part in line.split()[1:] if part.isdigit())
                    break
    except OSError:
        pass
    return frozenset(pids)


def cuda_uuids() -> list[str]:
    """The UUID of each CUDA device of this process, by ordinal (torch's device properties;
    call only once the job initialized CUDA: this never initializes it)."""
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _uuid_key(uuid: Any) -> str:
    """A UUID as NVML ("GPU-..." / "MIG-...") and torch (bare) write it, compared alike."""
    text = str(_text(uuid) or "").strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


class NvmlGpus:
    available = True
    reason = None

    def __init__(self, nvml: Any, every_device: bool = False) -> None:
        self.nvml = nvml
        self.pids = own_pids()
        self._absent: set[tuple[int, str]] = set()  # (nvml index, field) that cannot be read here
        # (label, nvml index, handle) per device, and what is known of each: replaced whole,
        # never changed in place (match_cuda on the training thread, sample() on the agent's).
        self.handles: list[tuple[int, int, Any]] = []
        self.devices: list[dict[str, Any]] = []
        found = [(i, nvml.nvmlDeviceGetHandleByIndex(i), False) for i in range(nvml.nvmlDeviceGetCount())] \
            if every_device else self._visible()
        for ordinal, (index, handle, mig) in enumerate(found):
            self.handles.append((ordinal, index, handle))
            self.devices.append({
                "gpu": ordinal,
                "nvml_index": index,
                "name": _text(self._field(index, "name", "nvmlDeviceGetName", handle)),
                "uuid": _text(self._field(index, "uuid", "nvmlDeviceGetUUID", handle)),
                "mig": mig,
            })

    def _visible(self) -> list[tuple[int, Any, bool]]:
        """(nvml index, handle, is a MIG instance) of each device CUDA_VISIBLE_DEVICES leaves
        this process, in its order (which is CUDA's ordinal order)."""
        nvml = self.nvml
        count = nvml.nvmlDeviceGetCount()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return [(i, nvml.nvmlDeviceGetHandleByIndex(i), False) for i in range(count)]
        found: list[tuple[int, Any, bool]] = []
        uuids: dict[str, tuple[int, Any, bool]] | None = None
        for entry in (part.strip() for part in visible.split(",")):
            if not entry:
                continue
            if entry.isdigit():
                if int(entry) >= count:
                    break  # CUDA stops at the first invalid entry too
                found.append((int(entry), nvml.nvmlDeviceGetHandleByIndex(int(entry)), False))
                continue
            if uuids is None:
                uuids = self._by_uuid(count)
            key = _uuid_key(entry.split("/", 1)[0])
            match = [device for uuid, device in uuids.items() if uuid.startswith(key)]
            if not match:
                break
            found.append(match[0])
        return found

    def _by_uuid(self, count: int) -> dict[str, tuple[int, Any, bool]]:
        """Every GPU and MIG instance by UUID (compared as _uuid_key writes it)."""
        nvml = self.nvml
        devices: dict[str, tuple[int, Any, bool]] = {}
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            devices[_uuid_key(nvml.nvmlDeviceGetUUID(handle))] = (index, handle, False)
            slots = self._field(index, "mig_slots", "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
            for slot in range(slots):
                try:
                    instance = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except Exception as exc:
                    if getattr(exc, "value", None) == _NOT_FOUND or field_absent(exc):
                        continue  # an empty slot
                    raise
                devices[_uuid_key(nvml.nvmlDeviceGetUUID(instance))] = (index, instance, True)
        return devices

    def match_cuda(self, cuda_uuids: list[str]) -> None:
        """Label each device by the CUDA ordinal whose UUID it has (torch's
        get_device_properties(i).uuid, i = 0, 1, ...), once the job initialized CUDA; a device
        torch does not list keeps its label."""
        ordinals = {_uuid_key(uuid): ordinal for ordinal, uuid in enumerate(cuda_uuids)}
        labels = [ordinals.get(_uuid_key(device["uuid"]), device["gpu"]) for device in self.devices]
        if len(set(labels)) != len(labels):
            return  # not one to one: keep the labels we have
        self.devices = [{**device, "gpu": label} for device, label in zip(self.devices, labels)]
        self.handles = [(label, index, handle) for label, (_, index, handle) in zip(labels, self.handles)]

    def _field(self, index: int, name: str, function: str | tuple[str, ...], *args: Any) -> Any:
        if (index, name) in self._absent:
            return None
        try:
            read = self._function(function)
            return read(*args)
        except Exception as exc:
            if field_absent(exc):
                self._absent.add((index, name))
                return None
            raise

    def _function(self, names: str | tuple[str, ...]) -> Any:
        for name in (names,) if isinstance(names, str) else names:
            function = getattr(self.nvml, name, None)
            if function is not None:
                return function
        raise AttributeError(f"the NVML binding has no {' or '.join((names,) if isinstance(names, str) else names)}")

    def _constant(self, name: str, default: int) -> int:
        return getattr(self.nvml, name, default)

    def energy_joules(self, gpus: Collection[Any] | None = None) -> float | None:
        """Joules NVML's energy counters read now (millijoules since the driver loaded, Volta and
        newer), summed over the devices labelled `gpus` (None: every one of this process's);
        None where one of them has no counter (a MIG instance, an older GPU). One NVML call a
        device: apply mode reads it a few times a trial, between two steps."""
        total, chosen = 0.0, [(index, handle) for label, index, handle in self.handles if gpus is None or label in gpus]
        for index, handle in chosen:
            millijoules = self._field(index, "energy", "nvmlDeviceGetTotalEnergyConsumption", handle)
            if millijoules is None:
                return None
            total += millijoules / 1000
        return total if chosen else None

    def sample(self) -> list[dict[str, Any]]:
        samples = []
        field = self._field
        sm = self._constant("NVML_CLOCK_SM", 1)
        for label, index, handle in self.handles:
            utilization = field(index, "utilization", "nvmlDeviceGetUtilizationRates", handle)
            memory = field(index, "memory", "nvmlDeviceGetMemoryInfo", handle)
            power_mw = field(index, "power", "nvmlDeviceGetPowerUsage", handle)
            limit_mw = field(index, "power_limit", "nvmlDeviceGetEnforcedPowerLimit", handle)
            # Millijoules since the driver loaded, Volta and newer (nvidia-ml-py reads a uint64;
            # older bindings a uint32, which wraps: readers treat a fall as no figure).
            energy_mj = field(index, "energy", "nvmlDeviceGetTotalEnergyConsumption", handle)
            sm_clock = field(index, "sm_clock", "nvmlDeviceGetClockInfo", handle, sm)
            sm_max = field(index, "sm_clock_max", "nvmlDeviceGetMaxClockInfo", handle, sm)
            temperature = field(index, "temperature", "nvmlDeviceGetTemperature", handle,
                                self._constant("NVML_TEMPERATURE_GPU", 0))
            reasons = field(index, "throttle", _CLOCK_REASONS, handle)
            rx_kb = field(index, "pcie_rx", "nvmlDeviceGetPcieThroughput", handle,
                          self._constant("NVML_PCIE_UTIL_RX_BYTES", 1))
            tx_kb = field(index, "pcie_tx", "nvmlDeviceGetPcieThroughput", handle,
                          self._constant("NVML_PCIE_UTIL_TX_BYTES", 0))
            processes = field(index, "processes", "nvmlDeviceGetComputeRunningProcesses", handle)
            samples.append(
                {
                    "gpu": label,
                    "utilization_ratio": utilization.gpu / 100 if utilization is not None else None,
                    "memory_utilization_ratio": utilization.memory / 100 if utilization is not None else None,
                    "memory_used_bytes": memory.used if memory is not None else None,
                    "memory_total_bytes": memory.total if memory is not None else None,
                    "power_watts": power_mw / 1000 if power_mw is not None else None,
                    "power_limit_watts": limit_mw / 1000 if limit_mw is not None else None,
                    "energy_joules": energy_mj / 1000 if energy_mj is not None else None,
                    "sm_clock_hz": sm_clock * 1e6 if sm_clock is not None else None,
                    "sm_clock_max_hz": sm_max * 1e6 if sm_max is not None else None,
                    "temperature_celsius": temperature,
                    "throttle_reasons": _reasons(reasons),
                    "pcie_rx_bytes_per_second": rx_kb * 1024 if rx_kb is not None else None,
                    "pcie_tx_bytes_per_second": tx_kb * 1024 if tx_kb is not None else None,
                    "process_memory_bytes": self._own_memory(processes),
                }
            )
        return samples

    def _own_memory(self, processes: Any) -> int | None:
        """This process's device memory: None (unknown) when NVML lists it under no pid of ours
        (a container's pid namespace) or cannot say how much (WDDM, some MIG setups)."""
        if processes is None:
            return None
        own = [p.usedGpuMemory for p in processes if p.pid in self.pids]
        if not own or any(used is None for used in own):
            return None
        return sum(own)

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
