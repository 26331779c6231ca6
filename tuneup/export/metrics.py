"""The metric catalog (docs/metrics.md): Prometheus collectors that read state the agent
already holds, at scrape time. Nothing runs between scrapes and a scrape never touches the
training thread: step figures are the background thread's running totals (monotonic, so a
scrape between two of its updates still reads valid counters), GPU, allocator and host
figures its latest sample, findings its latest evaluation.

Every `tuneup_` family carries the job's `rank` and `local_rank` (0 and 0 outside torchrun);
the process/platform/GC families are prometheus-client's own collectors.

A section that fails is left out of that scrape with one warning, so one bad value never
costs the whole endpoint.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..measure.gpu import THROTTLE_REASONS
from ..measure.utilization import utilization
from ..measure.windows import STEP_BUCKETS

COMPUTE_WINDOW = 256  # steps the achieved FLOP/s and MFU gauges are over

# Every agent series: its rank, and the training job its ranks share (measure/state.py
# training_job): Prometheus' recording rules aggregate a job's ranks by it.
BASE_LABELS = ("rank", "local_rank", "training_job")
DECISIONS = ("kept", "set at start", "reverted", "rolled back", "failed", "not applicable", "stopped")
PHASES = (("data_wait", "detailed_data_wait_seconds"), ("input", "input_seconds"), ("forward", "forward_seconds"),
          ("backward", "backward_seconds"), ("optimizer", "optimizer_seconds"), ("other", "detailed_other_seconds"))

# NVML sample field -> (metric suffix, help). Shared with the node daemon's tuneup_node_gpu_*.
GPU_FIELDS = (
    ("utilization_ratio", "utilization_ratio", "Share of the last sample period a kernel ran on the GPU"),
    ("memory_utilization_ratio", "memory_utilization_ratio", "Share of the period device memory was read or written"),
    ("memory_used_bytes", "memory_used_bytes", "Device memory in use, all processes"),
    ("memory_total_bytes", "memory_total_bytes", "Device memory size"),
    ("power_watts", "power_watts", "GPU power draw"),
    ("power_limit_watts", "power_limit_watts", "Enforced GPU power limit"),
    ("sm_clock_hz", "sm_clock_hertz", "SM clock"),
    ("sm_clock_max_hz", "sm_clock_max_hertz", "Maximum SM clock"),
    ("temperature_celsius", "temperature_celsius", "GPU temperature"),
    ("pcie_rx_bytes_per_second", "pcie_rx_bytes_per_second", "PCIe receive throughput"),
    ("pcie_tx_bytes_per_second", "pcie_tx_bytes_per_second", "PCIe transmit throughput"),
)

ALLOCATOR_GAUGES = (
    ("allocated_bytes", "tuneup_cuda_memory_allocated_bytes", "Device memory held by tensors (caching allocator)"),
    ("allocated_peak_bytes", "tuneup_cuda_memory_allocated_peak_bytes", "Peak device memory held by tensors"),
    ("reserved_bytes", "tuneup_cuda_memory_reserved_bytes", "Device memory the caching allocator holds"),
    ("reserved_peak_bytes", "tuneup_cuda_memory_reserved_peak_bytes", "Peak device memory the caching allocator held"),
)
ALLOCATOR_COUNTERS = (
    ("alloc_retries", "tuneup_cuda_alloc_retries", "Allocations that freed the allocator's cache and retried"),
    ("ooms", "tuneup_cuda_ooms", "Out-of-memory errors the caching allocator raised"),
)


class Families:
    """Builds metric families that all start with the same labels (the job's rank)."""

    def __init__(self, names: Sequence[str], values: Sequence[str]) -> None:
        self.names = list(names)
        self.values = list(values)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=self.names + list(labels))

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=self.names + list(labels))

    def add(self, family: Metric, value: float, *labels: str) -> Metric:
        family.add_metric(self.values + list(labels), value)  # type: ignore[attr-defined]
        return family

    def single(self, kind: str, name: str, doc: str, value: float) -> Metric:
        return self.add(getattr(self, kind)(name, doc), value)


def gpu_families(prefix: str, samples: list[dict[str, Any]], families: Families) -> Iterator[Metric]:
    """NVML samples (measure/gpu.py) as `<prefix>_*` gauges by `gpu`; a field the GPU does not
    support is left out rather than reported as zero."""
    for field, suffix, doc in GPU_FIELDS:
        family = families.gauge(f"{prefix}_{suffix}", doc, ["gpu"])
        for sample in samples:
            if sample.get(field) is not None:
                families.add(family, sample[field], str(sample["gpu"]))
        yield family
    energy = families.counter(f"{prefix}_energy_joules", "Energy the GPU used since its driver loaded (NVML's "
                              "counter; absent on GPUs without one)", ["gpu"])
    for sample in samples:
        if sample.get("energy_joules") is not None:
            families.add(energy, sample["energy_joules"], str(sample["gpu"]))
    yield energy
    throttled = families.gauge(f"{prefix}_throttled", "1 while the GPU's clocks are held down for this reason",
                               ["gpu", "reason"])
    for sample in samples:
        if sample.get("throttle_reasons") is not None:
            active = set(sample["throttle_reasons"])
            for reason in THROTTLE_REASONS.values():
                families.add(throttled, 1.0 if reason in active else 0.0, str(sample["gpu"]), reason)
    yield throttled


def gpu_info(prefix: str, devices: list[dict[str, Any]], families: Families) -> Metric:
    info = InfoMetricFamily(f"{prefix}", "The GPU's model and UUID (join with DCGM's UUID label); `gpu` is "
                            "its CUDA ordinal in the job, nvml_index NVML's (and DCGM's) number for it",
                            labels=families.names + ["gpu"])
    for device in devices:
        info.add_metric(families.values + [str(device["gpu"])],
                        {"name": str(device.get("name") or ""), "uuid": str(device.get("uuid") or ""),
                         "nvml_index": str(device.get("nvml_index", device["gpu"])),
                         "mig": "true" if device.get("mig") else "false"})
    return info


class AgentCollector(Collector):
    """The agent's whole catalog except apply mode (ApplyCollector), read from the run's read
    model (measure/state.py RunState)."""

    def __init__(self, state: Any, warn: Callable[[str, str], None]) -> None:
        self.state = state
        self.warn = warn
        self.families = Families(BASE_LABELS, [_label(state.rank), _label(state.local_rank),
                                               str(state.run_info["training_job"])])
        self.sections: tuple[Callable[[], Iterator[Metric]], ...] = (
            self.run, self.steps, self.compute, self.compiled, self.collections, self.syncs, self.scaler, self.loss, self.gpu, self.allocator,
            self.host, self.ddp, self.findings, self.health)

    def collect(self) -> Iterator[Metric]:
        for section in self.sections:
            try:
                families = list(section())
            except Exception as exc:  # one section's bad value never costs the whole scrape
                self.warn("metrics", f"metric section {section.__name__} left out of scrapes after an internal "
                                     f"error: {type(exc).__name__}: {exc}")
                continue
            yield from families

    def run(self) -> Iterator[Metric]:
        state, f = self.state, self.families
        info = state.run_info
        argv = info.get("argv") or [""]
        family = InfoMetricFamily("tuneup_run", "The training job: its run id, script and settings",
                                  labels=f.names)
        family.add_metric(f.values, {
            "run_id": str(info["run_id"]), "script": Path(str(argv[0])).name if argv[0] != "-m" else " ".join(argv[:2]),
            "mode": str(info["mode"]), "world_size": _label(info.get("world_size"), "1"),
            "tuneup_version": str(info["tuneup"]), "torch_version": str(info["torch"])})
        yield family
        yield f.single("gauge", "tuneup_run_start_time_seconds", "When the agent attached (unix time)",
                       info["started_at"])
        last = state.totals.last_step_time
        if last is not None:
            yield f.single("gauge", "tuneup_last_step_time_seconds", "When the last measured step ended (unix time)",
                           last)

    def steps(self) -> Iterator[Metric]:
        f = self.families
        totals = self.state.totals
        sums = dict(totals.sums)
        counts = list(totals.step_buckets)
        histogram = HistogramMetricFamily("tuneup_step_seconds", "Wall time of each training step (optimizer step "
                                          "to optimizer step)", labels=f.names, unit="seconds")
        cumulative, buckets = 0, []
        for bound, count in zip(STEP_BUCKETS + (float("inf"),), counts):
            cumulative += count
            buckets.append((_bound(bound), cumulative))
        # The sum over exactly the steps the buckets count (both come from the same drains).
        histogram.add_metric(f.values, buckets, sums["seconds"])
        yield histogram
        yield f.single("counter", "tuneup_data_wait_seconds", "Time the training loop waited on the DataLoader",
                       sums["data_wait_seconds"])
        yield f.single("counter", "tuneup_samples", "Samples trained on (dim 0 of each batch)", sums["samples"])
        yield f.single("counter", "tuneup_optimizer_steps", "Optimizer updates applied (GradScaler-skipped steps are not)",
                       sums["optimizer_steps"])
        yield f.single("counter", "tuneup_detail_steps", "Steps whose time was split into phases",
                       sums["detailed_steps"])
        yield f.single("counter", "tuneup_own_seconds", "Time tuneup's own work took on the training thread "
                       "between steps (one-off trials; kept out of tuneup_step_seconds)", sums["own_seconds"])
        phases = f.counter("tuneup_step_phase_seconds", "Time of the detail steps, by phase", ["phase"])
        for phase, key in PHASES:
            if phase == "forward" and not self.state.recorder.model.timed:
                continue  # no model timed: the forward is part of "other"
            f.add(phases, sums[key], phase)
        yield phases

    def compute(self) -> Iterator[Metric]:
        """A step's FLOPs (counted on the model's shapes, measure/flops.py) and what they reach
        over the last COMPUTE_WINDOW steps (measure/utilization.py); nothing before a count."""
        f = self.families
        recorder = self.state.recorder
        if recorder is None:
            return
        figures = utilization(recorder.flops.summary(), recorder.window(COMPUTE_WINDOW))
        if not figures or figures.get("skipped"):
            return
        yield f.single("gauge", "tuneup_step_flops", "FLOPs of one training step (forward and backward, counted on "
                       "the model's shapes)", figures["flops_per_step"])
        yield f.single("gauge", "tuneup_achieved_flops_per_second", "The step's FLOPs over the measured step time "
                       f"(the last {COMPUTE_WINDOW} steps, data waits included)", figures["achieved_flops_per_second"])
        if figures["mfu"] is not None:
            family = f.gauge("tuneup_model_flops_utilization", "Achieved FLOP/s over the device's dense peak for the "
                             "step's precision (0-1)", ["precision"])
            yield f.add(family, figures["mfu"], str(figures["precision"]))

    def compiled(self) -> Iterator[Metric]:
        """torch.compile's work (measure/compiled.py); nothing for a job that never loaded dynamo."""
        f = self.families
        summary = self.state.recorder.compile.summary()
        if summary is None:
            return
        yield f.single("counter", "tuneup_compile_seconds", "Time torch.compile spent compiling (kept out of the "
                       "step times)", summary["seconds"])
        yield f.single("counter", "tuneup_compiles", "torch.compile compilations (first compiles and recompiles)",
                       summary["compiles"])
        yield f.single("counter", "tuneup_recompiles", "torch.compile recompilations (a guard failed)",
                       summary["recompiles"])
        yield f.single("counter", "tuneup_graph_breaks", "Graph breaks torch.compile met while compiling",
                       summary["graph_breaks"])
        yield f.single("gauge", "tuneup_compiled_graphs", "Graphs torch.compile holds for the job", summary["graphs"])

    def collections(self) -> Iterator[Metric]:
        """Python's garbage collections from the first step on, by generation (measure/gc_pauses.py)."""
        f = self.families
        summary = self.state.recorder.collector.summary()
        counts = f.counter("tuneup_gc_collections", "Python garbage collections while the job trained, by "
                           "generation (2: full)", ["generation"])
        pauses = f.counter("tuneup_gc_pause_seconds", "Time Python's garbage collections stopped the job (the GIL "
                           "held), by generation", ["generation"])
        for generation, (count, spent) in enumerate(zip(summary["collections"], summary["seconds"])):
            f.add(counts, count, str(generation))
            f.add(pauses, spent, str(generation))
        yield counts
        yield pauses

    def syncs(self) -> Iterator[Metric]:
        f = self.families
        counter = self.state.recorder.syncs
        yield f.single("counter", "tuneup_sync_sampled_steps", "Steps the host-device syncs were counted on",
                       counter.sampled_steps)
        kinds = f.counter("tuneup_syncs", "Host-device syncs on the sampled steps (on CPU: host reads that would "
                                          "sync on a GPU), by kind", ["kind"])
        for kind, count in sorted(dict(counter.by_kind).items()):
            f.add(kinds, count, kind)
        yield kinds

    def scaler(self) -> Iterator[Metric]:
        f = self.families
        summary = self.state.recorder.scaler.summary()
        if not summary["present"]:
            return
        yield f.single("gauge", "tuneup_grad_scaler_enabled", "1 while the GradScaler is enabled",
                       1.0 if summary["enabled"] else 0.0)
        if summary["scale"] is not None:
            yield f.single("gauge", "tuneup_grad_scaler_scale", "The GradScaler's current loss scale", summary["scale"])
        yield f.single("counter", "tuneup_grad_scaler_steps", "Optimizer steps taken through scaler.step()",
                       summary["steps"])
        yield f.single("counter", "tuneup_grad_scaler_skipped_steps",
                       "Optimizer steps the GradScaler skipped for inf/NaN gradients", summary["skipped_steps"])
        yield f.single("counter", "tuneup_grad_scaler_growths", "Times the loss scale grew", summary["growth_events"])
        yield f.single("counter", "tuneup_grad_scaler_backoffs", "Times the loss scale backed off",
                       summary["backoff_events"])

    def loss(self) -> Iterator[Metric]:
        f = self.families
        totals = self.state.totals
        if totals.last_loss is not None:
            yield f.single("gauge", "tuneup_loss", "The last loss read (before scaling; NaN when not finite)",
                           totals.last_loss)
        yield f.single("counter", "tuneup_losses_read", "Losses read (detail steps, asynchronously)",
                       totals.sums["losses_read"])
        yield f.single("counter", "tuneup_nonfinite_losses", "Losses read that were NaN or infinite",
                       totals.sums["nonfinite_losses"])
        config = self.state.recorder.config if self.state.recorder is not None else None
        rates = [(index, optimizer, (optimizer.get("lr_measured") or {}).get("last", optimizer.get("lr")))
                 for index, optimizer in enumerate((config or {}).get("optimizers") or [])]
        if any(isinstance(lr, (int, float)) for _, _, lr in rates):
            family = f.gauge("tuneup_learning_rate", "Each optimizer's learning rate as the job ran it (first param "
                                                     "group; read on detail steps, as of the last configuration read)",
                             ["optimizer", "index"])
            for index, optimizer, lr in rates:
                if isinstance(lr, (int, float)):
                    f.add(family, float(lr), str(optimizer["class"]), str(index))
            yield family

    def gpu(self) -> Iterator[Metric]:
        """The GPUs this process holds memory on (one rank's of a node's eight: the series budget
        is per own GPU); every GPU it sees where NVML cannot tell (no per-process memory, as in
        many containers) or before it has allocated any."""
        system = self.state.system or {}
        gpu = system.get("gpu") or {}
        if not gpu.get("available"):
            return
        f = self.families
        samples = gpu.get("samples") or []
        own = {str(s["gpu"]) for s in samples if (s.get("process_memory_bytes") or 0) > 0}
        if own:
            samples = [s for s in samples if str(s["gpu"]) in own]
        devices = [d for d in gpu.get("devices") or [] if not own or str(d["gpu"]) in own]
        yield gpu_info("tuneup_gpu", devices, f)
        yield from gpu_families("tuneup_gpu", samples, f)
        memory = f.gauge("tuneup_gpu_process_memory_bytes", "Device memory held by this job's process", ["gpu"])
        for sample in samples:
            if sample.get("process_memory_bytes") is not None:
                f.add(memory, sample["process_memory_bytes"], str(sample["gpu"]))
        yield memory

    def allocator(self) -> Iterator[Metric]:
        memory = (self.state.system or {}).get("memory") or {}
        if not memory.get("available"):
            return
        f = self.families
        devices = memory.get("devices") or []
        for key, name, doc in ALLOCATOR_GAUGES:
            family = f.gauge(name, doc, ["gpu"])
            for device in devices:
                f.add(family, device[key], str(device["device"]))
            yield family
        for key, name, doc in ALLOCATOR_COUNTERS:
            family = f.counter(name, doc, ["gpu"])
            for device in devices:
                f.add(family, device[key], str(device["device"]))
            yield family

    def host(self) -> Iterator[Metric]:
        host = (self.state.system or {}).get("host")
        if not host:
            return
        f = self.families
        yield f.single("gauge", "tuneup_usable_cores", "Cores the job may use (CPU affinity, cgroup quota)",
                       host["usable_cores"])
        yield f.single("gauge", "tuneup_dataloader_workers", "Live DataLoader worker processes", host["workers"])
        yield f.single("gauge", "tuneup_dataloader_workers_cpu_ratio",
                       "CPU the DataLoader workers use together (1 = one core busy)", host["workers_cpu_ratio"])
        yield f.single("gauge", "tuneup_dataloader_workers_resident_memory_bytes",
                       "Resident memory of the DataLoader workers together", host["workers_rss_bytes"])
        if host.get("step_cpu_wait_seconds") is not None:
            yield f.single("gauge", "tuneup_cpu_wait_seconds_per_step",
                           "Time per step the job's threads were runnable and had no CPU (Linux run-queue wait, "
                           "summed over its threads, tuneup's left out; over the rolling window's steps)",
                           host["step_cpu_wait_seconds"])

    def ddp(self) -> Iterator[Metric]:
        ddp = (self.state.system or {}).get("ddp") or {}
        if not ddp.get("iterations_sampled"):
            return
        f = self.families
        yield f.single("gauge", "tuneup_ddp_allreduce_wait_seconds",
                       "Time per step this rank waited in DDP's all-reduce after its own gradients were ready "
                       "(DDP's timers, the lower quartile of its last sampled iterations: the wait it has at "
                       "nearly every one): the slow rank waits least",
                       ddp["allreduce_wait_seconds"])
        yield f.single("gauge", "tuneup_ddp_backward_compute_seconds",
                       "Backward compute time per step, without the all-reduce wait (DDP's timers)",
                       ddp["backward_compute_seconds"])

    def findings(self) -> Iterator[Metric]:
        f = self.families
        current = self.state.findings_now
        active = f.gauge("tuneup_finding_active", "1 for each current finding (see `tuneup rules`)",
                         ["rule", "severity"])
        gain = f.gauge("tuneup_finding_gain_ratio", "A finding's estimated gain: the share of step time its fix "
                                                    "would save", ["rule"])
        for finding in current:
            f.add(active, 1.0, finding.rule, finding.severity)
            if finding.gain is not None:
                f.add(gain, finding.gain, finding.rule)
        yield active
        yield gain

    def health(self) -> Iterator[Metric]:
        f = self.families
        up = f.gauge("tuneup_probe_up", "1 while the probe works, 0 after it turned itself off (see its warning)",
                     ["probe"])
        for probe, state in sorted(self.state.probe_states().items()):
            if state == "on":
                f.add(up, 1.0, probe)
            elif state == "off" or state.startswith("stopped"):
                f.add(up, 0.0, probe)
            # anything else was turned off on purpose or has nothing to measure: no series
        yield up
        yield f.single("counter", "tuneup_warnings", "Warnings the agent emitted", len(self.state.warnings))


class ApplyCollector(Collector):
    """Apply mode's decisions and the changes in effect, by action id (a handful of values)."""

    def __init__(self, experimenter: Any, families: Families) -> None:
        self.experimenter = experimenter
        self.families = families

    def collect(self) -> Iterator[Metric]:
        f = self.families
        records = [dict(record) for record in list(self.experimenter.records)]
        state = self.experimenter.state()
        decided = f.counter("tuneup_apply_decisions", "Changes apply mode tried and decided on, by action and decision",
                            ["action", "decision"])
        for (action, decision), count in sorted(Counter(
                (r["action"], r["decision"]) for r in records if r["decision"] in DECISIONS).items()):
            f.add(decided, count, action, decision.replace(" ", "_"))
        yield decided
        in_effect = set(state["in_effect"])
        effect = f.gauge("tuneup_apply_changes_in_effect",
                         "Changes apply mode made that are in effect now (on trial or kept)", ["action"])
        trial = f.gauge("tuneup_apply_on_trial", "1 while a change of this action is on trial", ["action"])
        speedup = f.gauge("tuneup_apply_speedup_ratio", "Measured speed-up of the kept changes in effect (mean step "
                                                        "time before / after, multiplied over the action's changes)",
                          ["action"])
        for action in sorted({r["action"] for r in records}):
            mine = [r for r in records if r["action"] == action]
            f.add(effect, sum(1 for r in mine if r["id"] in in_effect), action)
            f.add(trial, 1 if any(r["id"] == state["on_trial"] for r in mine) else 0, action)
            ratio = 1.0
            for record in mine:
                if record["id"] in in_effect and record["decision"] == "kept" and record.get("speedup"):
                    ratio *= record["speedup"]
            f.add(speedup, ratio, action)
        yield effect
        yield trial
        yield speedup


def agent_registry(state: Any, experimenter: Any, warn: Callable[[str, str], None]) -> CollectorRegistry:
    """Everything the agent exports: its catalog (read from `state`, the read model), apply
    mode's decisions (`experimenter`, or None) and prometheus-client's process, platform and
    garbage-collector collectors."""
    registry = CollectorRegistry(auto_describe=True)
    collector = AgentCollector(state, warn)
    registry.register(collector)
    if experimenter is not None:
        registry.register(ApplyCollector(experimenter, collector.families))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def _label(value: Any, default: str = "0") -> str:
    return default if value is None else str(value)


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))
