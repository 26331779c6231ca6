"""A stand-in for pynvml with the same functions, for machines without an NVIDIA driver.

Only the driver is fake: tuneup's NVML backend runs unchanged on it. Configure through
module attributes (in-process tests) or FAKE_NVML_* environment variables (subprocesses):
FAKE_NVML_GPUS (count), FAKE_NVML_FAIL_AFTER (raise a driver error from the Nth
utilization read on), FAKE_NVML_NO_POWER (power readings not supported), FAKE_NVML_NO_ENERGY (no energy counter: a GPU before
Volta; "1" every GPU, or the indices of those without one, "1,3": a node that mixes them),
FAKE_NVML_UTILIZATION (GPU utilization percent of GPU 0; GPU i reads that plus i).

`reset()` also takes: `mig` ({gpu index: instances}: MIG mode on those GPUs), `old_driver`
(a driver older than the binding: the v3 process list and the clock-event reasons are missing
symbols, the temperature struct version is unknown), `pids` (the pids the driver lists for this
process's memory: the host's, as in a container; default this process's own), `own_gpu` (the
one GPU that memory is on, FAKE_NVML_OWN_GPU: one rank of a node whose GPUs it all sees;
default every GPU).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999
_MESSAGES = {3: "Not Supported", 6: "Not Found", 13: "Function Not Found", 15: "GPU is lost",
             25: "Argument version mismatch", 999: "Unknown Error"}


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(_MESSAGES.get(value, str(value)))
        self.value = value


class NVMLLibraryMismatchError(Exception):
    """nvidia-ml-py's error for an unversioned call the library cannot match (throwOnVersionMismatch)."""


gpus = int(os.environ.get("FAKE_NVML_GPUS", "2"))
fail_after = int(os.environ.get("FAKE_NVML_FAIL_AFTER", "0"))  # 0: never
no_power = os.environ.get("FAKE_NVML_NO_POWER") == "1"


def _without_energy(value: str | None) -> bool | frozenset[int]:
    """True (every GPU), the GPU indices listed, or False."""
    if not value:
        return False
    if value == "1":
        return True
    return frozenset(int(index) for index in value.split(","))


# GPUs without an energy counter (a GPU before Volta): True for all, or a set of indices.
no_energy: bool | frozenset[int] = _without_energy(os.environ.get("FAKE_NVML_NO_ENERGY"))
utilization = int(os.environ.get("FAKE_NVML_UTILIZATION", "37"))
throttle_mask = 0x4 | 0x40  # sw power cap + hw thermal
utilization_reads = 0
initialized = False
own_pid_memory = 512 * 2**20
mig: dict[int, int] = {}
old_driver = False
pids: tuple[int, ...] | None = None
own_gpu: int | None = int(os.environ["FAKE_NVML_OWN_GPU"]) if os.environ.get("FAKE_NVML_OWN_GPU") else None


def reset(**settings) -> None:
    global gpus, fail_after, no_power, no_energy, utilization_reads, initialized, throttle_mask, mig, old_driver, pids, own_gpu
    gpus, fail_after, no_power = settings.get("gpus", 2), settings.get("fail_after", 0), settings.get("no_power", False)
    no_energy = settings.get("no_energy", False)  # True, or the indices of the GPUs without a counter
    if not isinstance(no_energy, bool):
        no_energy = frozenset(no_energy)
    throttle_mask = settings.get("throttle_mask", 0x4 | 0x40)
    mig, old_driver, pids = settings.get("mig", {}), settings.get("old_driver", False), settings.get("pids")
    own_gpu = settings.get("own_gpu")
    utilization_reads = 0
    initialized = False


def _handle(handle):
    if not initialized:
        raise NVMLError(1)
    return handle


def nvmlInit():
    global initialized
    initialized = True


def nvmlShutdown():
    global initialized
    initialized = False


def nvmlDeviceGetCount():
    return gpus


def nvmlDeviceGetHandleByIndex(index):
    if index >= gpus:
        raise NVMLError(2)
    return _handle(SimpleNamespace(index=index))


def nvmlDeviceGetName(handle):
    return "Fake H100 80GB HBM3"


def nvmlDeviceGetUUID(handle):
    if getattr(handle, "slot", None) is not None:
        return f"MIG-fake-{handle.index:04d}-{handle.slot}"
    return f"GPU-fake-{handle.index:04d}"


def nvmlDeviceGetMaxMigDeviceCount(handle):
    if handle.index not in mig:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(handle, slot):
    if slot >= mig.get(handle.index, 0):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return _handle(SimpleNamespace(index=handle.index, slot=slot))


def nvmlDeviceGetUtilizationRates(handle):
    global utilization_reads
    if getattr(handle, "slot", None) is not None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # not per MIG instance
    utilization_reads += 1
    if fail_after and utilization_reads >= fail_after:
        raise NVMLError(15)
    return SimpleNamespace(gpu=utilization + handle.index, memory=12)


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=80 * 2**30, used=20 * 2**30, free=60 * 2**30)


def nvmlDeviceGetPowerUsage(handle):
    if no_power:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return 350_000  # milliwatts


def nvmlDeviceGetTotalEnergyConsumption(handle):
    """Millijoules since the driver loaded (a uint64 in nvidia-ml-py): 350 W since the process
    started, on a counter that was already far along."""
    _handle(handle)
    if no_power or no_energy is True or (no_energy and handle.index in no_energy):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return 9_000_000_000 + int(time.monotonic() * 350_000)


def nvmlDeviceGetEnforcedPowerLimit(handle):
    if no_power:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return 700_000


def nvmlDeviceGetClockInfo(handle, clock):
    return 1755


def nvmlDeviceGetMaxClockInfo(handle, clock):
    return 1980


def nvmlDeviceGetTemperature(handle, sensor):
    if old_driver:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return 61


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    if old_driver:
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)  # the library has no such symbol
    return throttle_mask


def nvmlDeviceGetPcieThroughput(handle, counter):
    return 2048 if counter == NVML_PCIE_UTIL_RX_BYTES else 1024  # KB/s


def nvmlDeviceGetComputeRunningProcesses(handle):
    if old_driver:
        raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")
    mine = own_gpu is None or _handle(handle).index == own_gpu
    return [SimpleNamespace(pid=pid, usedGpuMemory=own_pid_memory) for pid in (pids or (os.getpid(),)) if mine] + [
        SimpleNamespace(pid=1, usedGpuMemory=2**30),
    ]
