"""Rules that cannot be observed on a CPU-only machine (GPU, CUDA, several ranks), tested
on recorded inputs: a real CPU run's snapshot, with the GPU-side measurements a CUDA run
records put in. The live paths run on a GPU machine (tests marked `gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch

import tuneup
from benchmarks.advice_scenarios import CLEAN, run_job
from tuneup.diagnose import evaluate

A100 = {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0], "bf16": True, "tensor_cores": True}
V100 = {"index": 0, "name": "Tesla V100", "capability": [7, 0], "bf16": False, "tensor_cores": True}
GIB = 1 << 30


@pytest.fixture(scope="module")
def cpu_snapshot(tmp_path_factory):
    """A real clean CPU run's snapshot, as the report reads it: on a CPU pinned as one without
    bf16 units, so the tests below start from no findings on any CPU (they set the capability
    they need in the snapshot)."""
    from tuneup.report.sources import load

    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUNEUP_PORT", "0")
        with tuneup.attach(run_dir=run_dir, interval=0.1, cpu_bf16=False):
            run_job(CLEAN)
    histories, _ = load(str(run_dir))
    snapshot = histories[0].snapshot()
    # As on a quiet machine: other processes' load (CI, a shared machine) is no input here.
    host = snapshot["system"]["host"]
    host["busy_cores"] = (host.get("cpu_ratio") or 0) + (host.get("workers_cpu_ratio") or 0)
    assert {f.rule for f in evaluate(snapshot).findings} == set()
    return snapshot


def on_cuda(snapshot, device=A100, **changes):
    """The snapshot as a CUDA run of the same job records it."""
    s = copy.deepcopy(snapshot)
    config = s["config"]
    for entry in config["models"] + config["optimizers"]:
        entry["devices"] = ["cuda"]
    for entry in config["optimizers"]:
        entry["implementation"] = "foreach"  # torch's default for CUDA parameters
    config["hardware"]["cuda_devices"] = [device]
    config["torch"]["cuda_initialized"] = True
    config["autocast"] = {"cpu": None, "cuda": None}
    config["backends"]["float32_matmul_precision"] = "high"
    s["habits"]["batches"].update(devices=["cpu"], pin_checked=10, pinned=10)
    s["syncs"]["backend"] = "cuda"
    s["gpu_history"] = {"samples": 30, "devices": [gpu()]}
    s["system"]["memory"] = {"available": True, "devices": [allocator()]}
    for path, value in changes.items():
        target = s
        *parents, leaf = path.split(".")
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[leaf] = value
    return s


def gpu(**fields):
    base = {"gpu": 0, "samples": 30, "utilization_ratio": 0.95, "memory_used_bytes": 60 * GIB,
            "memory_total_bytes": 80 * GIB, "power_watts": 300.0, "power_limit_watts": 400.0,
            "sm_clock_hz": 1.41e9, "sm_clock_max_hz": 1.41e9, "temperature_celsius": 60.0,
            "process_memory_bytes": 60 * GIB, "throttle_reasons": {}}
    return dict(base, **fields)


def allocator(**fields):
    base = {"device": 0, "allocated_bytes": 50 * GIB, "allocated_peak_bytes": 55 * GIB,
            "reserved_bytes": 60 * GIB, "reserved_peak_bytes": 60 * GIB, "alloc_retries": 0,
            "ooms": 0, "total_bytes": 80 * GIB}
    return dict(base, **fields)


def fired(snapshot, ranks=()):
    evaluation = evaluate(snapshot, ranks=ranks)
    assert evaluation.errors == {}
    return {f.rule: f for f in evaluation.findings}


def test_the_cuda_baseline_is_clean_except_amp(cpu_snapshot):
    # fp32 on an A100 with TF32 on: only the AMP advice applies.
    assert set(fired(on_cuda(cpu_snapshot))) == {"amp-off"}


def test_amp_off_on_tensor_core_gpus_with_a_gain_from_the_split(cpu_snapshot):
    found = fired(on_cuda(cpu_snapshot))["amp-off"]
    window = cpu_snapshot["window"]
    assert found.gain == pytest.approx(0.5 * (window["forward_ratio"] + window["backward_ratio"]))
    assert "an estimate, not measured on this job" in found.gain_text  # no layers timed yet
    assert "bfloat16" in found.fix
    v100 = fired(on_cuda(cpu_snapshot, device=V100))["amp-off"]
    assert "GradScaler" in v100.fix and "float16" in v100.fix  # no bf16 before Ampere
    assert "amp-off" not in fired(on_cuda(cpu_snapshot, **{"config.autocast": {"cuda": "bfloat16"}}))


def amp_trial(fp32, reduced, dtype="bfloat16", device="cpu", faster=8, pairs=8):
    """measure/precision.py's result: the model's forward + backward timed in fp32 and under autocast."""
    return {"device": device, "dtype": dtype, "model": "Sequential", "pairs": pairs, "faster_pairs": faster,
            "fp32_seconds": fp32, "reduced_seconds": reduced, "speedup": fp32 / reduced}


def test_amp_off_on_a_cpu_with_bf16_fires_on_a_measured_gain_only(cpu_snapshot):
    """On a CPU the hardware alone says too little (small layers gain nothing in bf16): the
    rule waits for the job's model to be timed and fires on what it would save."""
    s = copy.deepcopy(cpu_snapshot)
    s["config"]["hardware"]["cpu_bf16"] = True
    step = s["window"]["step_seconds"]["median"]
    compute = s["window"]["forward_ratio"] + s["window"]["backward_ratio"]
    evaluation = evaluate(s)
    assert "amp-off" in evaluation.unmeasured and "amp-off" not in {f.rule for f in evaluation.findings}
    s["habits"]["amp_trial"] = {"skipped": "the forward runs under autocast"}
    assert "the forward runs under autocast" in evaluate(s).wanting["amp-off"]
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.2 * step)  # saves 20% of a step
    found = fired(s)["amp-off"]
    assert found.gain == pytest.approx(min(0.2, compute))
    assert "measured 2.00x as fast on the model's forward + backward (Sequential" in found.observed
    assert "faster in 8 of 8 interleaved pairs" in found.observed
    assert "measured on the job's model" in found.gain_text and found.evidence["measured"] is True
    assert found.can_apply is True  # a clear gain (8 of 8): apply mode may switch it on
    # Faster in 7 of 8 pairs: a finding, but not clear enough for apply mode to change the run's
    # numerics on it (a trial undone would leave its bf16 updates in the weights).
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.2 * step, faster=7)
    found = fired(s)["amp-off"]
    assert found.can_apply is False and "faster in 7 of 8 pairs" in found.evidence["not_applicable"]
    # Faster in all of 3 pairs (a timing cut short by its budget): a sign test's p of 1/8 is a
    # finding's evidence, not enough to change the run's numerics.
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.2 * step, faster=3, pairs=3)
    found = fired(s)["amp-off"]
    assert found.can_apply is False and "faster in 3 of 3 pairs" in found.evidence["not_applicable"]
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.2 * step, faster=5)  # faster in 5 of 8 pairs: noise
    assert "amp-off" not in fired(s)
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.39 * step)  # 1% of a step: not worth it
    assert "amp-off" not in fired(s)
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.5 * step)  # slower in bf16
    assert "amp-off" not in fired(s)
    s["config"]["hardware"]["cpu_bf16"] = False
    s["habits"]["amp_trial"] = amp_trial(0.4 * step, 0.2 * step)
    assert "amp-off" not in fired(s)


@pytest.mark.parametrize("framework, precision, clipping", [
    (None, "torch.autocast(device_type=\"cuda\", dtype=torch.bfloat16)", "torch.nn.utils.clip_grad_norm_("),
    ("lightning", "L.Trainer(..., precision=\"bf16-mixed\")", "L.Trainer(..., gradient_clip_val="),
    ("transformers", "TrainingArguments(..., bf16=True)", "TrainingArguments(..., max_grad_norm="),
    ("accelerate", "Accelerator(mixed_precision=\"bf16\")", "accelerator.clip_grad_norm_(model.parameters()"),
])
def test_fixes_speak_the_framework_that_owns_the_setting(cpu_snapshot, framework, precision, clipping):
    """The same findings on a job trained through Lightning, the HF Trainer or Accelerate (its
    integration's `framework` event in the configuration): the fix is the framework's setting."""
    s = on_cuda(cpu_snapshot)
    if framework:
        s["config"]["framework"] = {"framework": framework}
    s["habits"]["watched_steps"] = 5
    s["habits"]["grad_norms"] = {"samples": 40, "spikes": 2, "nonfinite": 0, "series": 1, "median": 0.5,
                                 "p90": 0.8, "largest_ratio": 30.0, "largest_norm": 15.0, "median_before": 0.5,
                                 "largest_step": 120}
    found = fired(s)
    assert precision in found["amp-off"].fix, found["amp-off"].fix
    assert clipping in found["no-grad-clipping"].fix and "max_norm=1" in found["no-grad-clipping"].fix.replace(
        "gradient_clip_val=1", "max_norm=1").replace("max_grad_norm=1", "max_norm=1")
    v100 = fired(on_cuda(s, device=V100))["amp-off"].fix  # fp16 where bf16 is not there: its scaler too
    assert ("16-mixed" in v100 or "fp16=True" in v100 or "mixed_precision=\"fp16\"" in v100) if framework \
        else "GradScaler" in v100


def test_amp_off_on_a_compiled_gpu_model_estimates_and_says_apply_mode_cannot_make_it(cpu_snapshot):
    from tuneup.measure.terms import amp_refusal

    s = on_cuda(cpu_snapshot)
    s["config"]["models"][0]["compiled"] = True
    s["habits"]["amp_trial"] = {"skipped": "the model is compiled (its graphs run the step, not its forward)"}
    found = fired(s)["amp-off"]
    assert found.can_apply is False and found.evidence["not_applicable"] == amp_refusal(s["config"])
    assert "is compiled" in found.evidence["not_applicable"] and "an estimate" in found.gain_text


def test_amp_off_on_a_gpu_states_the_measured_gain_once_the_model_was_timed(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    step = s["window"]["step_seconds"]["median"]
    s["habits"]["amp_trial"] = amp_trial(0.3 * step, 0.1 * step, device="cuda")
    found = fired(s)["amp-off"]
    assert found.evidence["measured"] and "measured 3.00x as fast" in found.observed
    s["habits"]["amp_trial"] = amp_trial(0.3 * step, 0.29 * step, device="cuda")
    assert "amp-off" not in fired(s)


def test_tf32_off_on_ampere(cpu_snapshot):
    s = on_cuda(cpu_snapshot, **{"config.backends.float32_matmul_precision": "highest"})
    assert "tf32-off" in fired(s)
    assert "tf32-off" not in fired(on_cuda(cpu_snapshot, device=V100, **{"config.backends.float32_matmul_precision": "highest"}))


def test_pageable_copies(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["habits"]["batches"]["pinned"] = 0
    found = fired(s)["pageable-copies"]
    assert found.evidence == {"pageable_batches": 10, "sampled_batches": 10, "blocking_copies_per_step": 0.0,
                              "copy_sources": []}
    assert "pin_memory=True" in found.fix and found.can_apply


def test_blocking_copies_go_to_pageable_copies_not_host_syncs(cpu_snapshot):
    # A CUDA loop with pinned batches, copied without non_blocking (2 per step: x and y), and
    # one real read (loss.item()) per step.
    s = on_cuda(cpu_snapshot)
    copy_line = {"location": "train.py:41", "function": "train", "kind": "blocking_copy", "per_step": 2.0,
                 "steps": 8, "out_of": 8}
    read_line = {"location": "train.py:46", "function": "train", "kind": "cuda_sync", "per_step": 1.0,
                 "steps": 8, "out_of": 8}
    s["syncs"].update(per_step=3.0, by_kind={"blocking_copy": 2.0, "cuda_sync": 1.0}, sampled_steps=8,
                      top_sources=[copy_line, read_line])
    found = fired(s)
    copies = found["pageable-copies"]
    assert copies.evidence["blocking_copies_per_step"] == 2.0 and copies.evidence["pageable_batches"] == 0
    assert "train.py:41" in copies.observed and "non_blocking=True" in copies.fix
    syncs = found["host-syncs"]
    assert syncs.evidence["syncs_per_step"] == 1.0
    assert [source["location"] for source in syncs.evidence["top_sources"]] == ["train.py:46"]
    # Copies alone are no host-syncs finding.
    s["syncs"].update(per_step=2.0, by_kind={"blocking_copy": 2.0}, top_sources=[copy_line])
    assert "host-syncs" not in fired(s) and "pageable-copies" in fired(s)


def test_cudnn_benchmark_off_needs_convolutions_and_static_shapes(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["config"]["models"][0]["convolutions"] = 4
    s["habits"]["batches"].update(inspected=12, distinct_shapes=1)
    assert "cudnn-benchmark-off" in fired(s)
    s["habits"]["batches"]["distinct_shapes"] = 9  # dynamic shapes: the autotuner would re-tune
    assert "cudnn-benchmark-off" not in fired(s)
    s["habits"]["batches"]["distinct_shapes"] = 1
    s["config"]["backends"]["cudnn_benchmark"] = True
    assert "cudnn-benchmark-off" not in fired(s)


def test_gpu_launch_bound_and_memory_unused(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["gpu_history"]["devices"] = [gpu(utilization_ratio=0.35)]
    s["system"]["memory"]["devices"] = [allocator(reserved_peak_bytes=10 * GIB, reserved_bytes=10 * GIB)]
    found = fired(s)
    assert found["gpu-launch-bound"].gain == pytest.approx(0.65)
    assert "gpu-memory-unused" in found
    assert "gpu-launch-bound" not in fired(on_cuda(cpu_snapshot))


def gpu_busy(snapshot, share):
    step = snapshot["window"]["step_seconds"]["median"]
    snapshot["window"]["gpu_seconds"] = {"median": share * step, "mean": share * step, "p90": step, "min": 0,
                                         "max": step}
    return snapshot


@pytest.mark.parametrize("framework, compile_off, launch_bound", [
    (None, "model = torch.compile(model)", 'model = torch.compile(model, mode="reduce-overhead")'),
    ("lightning", "before trainer.fit(model)", 'mode="reduce-overhead")   # the LightningModule'),
    ("transformers", "TrainingArguments(..., torch_compile=True)",
     'TrainingArguments(..., torch_compile=True, torch_compile_mode="reduce-overhead")'),
    ("accelerate", 'Accelerator(dynamo_backend="inductor")', 'TorchDynamoPlugin(backend="inductor", mode="reduce-overhead")'),
])
def test_compile_advice_speaks_the_jobs_framework(cpu_snapshot, framework, compile_off, launch_bound):
    """Where the framework compiles the model (TrainingArguments, Accelerator), the fix is its
    setting; Lightning has none: the LightningModule is compiled before fit."""
    def framed(snapshot):
        if framework:
            snapshot["config"]["framework"] = {"framework": framework}
        return snapshot

    assert compile_off in fired(framed(gpu_busy(on_cuda(cpu_snapshot), 0.3)))["compile-off"].fix
    s = framed(on_cuda(cpu_snapshot))
    s["gpu_history"]["devices"] = [gpu(utilization_ratio=0.35)]
    assert launch_bound in fired(s)["gpu-launch-bound"].fix
    # A short last batch that recompiles: the Trainer drops it with its own setting.
    s = framed(copy.deepcopy(cpu_snapshot))
    s["compile"] = {"compiles": 4, "recompiles": 3, "graphs": 4, "graph_breaks": 0,
                    "recompile_sites": [{"where": "forward", "count": 3, "guard": "tensor 'x' size mismatch at index 0"}]}
    drop_last = "TrainingArguments(..., dataloader_drop_last=True)" if framework == "transformers" else \
        "DataLoader(..., drop_last=True)"
    assert drop_last in fired(s)["recompiles"].fix


def test_compile_off_on_an_eager_cuda_model_whose_gpu_idles_for_no_other_reason(cpu_snapshot):
    s = gpu_busy(on_cuda(cpu_snapshot), 0.3)
    s["gpu_history"]["devices"] = [gpu(utilization_ratio=0.35)]
    found = fired(s)
    assert found["compile-off"].gain == pytest.approx(0.7)
    assert "torch.compile(model)" in found["compile-off"].fix
    assert "gpu-launch-bound" not in found  # one finding for one cause, from the job's own GPU time
    # Not where something else explains the idle GPU, the model is compiled, or the GPU is busy.
    assert "compile-off" not in fired(gpu_busy(on_cuda(cpu_snapshot), 0.8))
    stalled = gpu_busy(on_cuda(cpu_snapshot), 0.3)
    stalled["window"]["stall_ratio"] = 0.4
    assert "compile-off" not in fired(stalled)
    syncing = gpu_busy(on_cuda(cpu_snapshot), 0.3)
    syncing["syncs"].update(per_step=3.0, by_kind={"item": 3.0})
    assert "compile-off" not in fired(syncing) and "host-syncs" in fired(syncing)
    compiled = gpu_busy(on_cuda(cpu_snapshot), 0.3)
    compiled["compile"] = {"compiles": 2, "seconds": 4.0, "graphs": 2, "recompiles": 0, "graph_breaks": 0}
    assert "compile-off" not in fired(compiled)
    assert "compile-off" not in fired(gpu_busy(copy.deepcopy(cpu_snapshot), 0.3))  # a CPU job


def test_compile_off_when_the_gpus_span_is_the_hosts_launching_time(cpu_snapshot):
    """Recorded on an H100: a launch-bound eager transformer whose CUDA-event span (first kernel
    to last) was 96% of its step, because each kernel waited for its launch, while NVML saw a
    kernel running 32% of the time. The span alone calls that GPU busy; the utilization does not."""
    s = gpu_busy(on_cuda(cpu_snapshot), 0.96)
    s["gpu_history"]["devices"] = [gpu(utilization_ratio=0.32)]
    found = fired(s)
    assert found["compile-off"].gain == pytest.approx(0.68)
    assert "gpu-launch-bound" not in found
    # Without NVML samples the span alone, as before: busy at 96%, no compile-off, still checked.
    bare = gpu_busy(on_cuda(cpu_snapshot), 0.96)
    bare["gpu_history"] = None
    assert "compile-off" not in fired(bare) and "compile-off" in evaluate(bare).passed
    assert fired(gpu_busy(bare, 0.3))["compile-off"].gain == pytest.approx(0.7)
    # Busy by both measures: neither finding.
    busy = gpu_busy(on_cuda(cpu_snapshot), 0.96)
    busy["gpu_history"]["devices"] = [gpu(utilization_ratio=0.95)]
    assert not {"compile-off", "gpu-launch-bound"} & set(fired(busy))


def test_memory_pressure(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["system"]["memory"]["devices"] = [allocator(alloc_retries=3)]
    assert fired(s)["memory-pressure"].evidence["alloc_retries"] == 3


def test_gpu_throttling(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["gpu_history"]["devices"] = [gpu(sm_clock_hz=1.0e9, throttle_reasons={"hw_thermal": 0.6}, temperature_celsius=88.0)]
    found = fired(s)["gpu-throttling"]
    assert found.gain == pytest.approx(1 - 1.0 / 1.41)
    assert "hw_thermal" in found.observed
    s["gpu_history"]["devices"] = [gpu(sm_clock_hz=1.0e9, throttle_reasons={"display_clocks": 1.0})]
    assert "gpu-throttling" not in fired(s)  # not a power or thermal reason


def test_gpu_present_but_unused(cpu_snapshot):
    s = copy.deepcopy(cpu_snapshot)
    s["gpu_history"] = {"samples": 30, "devices": [gpu(utilization_ratio=0.0)]}
    assert "gpu-unused" in fired(s)
    assert "gpu-unused" not in fired(on_cuda(cpu_snapshot))


def test_single_tensor_optimizer_on_cuda(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["config"]["optimizers"][0]["implementation"] = "for-loop"
    assert "fused=True" in fired(s)["single-tensor-optimizer"].fix
    s["config"]["optimizers"][0]["implementation"] = "foreach"
    assert "single-tensor-optimizer" not in fired(s)


def test_ddp_without_nccl(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["config"]["distributed"] = {"initialized": True, "backend": "gloo", "world_size": 8, "rank": 0}
    assert "ddp-backend" in fired(s)
    s["config"]["distributed"]["backend"] = "nccl"
    assert "ddp-backend" not in fired(s)


def test_rank_straggler_is_named(cpu_snapshot):
    ranks = []
    for rank, factor in enumerate([1.0, 1.02, 1.6, 0.99]):
        s = copy.deepcopy(cpu_snapshot)
        s["run"]["rank"] = rank
        for part in ("step_seconds", "backward_seconds"):
            s["window"][part] = dict(s["window"][part])
        s["window"]["step_seconds"]["median"] *= factor
        ranks.append(s)
    found = fired(ranks[0], ranks=ranks[1:])["rank-straggler"]
    assert found.evidence["rank"] == 2
    even = [copy.deepcopy(ranks[0]) for _ in range(3)]
    for rank, s in enumerate(even):
        s["run"]["rank"] = rank
    assert "rank-straggler" not in fired(even[0], ranks=even[1:])


def test_rank_straggler_is_named_where_the_other_ranks_wait_their_whole_step(cpu_snapshot):
    # Recorded from a CI run (4 ranks on a loaded 2-core machine, rank 3 sleeping 10 ms a step):
    # ranks 0-2 read an all-reduce wait at or above their step (own time 0), rank 3 9.9 ms of its own.
    ranks = []
    for rank, (step, wait) in enumerate([(0.0156, 0.0173), (0.0158, 0.0161), (0.0157, 0.0164), (0.0155, 0.0056)]):
        s = copy.deepcopy(cpu_snapshot)
        s["run"]["rank"] = rank
        s["window"] = dict(s["window"], step_seconds=dict(s["window"]["step_seconds"], median=step))
        s["system"] = dict(s.get("system") or {}, ddp={"iterations_sampled": 8, "allreduce_wait_seconds": wait})
        ranks.append(s)
    found = fired(ranks[0], ranks=ranks[1:])["rank-straggler"]
    assert found.evidence["rank"] == 3 and found.evidence["median_seconds"] == 0
    assert "the median rank spends none" in found.observed
    for s in ranks[:3]:  # every rank at nil own time: no one stands out
        s["system"]["ddp"]["allreduce_wait_seconds"] = 0.02
    ranks[3]["system"]["ddp"]["allreduce_wait_seconds"] = 0.0152  # 0.3 ms of its own: below the floor
    assert "rank-straggler" not in fired(ranks[0], ranks=ranks[1:])


def test_host_syncs_on_cuda_has_a_gain_from_gpu_idle_time(cpu_snapshot):
    s = on_cuda(cpu_snapshot)
    s["syncs"].update(per_step=3.0, by_kind={"item": 3.0})
    step = s["window"]["step_seconds"]["median"]
    s["window"]["gpu_seconds"] = {"median": 0.6 * step, "mean": 0.6 * step, "p90": step, "min": 0, "max": step}
    found = fired(s)["host-syncs"]
    assert found.severity == "high"
    assert found.gain == pytest.approx(0.4 - s["window"]["stall_ratio"])
    # The span holds the gaps after each sync; where NVML saw kernels 30% of the time, the
    # GPU idles 70% of the step, not 40%.
    s["gpu_history"]["devices"] = [gpu(utilization_ratio=0.3)]
    found = fired(s)["host-syncs"]
    assert found.gain == pytest.approx(0.7 - s["window"]["stall_ratio"])
    assert "the GPU idles 70% of a step" in found.gain_text
    # Without NVML samples (no driver library in a container, say) the span alone: still checked.
    s["gpu_history"] = None
    assert fired(s)["host-syncs"].gain == pytest.approx(0.4 - s["window"]["stall_ratio"])


@pytest.mark.parametrize("framework, compiled", [("transformers", "TrainingArguments(..., torch_compile=True)"),
                                                 ("accelerate", 'accelerator = Accelerator(dynamo_backend="inductor")'),
                                                 (None, "model = torch.compile(model)")])
def test_host_syncs_inside_transformers_get_each_of_their_knobs(cpu_snapshot, framework, compiled):
    # The HF fine-tune's reads (tests/programs/hf_finetune.py): the Trainer's NaN/inf filter 4
    # a step, BERT's attention-mask check 2 (transformers/masking_utils.py padding_mask.all()).
    s = copy.deepcopy(cpu_snapshot)
    if framework:
        s["config"]["framework"] = {"framework": framework}
    site = "/venv/lib/python3.11/site-packages/transformers/"
    s["syncs"].update(per_step=6.0, by_kind={"isnan/isinf": 4.0, "bool": 2.0}, top_sources=[
        {"kind": "isnan/isinf", "location": site + "trainer.py:2712", "per_step": 4.0},
        {"kind": "bool", "location": site + "masking_utils.py:354", "per_step": 2.0}])
    fix = fired(s)["host-syncs"].fix
    nan_filter, mask = fix.index("logging_nan_inf_filter=False"), fix.index(compiled)
    assert nan_filter < mask and "running_loss" not in fix, fix
    # The mask check alone leads: its knob alone.
    s["syncs"]["top_sources"] = s["syncs"]["top_sources"][1:] + [
        {"kind": "item", "location": "train.py:40", "per_step": 1.0}]
    fix = fired(s)["host-syncs"].fix
    assert fix.startswith(compiled) and "nan_inf" not in fix
    # The job's own read leading: the loop's fix, as before.
    s["syncs"]["top_sources"] = s["syncs"]["top_sources"][::-1]
    assert fired(s)["host-syncs"].fix.startswith("running_loss += loss.detach()")


def test_a_fix_that_would_save_under_one_percent_is_no_finding(cpu_snapshot):
    """A rule whose threshold is crossed but whose measured gain is under MIN_GAIN passes, with
    its gain kept under `slight` and named in the report's summary line: numpy copies that take
    0.2% of a step, host syncs on a GPU that never idles. A collapsed GradScaler scale (no skips,
    so no speed to gain) stays a finding."""
    from tuneup.diagnose.rule import MIN_GAIN
    from tuneup.report.text import checked_summary

    assert MIN_GAIN == 0.01
    step = cpu_snapshot["totals"]["seconds"] / cpu_snapshot["totals"]["steps"]
    cheap = copy.deepcopy(cpu_snapshot)
    cheap["habits"].update(numpy_copies_per_step=1.0, numpy_copy_seconds_per_step=0.002 * step)
    costly = copy.deepcopy(cheap)
    costly["habits"]["numpy_copy_seconds_per_step"] = 0.05 * step
    assert fired(costly)["numpy-copies"].gain == pytest.approx(0.05)
    evaluation = evaluate(cheap)
    assert "numpy-copies" not in {f.rule for f in evaluation.findings}
    assert "numpy-copies" in evaluation.passed
    assert evaluation.slight == {"numpy-copies": pytest.approx(0.002)}
    line = checked_summary({"runs": [{"evaluation": evaluation.to_dict(), "snapshot": cheap}], "findings": []})
    assert "found a fix worth under 1% of a step: numpy-copies 0.2%" in line

    busy_gpu = on_cuda(cpu_snapshot)
    busy_gpu["syncs"].update(per_step=3.0, by_kind={"item": 3.0})
    busy_gpu["window"]["stall_ratio"] = 0.0
    median = busy_gpu["window"]["step_seconds"]["median"]
    busy_gpu["window"]["gpu_seconds"] = {"median": median, "mean": median, "p90": median, "min": median, "max": median}
    busy_gpu["gpu_history"]["devices"] = [gpu(utilization_ratio=1.0)]  # NVML: a kernel ran all the time too
    assert "host-syncs" not in fired(busy_gpu)
    assert evaluate(busy_gpu).slight == {"host-syncs": 0.0}

    collapsed = copy.deepcopy(cpu_snapshot)
    collapsed["scaler"] = {"present": True, "enabled": True, "scale": 0.5, "longest_skip_run": 0, "backoff_events": 3}
    collapsed["window"]["skipped_steps"] = 0
    found = fired(collapsed)["scaler-skips"]
    assert found.gain is None and "scale now 0.5" in found.observed


def test_scaler_skips_offers_bf16_only_where_the_hardware_runs_it(cpu_snapshot):
    """fp16 overflowing: bf16 autocast (no scaler) is the fix on an A100 or a CPU with bf16
    units; on a V100 or a CPU without them bf16 is emulated, slower than fp32: the fix is
    finding the overflow, and bf16 is not offered."""
    skipping = copy.deepcopy(cpu_snapshot)
    skipping["scaler"] = {"present": True, "enabled": True, "scale": 8.0, "longest_skip_run": 2, "backoff_events": 15}
    skipping["window"]["skipped_steps"] = round(0.05 * skipping["window"]["steps"])

    def fix(snapshot):
        found = fired(snapshot)["scaler-skips"]
        return found.fix, found.evidence["bf16_native"]

    text, native = fix(skipping)  # the fixture's CPU: pinned as one without bf16 units
    assert native is False and "autocast" not in text and text.startswith("# find the overflow")
    assert "emulated on this CPU (no AVX512-BF16/AMX): slower than fp32" in text
    with_units = copy.deepcopy(skipping)
    with_units["config"]["hardware"]["cpu_bf16"] = True
    text, native = fix(with_units)
    assert native is True and text.startswith('with torch.autocast(device_type="cpu", dtype=torch.bfloat16):')
    assert "where the hardware" not in text and "# staying on fp16? find the overflow" in text
    unread = copy.deepcopy(skipping)
    unread["config"]["hardware"]["cpu_bf16"] = None
    text, native = fix(unread)
    assert native is None and "autocast" in text and "where the hardware runs bf16" in text
    text, native = fix(on_cuda(skipping, device=V100))
    assert native is False and "autocast" not in text and "this GPU (compute capability below 8.0)" in text
    text, native = fix(on_cuda(skipping))
    assert native is True and text.startswith('with torch.autocast(device_type="cuda", dtype=torch.bfloat16):')


@pytest.mark.gpu
def test_live_cuda_rules_fire_on_a_real_cuda_job(tmp_path):
    """On a GPU: a conv net with pageable batches, cudnn.benchmark off and fp32."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from tuneup.report.document import build
    from tuneup.report.sources import load

    torch.backends.cudnn.benchmark = False
    data = TensorDataset(torch.randn(2048, 3, 32, 32), torch.randint(0, 10, (2048,)))
    loader = DataLoader(data, batch_size=64, drop_last=True)
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 30 * 30, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    with tuneup.attach(run_dir=tmp_path / "run", interval=0.1) as agent:
        for _ in range(3):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    histories, source = load(str(tmp_path / "run"))
    rules = {f["rule"] for f in build(histories, source=source)["findings"]}
    assert {"pageable-copies", "cudnn-benchmark-off", "single-tensor-optimizer"} <= rules
    # amp-off stands on autocast timed faster on this model (on an H100 this small conv net was
    # not: its fp32 convolutions use TF32 already): in the report where the timing was clearly
    # faster, not where it was slower.
    trial = agent.snapshot()["habits"]["amp_trial"]
    assert trial and trial.get("pairs"), trial
    if trial["speedup"] > 1.1 and trial["faster_pairs"] >= 0.9 * trial["pairs"]:
        assert "amp-off" in rules, trial
    elif trial["speedup"] < 1.0:
        assert "amp-off" not in rules, trial


def on_host(snapshot, cores=2, threads=2, own=0.3, workers=(), busy=None, waited=0.0, workers_waited=0.0):
    """The snapshot with the host probe's figures: `workers` the loader workers' measured CPU
    (cores each), `busy` the machine's busy cores on the job's cores (default: the job's),
    `waited`/`workers_waited` the cores' worth of CPU time they waited for (none: a quiet
    machine; the recorded snapshot's own were measured on whatever machine ran it)."""
    s = copy.deepcopy(snapshot)
    worker_cpu = sum(workers)
    s["system"]["host"].update(
        wait_cores=waited, workers_wait_cores=workers_waited,
        usable_cores=cores, torch_threads=threads, cpu_ratio=own, workers=len(workers),
        workers_cpu_ratio=worker_cpu, busy_cores=own + worker_cpu if busy is None else busy,
        worker_processes=[{"pid": 100 + i, "cpu_ratio": cpu, "rss_bytes": 1} for i, cpu in enumerate(workers)])
    return s


def test_cpu_oversubscribed_blames_the_jobs_own_threads_and_busy_workers(cpu_snapshot):
    # 2 torch threads and 2 workers each busy 0.9 of a core, on 2 cores: the job's own demand.
    s = on_host(cpu_snapshot, own=1.0, workers=(0.9, 0.9))
    finding = next(f for f in evaluate(s).findings if f.rule == "cpu-oversubscribed")
    assert "torch.set_num_threads(1)" in finding.fix
    assert "2 busy loader workers (1.8 cores)" in finding.observed
    assert finding.evidence["other_cores"] == pytest.approx(0.0)


def test_cpu_oversubscribed_names_other_processes_not_idle_workers(cpu_snapshot):
    # The machine's 2 cores are busy (1.9), but the job uses 0.3 and its 2 workers nothing:
    # other processes take 1.6 cores. Its threads want under a core (none run in parallel):
    # fewer torch threads would not help.
    s = on_host(cpu_snapshot, own=0.3, workers=(0.0, 0.0), busy=1.9)
    finding = next(f for f in evaluate(s).findings if f.rule == "cpu-oversubscribed")
    assert finding.observed.startswith("the machine is busy with other work: other processes use 1.6 of")
    assert "set_num_threads" not in finding.fix and "workers" not in finding.observed


def test_cpu_oversubscribed_advises_a_thread_per_free_core_where_other_processes_hold_the_rest(cpu_snapshot):
    # tuneup demo beside two busy processes, as measured: 2 torch threads using 0.87 cores and
    # waiting for 0.87 more, other processes 1.13 of the 2 cores. Its intra-op threads wait
    # for each other at every op (bench_threads_busy.py: 2 threads 1.4x slower than 1 there).
    s = on_host(cpu_snapshot, own=0.87, busy=2.0, waited=0.87)
    finding = next(f for f in evaluate(s).findings if f.rule == "cpu-oversubscribed")
    assert finding.observed.startswith("the machine is busy with other work: other processes use 1.1 of")
    assert "its 2 torch threads want 1.7 cores where the others leave 0.9" in finding.observed, finding.observed
    assert finding.fix.endswith("torch.set_num_threads(1)") and "taskset" in finding.fix
    assert finding.evidence["advised_threads"] == 1
    # Already at one thread: the cores alone.
    at_one = next(f for f in evaluate(on_host(cpu_snapshot, threads=1, own=0.87, busy=2.0, waited=0.87)).findings
                  if f.rule == "cpu-oversubscribed")
    assert "set_num_threads" not in at_one.fix and "advised_threads" not in at_one.evidence


def test_cpu_oversubscribed_is_silent_for_a_job_already_at_one_thread_or_on_a_quiet_machine(cpu_snapshot):
    at_one = on_host(cpu_snapshot, threads=1, own=0.9, workers=(0.9, 0.9))
    quiet = on_host(cpu_snapshot, own=0.5, workers=(0.1, 0.1))
    for s in (at_one, quiet):
        assert "cpu-oversubscribed" not in fired(s)


def stalled(snapshot, stall=0.4, wait=0.004, transfer=None, fetched=None, ready=None, **host):
    """A 1-batch-a-step loop waiting `wait` of each step, a `stall` share of it; `transfer`: what
    shipping a batch costs (measure/transfer.py; None: not measured), `fetched`: the CPU share
    of the main process's fetches."""
    s = on_host(snapshot, **host)
    step = wait / stall
    s["window"] = dict(s["window"], stall_ratio=stall, data_wait_seconds={"median": wait, "mean": wait},
                       fetches_per_step=1.0,
                       step_seconds=dict(s["window"]["step_seconds"], median=step, mean=step))
    s["config"]["loaders"][0]["num_workers"] = len(host.get("workers", ()))
    s["habits"] = dict(s["habits"], batch_transfer=transfer, main_process_fetches=fetched, worker_fetches=ready)
    return s


def stall_finding(s):
    return next(f for f in evaluate(s).findings if f.rule == "data-stall")


def test_data_stall_states_the_means_its_ratio_comes_from_and_a_median_far_from_them(cpu_snapshot):
    # Recorded on an H100 conv net: a 1.5 ms median wait, but a few 1 s stalls made the waits
    # 36% of the time (7 ms of a 19.5 ms mean step). Before, it read "waited 1.5 ms per step ...:
    # 36% of a 9.3 ms step" (medians beside a ratio of sums).
    s = stalled(cpu_snapshot, stall=0.36, wait=0.0015)
    s["window"]["data_wait_seconds"]["mean"] = 0.00702
    s["window"]["step_seconds"].update(median=0.0093, mean=0.0195)
    observed = stall_finding(s).observed
    assert observed.startswith("the loop waited 7.0 ms per step on average for its next batch: 36% of a 19.5 ms step")
    assert "(the median wait 1.5 ms: a few long waits make most of it)" in observed
    even = stalled(cpu_snapshot, stall=0.4, wait=0.004)  # median = mean: no median said
    assert "median" not in stall_finding(even).observed


def shipping(main_ms, worker_ms=0.05, tensors=2):
    return {"main_seconds": main_ms / 1e3, "worker_seconds": worker_ms / 1e3, "bytes": 8192, "tensors": tensors, "reps": 5}


def test_data_stall_without_workers_predicts_from_making_and_shipping_a_batch(cpu_snapshot):
    # A 4 ms wait a batch, 90% of it waiting on I/O (a sleep, a file), shipping 0.4 ms: two
    # workers overlap it with the 6 ms of compute; the wait left is the shipping.
    slow = stall_finding(stalled(cpu_snapshot, own=1.0, transfer=shipping(0.4), fetched={"timed": 10, "cpu_share": 0.1}))
    assert "num_workers=2" in slow.fix and slow.can_apply
    assert slow.gain == pytest.approx(0.4 * (1 - 0.4 / 4)) and slow.gain_text.startswith("36% shorter steps, predicted")
    assert slow.evidence["predicted_wait_seconds"] == pytest.approx(0.0004)
    # A 0.3 ms batch that would cost 0.4 ms to ship (the issue's script: 0 workers was fastest).
    cheap = stall_finding(stalled(cpu_snapshot, wait=0.0003, own=1.0, transfer=shipping(0.4),
                                  fetched={"timed": 10, "cpu_share": 0.95}))
    assert "num_workers" not in cheap.fix and cheap.gain is None and not cheap.can_apply
    assert "shipping one from a worker would cost this process 400 µs (2 tensors)" in cheap.observed
    # Not measured yet: the whole wait, said to be an estimate.
    unknown = stall_finding(stalled(cpu_snapshot, own=1.0))
    assert unknown.gain == pytest.approx(0.4) and "an estimate" in unknown.gain_text


def test_data_stall_without_workers_predicts_no_gain_where_the_job_already_keeps_the_cores_busy(cpu_snapshot):
    # benchmarks/apply_scripts/augment_classifier.py on 2 cores, as measured: a 6.4 ms wait of
    # a 10.7 ms step (60%), the batch made in the main process at 0.99 of a core, shipping one
    # 0.30 ms here and 0.18 ms in a worker, and the process's intra-op threads keeping 1.98 of
    # the 2 cores busy. The overlap alone predicted 38% shorter steps; 0 -> 1 and 0 -> 2 workers
    # measured 0.75x and 0.94x. The making moves, its CPU does not go away: no gain, no trial.
    def finding(own, others=0.0, waited=0.0):
        s = stalled(cpu_snapshot, stall=0.6, wait=0.0064, cores=2, own=own, busy=own + others, waited=waited,
                    transfer=shipping(0.30, worker_ms=0.18), fetched={"timed": 42, "cpu_share": 0.99})
        return stall_finding(s)

    busy = finding(own=1.98)
    assert busy.gain is None and not busy.can_apply and "num_workers" not in busy.fix
    assert "this process's own threads already want 2.0 of the 2 usable cores" in busy.observed, busy.observed
    assert "augmentation" in busy.fix and busy.evidence["cpu_bound"]
    # The same loop using one of the two cores: a worker has the other (the overlap's prediction).
    idle = finding(own=1.0)
    assert "num_workers=2" in idle.fix and idle.can_apply and idle.gain > 0.3 and "cpu_bound" not in idle.evidence
    # Beside a busy process the job gets a share of the cores when it wants one: the other
    # process's CPU does not bound it (a loop that sleeps on I/O uses little, and workers
    # overlap its waits).
    crowded = finding(own=1.0, others=1.0)
    assert crowded.gain == pytest.approx(idle.gain) and crowded.can_apply
    # Beside busy processes the same loop gets 1.2 cores and waits for 0.8 more: its threads
    # still want both, and none is left for a worker.
    loaded = finding(own=1.2, others=0.8, waited=0.8)
    assert loaded.gain is None and not loaded.can_apply, loaded.observed
    # ... as measured beside three busy processes: the making on a core 38% of its time and
    # waiting for one 57% (asleep 5%): still no gain.
    s = stalled(cpu_snapshot, stall=0.6, wait=0.0064, cores=2, own=1.2, busy=2.0, waited=0.8,
                transfer=shipping(0.30, worker_ms=0.18), fetched={"timed": 42, "cpu_share": 0.38, "core_wait_share": 0.57})
    waiting = stall_finding(s)
    assert waiting.gain is None and not waiting.can_apply and waiting.evidence["cpu_bound"], waiting.observed
    assert waiting.evidence["make_asleep_share"] == pytest.approx(0.05)


def test_data_stall_without_workers_overlaps_a_making_that_sleeps_however_busy_the_cores_are(cpu_snapshot):
    # tuneup demo beside busy processes, as measured: its threads want 1.8-1.9 of the 2 cores
    # (an intra-op thread spinning between ops, and waiting for a core to spin), a 15.5 ms wait
    # of a 63 ms step (25%); the decode on a core 9% of each fetch, waiting for one 10%, asleep
    # 81% (the rest of its deadline). Two workers overlap the sleep without a core: 12.5 ms of
    # the step, less the 0.65 ms of shipping a batch here. (Two workers measured 1.7x.)
    def finding(fetched):
        s = stalled(cpu_snapshot, stall=0.25, wait=0.0155, cores=2, own=0.95, busy=2.0, waited=0.95,
                    transfer=shipping(0.65, worker_ms=0.21), fetched=fetched)
        return stall_finding(s)

    sleeping = finding({"timed": 101, "cpu_share": 0.09, "core_wait_share": 0.10})
    assert "num_workers=2" in sleeping.fix and sleeping.can_apply, sleeping.observed
    assert sleeping.evidence["sleep_overlap"] and "cpu_bound" not in sleeping.evidence
    assert sleeping.gain == pytest.approx(0.25 * 0.81 - 0.00065 / 0.062)
    assert ("this process's threads want 1.9 of the 2 usable cores, but the making sleeps 81% of its time"
            in sleeping.observed), sleeping.observed
    # Where the run-queue wait is not known (no schedstat: another OS), nothing tells the
    # sleep from a wait for a core: the cores bound stands (1 - 1.9 / 2 less the shipping: 4%,
    # within the noise).
    unknown = finding({"timed": 101, "cpu_share": 0.09})
    assert unknown.gain is None and not unknown.can_apply and unknown.evidence["cpu_bound"]


def test_data_stall_without_workers_plans_from_the_mean_wait_where_a_few_long_waits_make_most_of_it(cpu_snapshot):
    # The H100 conv net's figures, main-process loading: a 1.5 ms median wait, a 7 ms mean (a few
    # 1 s reads), 36% of a 19.5 ms mean step, 16 cores, shipping a batch 1.6 ms. From the median,
    # workers "would not recover the wait" (a batch cheaper to make than to ship); 0 -> 3 workers
    # then measured 1.98x. Workers take over all of the making: its mean is the cost.
    s = stalled(cpu_snapshot, stall=0.36, wait=0.0015, cores=16, own=1.0, transfer=shipping(1.6),
                fetched={"timed": 10, "cpu_share": 0.5})
    s["window"]["data_wait_seconds"]["mean"] = 0.00702
    s["window"]["step_seconds"].update(median=0.0093, mean=0.0195)
    finding = stall_finding(s)
    assert "num_workers=8" in finding.fix and finding.can_apply, finding.observed
    # 8 workers make a batch every (7.02 + 0.05) / 8 ms, well inside 12.5 ms of compute: the wait
    # left is the shipping.
    assert finding.evidence["make_seconds"] == pytest.approx(0.00702)
    assert finding.gain == pytest.approx(0.36 * (1 - 1.6 / 7.02))


def test_data_stall_asks_for_fewer_workers_where_a_batch_costs_less_to_make_than_to_ship(cpu_snapshot):
    # 5 workers on 2 cores, wanting 3.5 (0.3 used, 3.2 waited for: the loop and other work hold
    # the cores): 1.15 ms of CPU a batch (0.3 cores x a 4 ms step, less 0.05 ms shipping),
    # where the loop waits 2 ms a batch for them.
    s = stalled(cpu_snapshot, stall=0.5, wait=0.002, own=1.0, workers=(0.06,) * 5, workers_waited=3.2, busy=2.0,
                transfer=shipping(0.4))
    finding = stall_finding(s)
    # Apply mode's DataLoader search moves down to none as well, unless the job has a
    # worker_init_fn (the dataset may need what it sets up in each worker).
    assert finding.fix.endswith("num_workers=0)") and finding.can_apply
    s["config"]["loaders"][0]["worker_init_fn"] = True
    assert not stall_finding(s).can_apply
    assert finding.evidence["make_seconds"] == pytest.approx(0.00115)
    assert finding.gain == pytest.approx(0.5 * (1 - 0.00115 / 0.002))
    # The same loop's workers with nothing waited for: their time may be I/O (not measured), so
    # no prediction; the wait is over 1.5x the shipping: the plain estimate.
    idle = stall_finding(stalled(cpu_snapshot, stall=0.5, wait=0.002, own=1.0, workers=(0.06,) * 5,
                                 transfer=shipping(0.4)))
    assert "num_workers=0" not in idle.fix and "an estimate" in idle.gain_text
    # The issue's case: 5 idle workers on 2 cores, a batch already waiting at every fetch looked
    # at, 9 of the 10 asked for made (they idle ahead), the loop still waiting 1 ms a batch
    # (receiving under contention): fewer, not more.
    ready = stall_finding(stalled(cpu_snapshot, stall=0.7, wait=0.001, own=0.5, workers=(0.05,) * 5,
                                  transfer=shipping(0.2), ready={"checked": 8, "ready_share": 1.0, "queue_fill": 0.9}))
    assert ready.fix.endswith("num_workers=0)") and "an estimate" in ready.gain_text
    assert "already waiting in the queue at 100% of the fetches looked at, 90% of the batches asked for made" \
        in ready.observed
    # The same fetches where the workers only keep up (one or two of the ten made at each look):
    # their time off the CPU may be their making (storage), not idling, so a batch made here may
    # cost more than their CPU: no fewer workers, and none more (the wait is receiving them).
    for fill in (0.15, None):
        kept_up = stall_finding(stalled(cpu_snapshot, stall=0.7, wait=0.001, own=0.5, workers=(0.05,) * 5,
                                        transfer=shipping(0.2),
                                        ready={"checked": 8, "ready_share": 1.0,
                                               **({} if fill is None else {"queue_fill": fill})}))
        assert "num_workers=" not in kept_up.fix and kept_up.gain is None, (fill, kept_up.fix)
        assert "already waiting in the queue at 100%" in kept_up.observed
    # A wait within 1.5x the shipping: that is the wait; more workers would not recover it.
    shipped = stall_finding(stalled(cpu_snapshot, stall=0.5, wait=0.0005, own=1.0, workers=(0.06,) * 5,
                                    transfer=shipping(0.4)))
    assert shipped.gain is None and "more workers would not recover it" in shipped.observed


def test_data_stall_asks_for_no_more_cpu_bound_workers_than_the_cores_can_run(cpu_snapshot):
    # 2 workers busy 0.95 of a core each and the loop 0.1, on 2 cores: no room for a third.
    full = next(f for f in evaluate(stalled(cpu_snapshot, own=0.1, workers=(0.95, 0.95))).findings
                if f.rule == "data-stall")
    assert "num_workers=" not in full.fix and "CPU-bound" in full.observed
    assert full.evidence["workers_cpu_bound"] is True
    # The same workers on 8 cores: more of them can run.
    roomy = next(f for f in evaluate(stalled(cpu_snapshot, cores=8, own=0.1, workers=(0.95, 0.95))).findings
                 if f.rule == "data-stall")
    assert "num_workers=4" in roomy.fix


@pytest.mark.gpu
def test_compile_off_fires_on_a_launch_bound_eager_cuda_model(tmp_path):
    """On a GPU: a deep narrow MLP on tiny batches already on the device, read every 100 steps
    (no syncs, no data wait): each kernel takes microseconds and the GPU waits for the next launch."""
    from torch import nn

    from tuneup.report.document import build
    from tuneup.report.sources import load

    layers = [nn.Linear(64, 64) if i % 2 == 0 else nn.ReLU() for i in range(24)]
    model = nn.Sequential(*layers).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
    with tuneup.attach(run_dir=tmp_path / "run", interval=0.1):
        for step in range(600):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 100 == 0:
                loss.item()
    histories, source = load(str(tmp_path / "run"))
    findings = {f["rule"]: f for f in build(histories, source=source)["findings"]}
    assert "compile-off" in findings and "gpu-launch-bound" not in findings, sorted(findings)


def test_misaligned_layers_under_apply_modes_autocast_are_said_to_be_under_tuneups_change(cpu_snapshot):
    """Layer sizes only matter under reduced precision; where that precision is the autocast
    apply mode switched on (a kept AMP change), the finding says so instead of presenting it as
    the job's own precision."""
    s = on_cuda(cpu_snapshot, **{"config.autocast": {"cuda": "bfloat16"}})
    s["config"]["models"][0]["not_multiple_of_8"] = [{"module": "head", "type": "Linear", "in_features": 256, "out_features": 1001}]
    plain = fired(s)["tensor-core-alignment"]
    assert "apply mode" not in plain.observed
    s["actions"] = [{"id": 3, "action": "amp", "decision": "kept"}]
    assert "under the autocast tuneup's apply mode switched on, change 3" in fired(s)["tensor-core-alignment"].observed
    # The final report: every kept change is undone at detach, after the last steps ran with it
    s["actions"] = [{"id": 3, "action": "amp", "decision": "kept", "undone": {"reason": "detach"}}]
    assert "under the autocast tuneup's apply mode switched on, change 3" in fired(s)["tensor-core-alignment"].observed
    s["actions"] = [{"id": 3, "action": "amp", "decision": "kept", "undone": {"reason": "revert_all"}}]
    assert "apply mode" not in fired(s)["tensor-core-alignment"].observed


def test_data_stall_does_not_advise_again_what_apply_mode_measured_and_did_not_keep(cpu_snapshot):
    """In a 400-step apply run (test_apply's I/O-bound loop), 0 -> 2 workers was kept, 2 -> 3
    and prefetch_factor 2 -> 4 were tried and not kept: the final report's fix advised
    `num_workers=3, persistent_workers=True, prefetch_factor=4` all the same."""
    s = stalled(cpu_snapshot, own=0.1, cores=8, workers=(0.3, 0.3))
    settings = {"num_workers": 2, "pin_memory": False, "persistent_workers": False, "prefetch_factor": 2}
    before = next(f for f in evaluate(s).findings if f.rule == "data-stall")
    assert "num_workers=4" in before.fix and "prefetch_factor=4" in before.fix, before.fix

    def record(decision, **after):
        return {"action": "dataloader", "decision": decision, "before": dict(settings), "after": dict(settings, **after)}

    s["actions"] = [{"action": "dataloader", "decision": "kept", "before": dict(settings, num_workers=0, prefetch_factor=None),
                     "after": dict(settings)},
                    record("reverted", num_workers=4), record("reverted", prefetch_factor=4)]
    after = next(f for f in evaluate(s).findings if f.rule == "data-stall")
    assert "num_workers=4" not in after.fix and "prefetch_factor=4" not in after.fix, after.fix
    assert "persistent_workers=True" in after.fix  # not tried: still advised
    assert "apply mode measured num_workers=4, prefetch_factor=4 in this run: not kept" in after.observed
    # A count kept later (the climb went on from it) is not "not kept"
    s["actions"].append(record("kept", num_workers=4))
    assert "num_workers=4" not in next(f for f in evaluate(s).findings if f.rule == "data-stall").observed
    # Everything it would advise measured: no loader settings advised, nothing to apply
    s["actions"] = s["actions"][:3] + [record("reverted", persistent_workers=True)]
    spent = next(f for f in evaluate(s).findings if f.rule == "data-stall")
    assert "DataLoader(" not in spent.fix and spent.can_apply is False, spent.fix


def test_graph_breaks_name_the_host_reads_counted_at_their_lines(cpu_snapshot):
    # Ground truth: one break at model.py:12 (an .item() in forward, run eagerly every step) and
    # a loss.item() at train.py:40 that is no break's: only the first is the break's read.
    s = copy.deepcopy(cpu_snapshot)
    s["compile"] = {"compiles": 3, "graphs": 2, "graph_breaks": 1, "recompiles": 0,
                    "graph_break_sites": [{"where": "model.py:12", "count": 1,
                                           "reason": "Unsupported Tensor.item() call with capture_scalar_outputs=False"}]}
    sources = [{"location": "src/nets/model.py:12", "function": "forward", "kind": "item", "per_step": 1.0,
                "steps": 8, "out_of": 8},
               {"location": "train.py:40", "function": "<module>", "kind": "item", "per_step": 1.0,
                "steps": 8, "out_of": 8}]
    s["syncs"] = dict(s["syncs"], measured=True, per_step=2.0, sampled_steps=8, top_sources=sources,
                      by_kind={"item": 2.0}, backend="cpu")
    found = fired(s)["graph-breaks"]
    assert [read["location"] for read in found.evidence["reads_at_breaks"]] == ["src/nets/model.py:12"]
    assert "at the break the job reads the device: item at src/nets/model.py:12 (1.0/step)" in found.observed
    assert "each a host-device sync on a GPU" in found.observed
    s["syncs"]["backend"] = "cuda"
    assert "CUDA synchronizations, counted by torch's sync debug mode" in fired(s)["graph-breaks"].observed
    s["syncs"]["measured"] = False  # no sampled step: the break alone, as before
    found = fired(s)["graph-breaks"]
    assert found.evidence["reads_at_breaks"] == [] and "reads the device" not in found.observed


def test_gc_pauses_reads_the_collections_since_apply_modes_freeze(cpu_snapshot):
    """Recorded collector figures: the job's own full collections fire gc-pauses with a fix apply
    mode can make; after a freeze of the job's own it cannot (the gc-freeze action leaves it
    alone); while apply mode's freeze is in effect the rule reads the collections since it, over
    the time since, not the run's total (which still holds the pauses from before it)."""
    trained = cpu_snapshot["totals"]["seconds"]

    def collected(full, spent, frozen=0, ours=None):
        s = copy.deepcopy(cpu_snapshot)
        s["habits"]["gc"] = {"collections": [900, 80, full], "seconds": [0.02, 0.01, spent],
                             "full_median_seconds": spent / full, "full_max_seconds": spent / full,
                             "full_steps": [], "frozen": frozen, "tuneup_freeze": ours,
                             "enabled": True, "thresholds": [700, 10, 10]}
        return {f.rule: f for f in evaluate(s).findings}.get("gc-pauses")

    own = collected(6, 0.3 * trained)
    assert own is not None and own.can_apply and "gc.freeze()" in own.fix and "apply mode" not in own.fix
    frozen = collected(6, 0.3 * trained, frozen=150_000)
    assert frozen is not None and not frozen.can_apply and "Call it later" in frozen.fix
    since = {"from_step": 900, "full_collections": 4, "full_seconds": 0.004, "wall_seconds": 3.0, "objects": 150_000}
    assert collected(12, 0.3 * trained + 0.004, frozen=150_000, ours=since) is None  # 0.1%: the freeze worked
    slow = dict(since, full_seconds=0.6)
    still = collected(12, 0.3 * trained + 0.6, frozen=150_000, ours=slow)
    assert still is not None and not still.can_apply, still
    assert "since apply mode's gc.freeze() at step 900" in still.observed and "4 full garbage collections took 0.60 s of 3.0 s" \
        in still.observed, still.observed
    assert "apply mode froze 150,000 objects from step 900 on" in still.fix, still.fix
