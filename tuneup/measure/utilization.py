"""How much of the device a step's FLOPs reach: achieved FLOP/s and model FLOPs utilization
(MFU), from the count (flops.py) and the measured step time; and the dense peak FLOP/s by GPU
and precision that MFU divides by.

From NVIDIA's datasheets and architecture whitepapers, in TFLOP/s without 2:4 structured
sparsity (the datasheets mark their sparse figures "with sparsity": the dense ones are half;
each row's figures are its cited source's, so the H100 SXM row's are the whitepaper's 66.9/494.7
/989.4/1978.9 and the H200's its datasheet's 67/989/1979/3958 halved). Tensor-Core figures for
tf32/bf16/fp16/fp8; plain FP32 for fp32 (TF32 disallowed). A device is matched by the name
torch.cuda.get_device_name gives ("NVIDIA H100 80GB HBM3"), the first pattern that fits, and by
its compute capability (torch.cuda.get_device_capability) where the count read it: a row whose
capability is not the device's is passed over (a name that fits by chance: "NVIDIA A10" is an
8.6 part, a future "A100X" of another architecture would not be), and it tells what "tf32"
means where the row has no TF32 figure: before Ampere (capability < 8.0: V100, T4) there are no
TF32 units, and fp32 allowed to use TF32 runs in plain FP32. A device not here has an unknown
peak (MFU not stated, achieved FLOP/s still are): a wrong peak would be worse than none.

A step's FLOPs of different kinds can run in different precisions (fp32 matmuls with TF32
convolutions, fp8 matmuls beside bf16 ones: flops.py), and how the step's time splits among
them is not known. MFU divides by the FLOP-weighted peak: the time the step's FLOPs would take
at each kind's peak, over all of them (peak_eff = total / sum(flops_k / peak_k)), the harmonic
mean; one unknown kind's peak leaves the step's unknown.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

_HOPPER = ("https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper (NVIDIA H100 Tensor Core GPU "
           "Architecture whitepaper, H100 SXM5 column)")
_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 datasheet)"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 datasheet)"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_L4 = "https://www.nvidia.com/en-us/data-center/l4/ (L4 datasheet)"
_L40S = "https://www.nvidia.com/en-us/data-center/l40s/ (L40S datasheet)"
_A10 = "https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (A10 datasheet)"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_V100S = ("https://www.nvidia.com/en-us/data-center/v100/ (V100 datasheet's specifications, V100S PCIe column: "
          "16.4 TF single precision, 130 TF tensor)")
_T4 = "https://www.nvidia.com/en-us/data-center/tesla-t4/ (T4 datasheet)"
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (Appendix A)"

# (name pattern, compute capability, TFLOP/s by precision, source); the first match wins
# (PCIe/NVL before SXM, V100S before V100).
PEAKS: list[tuple[str, tuple[int, int], dict[str, float], str]] = [
    (r"H100.*PCIe", (9, 0), {"fp32": 51.0, "tf32": 378.0, "bfloat16": 756.5, "float16": 756.5, "fp8": 1513.0}, _H100),
    (r"H100.*NVL", (9, 0), {"fp32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "fp8": 1670.5}, _H100),
    (r"H200.*NVL", (9, 0), {"fp32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "fp8": 1670.5}, _H200),
    (r"GH200|H200", (9, 0), {"fp32": 67.0, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5, "fp8": 1979.0}, _H200),
    (r"H100", (9, 0), {"fp32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "fp8": 1978.9}, _HOPPER),
    (r"A100", (8, 0), {"fp32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}, _A100),
    (r"L40S", (8, 9), {"fp32": 91.6, "tf32": 183.0, "bfloat16": 362.05, "float16": 362.05, "fp8": 733.0}, _L40S),
    (r"\bL4\b", (8, 9), {"fp32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0, "fp8": 242.5}, _L4),
    (r"\bA10\b", (8, 6), {"fp32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0}, _A10),
    (r"V100S", (7, 0), {"fp32": 16.4, "float16": 130.0}, _V100S),
    (r"V100.*PCIE", (7, 0), {"fp32": 14.0, "float16": 112.0}, _V100),
    (r"V100", (7, 0), {"fp32": 15.7, "float16": 125.0}, _V100),
    (r"\bT4\b", (7, 5), {"fp32": 8.1, "float16": 65.0}, _T4),
    (r"RTX 4090", (8, 9), {"fp32": 82.6, "tf32": 82.6, "bfloat16": 165.2, "float16": 165.2, "fp8": 330.3}, _ADA),
]
TF32_FROM = (8, 0)  # Ampere: the first Tensor Cores with TF32


def peak(device_name: str | None, precision: str | None,
         capability: Sequence[int] | None = None) -> dict[str, Any] | None:
    """{"flops_per_second", "source", "device"} for `device_name` (of compute `capability`,
    where known) at `precision` ("fp32", "tf32", "bfloat16", "float16", "fp8" or a float32
    that TF32 does not apply to), or None."""
    if not device_name or not precision:
        return None
    key = "fp32" if precision == "float32" else precision
    known = tuple(capability) if capability else None
    for pattern, row_capability, table, source in PEAKS:
        if not re.search(pattern, device_name, re.IGNORECASE) or (known and known != row_capability):
            continue
        value = table.get(key)
        if value is None and key == "tf32" and row_capability < TF32_FROM:
            value = table.get("fp32")  # no TF32 units: fp32 allowed TF32 runs in FP32
        return {"flops_per_second": value * 1e12, "source": source, "device": device_name} if value else None
    return None


def step_peak(flops: dict[str, Any]) -> dict[str, Any] | None:
    """The dense peak for a count's FLOPs (flops.py summary): each kind's precision's peak,
    FLOP-weighted (the module's docstring); the dtype's alone for a count without kinds."""
    name, capability = flops.get("device_name"), flops.get("capability")
    by_kind = {kind: value for kind, value in (flops.get("flops_by_kind") or {}).items() if value}
    precisions = flops.get("precisions") or {}
    if not by_kind or not all(kind in precisions for kind in by_kind):
        return peak(name, flops.get("dtype"), capability)
    found = {kind: peak(name, precisions[kind], capability) for kind in by_kind}
    if any(value is None for value in found.values()):
        return None
    seconds = sum(by_kind[kind] / found[kind]["flops_per_second"] for kind in by_kind)
    return {"flops_per_second": sum(by_kind.values()) / seconds,
            "source": "; ".join(dict.fromkeys(value["source"] for value in found.values())), "device": name}


def utilization(flops: dict[str, Any] | None, window: dict[str, Any] | None) -> dict[str, Any] | None:
    """FLOPs per step (a batch's count times the backward passes a step runs: gradient
    accumulation), achieved FLOP/s over the measured steps (data waits included: MFU's
    convention, the time the hardware could have worked) and, where the device's dense peak for
    the step's precision is known (PEAKS), MFU. None without a count or steps; a count that
    could not run gives its reason."""
    if not flops:
        return None
    if flops.get("skipped"):
        return {"skipped": flops["skipped"]}
    if not window or not window.get("steps_per_second") or not flops.get("flops"):
        return None
    # The detail steps' mean: a step of 4 accumulated batches reads 4 (a run's first step, with
    # a backward before tuneup saw its optimizer, may read 2): rounded.
    passes = max(1, round(window.get("backward_passes_per_step") or 1))
    per_step = flops["flops"] * passes
    achieved = per_step * window["steps_per_second"]
    found = step_peak(flops) if flops.get("device") == "cuda" else None
    by_kind = {kind: value for kind, value in (flops.get("flops_by_kind") or {}).items() if value}
    whole = sum(by_kind.values()) or 1
    kinds = [{"kind": kind, "precision": (flops.get("precisions") or {}).get(kind), "share": value / whole}
             for kind, value in sorted(by_kind.items(), key=lambda item: -item[1])]
    return {"flops_per_step": per_step, "achieved_flops_per_second": achieved, "precision": flops.get("dtype"),
            "kinds": kinds,
            "device": flops.get("device_name") or flops.get("device"),
            "peak_flops_per_second": found["flops_per_second"] if found else None,
            "peak_source": found["source"] if found else None,
            "mfu": achieved / found["flops_per_second"] if found else None,
            "estimate": (flops.get("counts") or 1) > 1}


def energy(samples: Sequence[dict[str, Any]], window: dict[str, Any] | None) -> dict[str, Any] | None:
    """Joules a step and a sample over the window's system samples, for the GPUs the job holds
    memory on (every GPU sampled where NVML cannot tell): from NVML's energy counter where each
    has one (its rise from the first sample to the last over their time: the mean power), else
    the sampled power draws' mean (power x time: an estimate, said so). None without GPU samples
    or steps."""
    if not window or not window.get("steps_per_second"):
        return None
    rows: dict[Any, list[tuple[Any, Any, Any, Any]]] = {}
    for sample in samples:
        for device in ((sample.get("gpu") or {}).get("samples") or []):
            rows.setdefault(device.get("gpu", 0), []).append((sample.get("time"), device.get("energy_joules"),
                                                             device.get("power_watts"), device.get("process_memory_bytes")))
    used = {gpu: values for gpu, values in rows.items() if any(memory for *_, memory in values)} or rows
    if not used:
        return None
    watts, counted = 0.0, True
    for values in used.values():
        read = [(when, joules) for when, joules, _, _ in values if when is not None and joules is not None]
        span = read[-1][0] - read[0][0] if len(read) >= 2 else 0.0
        rise = read[-1][1] - read[0][1] if len(read) >= 2 else -1.0
        if span > 0 and rise >= 0:  # a fall: a 32-bit counter wrapped, or the driver reloaded
            watts += rise / span
            continue
        draws = [power for _, _, power, _ in values if power is not None]
        if not draws:
            return None
        watts += sum(draws) / len(draws)
        counted = False
    out = {"watts": watts, "joules_per_step": watts / window["steps_per_second"], "gpus": len(used),
           "source": "NVML energy counter" if counted else "power draw x time (an estimate)",
           "joules_per_sample": watts / window["samples_per_second"] if window.get("samples_per_second") else None}
    return out

