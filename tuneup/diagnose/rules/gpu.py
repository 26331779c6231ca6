"""The GPU: idle or launch-bound, memory unused or under pressure, throttled clocks, left
unused altogether, and cuDNN's autotuner left off."""

from __future__ import annotations

from ...format import percent, size
from ..rule import Evidence, Facts, Missing, rule
from ...measure.history import nvml_utilization
from .compiled import LOW_STALL, compile_fix, launch_bound_share

CUDA_NOTES = "https://docs.pytorch.org/docs/stable/notes/cuda.html"
LAUNCH_BOUND_UTILIZATION = 0.70


def _utilization(facts: Facts) -> float:
    # facts.gpus raises Missing("NVML GPU samples") where none were taken; too few: below.
    utilization = nvml_utilization(facts.snapshot) if facts.gpus else None
    if utilization is None:
        raise Missing("GPU utilization samples")
    return utilization


@rule(
    id="gpu-launch-bound",
    title="The GPU is underused while the loop is not waiting for data",
    severity="medium",
    inputs="NVML utilization averaged over recent samples; stall ratio",
    threshold=f"GPU utilization < {percent(LAUNCH_BOUND_UTILIZATION)} with data wait < {percent(LOW_STALL)} of the step",
    why="With the input pipeline keeping up, an idle GPU means the host cannot launch kernels fast "
        "enough (many small kernels, Python overhead, syncs): bigger batches, CUDA graphs or "
        "torch.compile give the GPU larger units of work.",
    doc=f"{CUDA_NOTES}#cuda-graphs",
)
def gpu_launch_bound(facts: Facts) -> Evidence | None:
    if not facts.on_cuda:
        raise Missing("a CUDA job")
    try:
        if launch_bound_share(facts) is not None:
            return None  # compile-off says it, from the job's own GPU time per step
    except Missing:
        pass
    utilization = _utilization(facts)
    stall = facts.need(facts.window.get("stall_ratio"), "the data wait")
    if utilization >= LAUNCH_BOUND_UTILIZATION or stall >= LOW_STALL:
        return None
    return Evidence(
        observed=f"GPU utilization averaged {percent(utilization)} while data wait was {percent(stall)} of the step",
        numbers={"gpu_utilization": utilization, "stall_ratio": stall},
        fix=compile_fix(facts, graphs=True) + "   # fuses kernels, uses CUDA graphs\n"
            "# or a larger batch_size (scale the learning rate with it)",
        gain=1 - utilization,
        gain_text=f"up to {percent(1 - utilization)} more GPU work per second",
    )


MEMORY_UNUSED = 0.40


@rule(
    id="gpu-memory-unused",
    title="Most of the GPU's memory is unused",
    severity="low",
    inputs="allocator peak reserved memory and device total; NVML utilization",
    threshold=f"peak reserved < {percent(MEMORY_UNUSED)} of the device's memory while utilization < 90%",
    why="A larger batch (learning rate scaled with it) then fits and usually raises throughput; "
        "with the GPU already saturated a larger batch only changes the optimization.",
    doc="https://docs.pytorch.org/docs/stable/torch_cuda_memory.html",
)
def gpu_memory_unused(facts: Facts) -> Evidence | None:
    devices = facts.allocator
    used = max(d["reserved_peak_bytes"] / d["total_bytes"] for d in devices)
    utilization = _utilization(facts)
    if used >= MEMORY_UNUSED or utilization >= 0.9:
        return None
    return Evidence(
        observed=f"peak reserved memory is {percent(used)} of the GPU's {size(devices[0]['total_bytes'])}, "
                 f"utilization {percent(utilization)}",
        numbers={"peak_reserved_ratio": used, "gpu_utilization": utilization},
        fix="loader = DataLoader(dataset, batch_size=2 * batch_size, ...)\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=2 * lr)   # scale the LR with the batch",
        gain_text="more samples per second while the GPU is not saturated",
    )


MEMORY_FULL = 0.95


@rule(
    id="memory-pressure",
    title="GPU memory pressure: allocator retries or out-of-memory errors",
    severity="high",
    inputs="torch caching-allocator counters (retries, OOMs, reserved vs total)",
    threshold=f"any allocator retry or OOM, or reserved > {percent(MEMORY_FULL)} of the device",
    why="A retry means the allocator freed its whole cache and synchronized to satisfy an "
        "allocation: a stall on every occurrence, and the step before an OOM.",
    doc="https://docs.pytorch.org/docs/stable/checkpoint.html",
)
def memory_pressure(facts: Facts) -> Evidence | None:
    devices = facts.allocator
    retries = sum(d.get("alloc_retries") or 0 for d in devices)
    ooms = sum(d.get("ooms") or 0 for d in devices)
    full = max(d["reserved_bytes"] / d["total_bytes"] for d in devices)
    if not retries and not ooms and full <= MEMORY_FULL:
        return None
    return Evidence(
        observed=f"{retries} allocator retries, {ooms} OOMs, reserved memory at {percent(full)} of the device",
        numbers={"alloc_retries": retries, "ooms": ooms, "reserved_ratio": full},
        fix="from torch.utils.checkpoint import checkpoint\n"
            "x = checkpoint(block, x, use_reentrant=False)   # recompute activations in backward\n"
            "# or a smaller batch with gradient accumulation",
        gain_text="no allocator stalls (each retry frees the cache and synchronizes)",
    )


THROTTLED_SHARE = 0.2
CLOCK_DEFICIT = 0.10
_SLOWDOWN = {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}


@rule(
    id="gpu-throttling",
    title="The GPU's clocks are throttled by power or temperature",
    severity="medium",
    inputs="NVML clock throttle reasons, SM clock vs its maximum, temperature, power",
    threshold=f"a power/thermal throttle reason in >= {percent(THROTTLED_SHARE)} of samples and the SM clock "
              f">= {percent(CLOCK_DEFICIT)} below its maximum",
    why="Throttled clocks slow every kernel in proportion; the cause is outside the code "
        "(cooling, power cap, a noisy neighbour), so it is worth knowing before tuning the code.",
    doc="https://docs.nvidia.com/deploy/nvml-api/group__nvmlClocksEventReasons.html",
)
def gpu_throttling(facts: Facts) -> Evidence | None:
    worst = None
    for gpu in facts.gpus:
        reasons = {k: v for k, v in (gpu.get("throttle_reasons") or {}).items() if k in _SLOWDOWN}
        share = max(reasons.values(), default=0)
        clock, top = gpu.get("sm_clock_hz"), gpu.get("sm_clock_max_hz")
        if share < THROTTLED_SHARE or not clock or not top:
            continue
        deficit = 1 - clock / top
        if deficit >= CLOCK_DEFICIT and (worst is None or deficit > worst[1]):
            worst = (gpu, deficit, reasons)
    if worst is None:
        return None
    gpu, deficit, reasons = worst
    return Evidence(
        observed=f"GPU {gpu['gpu']} ran {percent(deficit)} below its maximum SM clock, throttled by "
                 + ", ".join(f"{k} ({percent(v)} of samples)" for k, v in reasons.items())
                 + (f", at {gpu['temperature_celsius']:.0f} °C" if gpu.get("temperature_celsius") else ""),
        numbers={"gpu": gpu["gpu"], "clock_deficit": deficit, "reasons": reasons,
                 "temperature_celsius": gpu.get("temperature_celsius"), "power_watts": gpu.get("power_watts")},
        fix="nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE   # check cooling and the power limit with your admin",
        gain=deficit,
    )


@rule(
    id="gpu-unused",
    title="A GPU is present but the job trains on the CPU",
    severity="high",
    inputs="NVML devices; the devices of the model's parameters and the batches",
    threshold="NVML reports a GPU and every measured parameter and batch is on the CPU",
    why="Training on the CPU beside an idle GPU is almost always a forgotten .to(device).",
    doc="https://docs.pytorch.org/docs/stable/notes/cuda.html",
)
def gpu_unused(facts: Facts) -> Evidence | None:
    facts.gpus  # noqa: B018 - raises Missing without NVML devices
    models = facts.models
    if facts.on_cuda or any(set(m.get("devices") or ()) - {"cpu"} for m in models):
        return None
    return Evidence(
        observed=f"{len(facts.gpus)} GPU(s) visible, the model's parameters are on the CPU",
        numbers={"gpus": len(facts.gpus)},
        fix='device = torch.device("cuda")\nmodel.to(device)\nx, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)',
        gain_text="GPU training: typically 10x or more",
    )


@rule(
    id="cudnn-benchmark-off",
    title="cudnn.benchmark is off for a convolutional model with static shapes",
    severity="medium",
    inputs="cudnn.benchmark, the model's convolutions, shapes of sampled batches, device",
    threshold="a CUDA job with convolutions, cudnn.benchmark off, and <= 2 distinct batch shapes over >= 5 sampled batches",
    why="With static shapes, cuDNN's autotuner picks the fastest convolution algorithm once "
        "per shape; with shapes that keep changing it re-tunes each time, hence the shape check "
        "(2 allows a smaller last batch). It must be set before the first convolution: cuDNN keeps "
        "the algorithm it chose for each shape already seen, whatever the flag says later.",
    doc="https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html#enable-cudnn-auto-tuner",
    can_apply=True,
)
def cudnn_benchmark_off(facts: Facts) -> Evidence | None:
    if not facts.on_cuda:
        raise Missing("a CUDA job")
    convolutions = sum(m.get("convolutions") or 0 for m in facts.models)
    if not convolutions or facts.config["backends"].get("cudnn_benchmark"):
        return None
    batches = facts.habits.get("batches") or {}
    if (batches.get("inspected") or 0) < 5:
        raise Missing("sampled batch shapes")
    if batches.get("distinct_shapes", 0) > 2 or facts.config["backends"].get("cudnn_deterministic"):
        return None
    return Evidence(
        observed=f"{convolutions} convolutions, input shapes static over {batches['inspected']} sampled batches, "
                 "cudnn.benchmark=False",
        numbers={"convolutions": convolutions, "distinct_shapes": batches.get("distinct_shapes"),
                 "sampled_batches": batches.get("inspected")},
        fix="torch.backends.cudnn.benchmark = True   # at start, before the first convolution\n"
            "# (set later it changes nothing for the shapes already run; tuneup run --apply sets it at start)",
        gain_text="faster convolutions (the autotuner's pick), often 10-30% of their time, from the next run",
    )
