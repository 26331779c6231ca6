"""Precision: a model trained in float64, AMP and TF32 left off, fp16 without a GradScaler,
GradScaler skipping steps, and layer sizes Tensor Cores cannot use fully."""

from __future__ import annotations

from ...format import percent, seconds
from ...measure.terms import CONSISTENT, amp_refusal, shadow_refusal, small_gain_refusal
from ..rule import Evidence, Facts, Missing, rule

AMP_DOC = "https://docs.pytorch.org/docs/stable/amp.html"
# Where the gain was not measured on the job (a GPU job before its model was timed, or one
# it could not be: measure/precision.py): Tensor-Core matmuls and convolutions run at least
# twice as fast in bf16/fp16 as in fp32, so autocast can save up to about half of the forward
# and backward time. On a CPU the hardware says too little (a model of small layers gains
# nothing in bf16, and the casts can cost more than the matmuls save): the rule waits for the
# measured gain there.
AMP_SPEEDUP_SHARE = 0.5
AMP_MIN_GAIN = 0.05  # of a step, measured: less is not worth autocast's numerics (and is noise)
AMP_CONSISTENT = CONSISTENT  # of the trial's interleaved pairs, those where autocast was faster (measure/terms.py)
AMP_MIN_PAIRS = 3
# TF32 runs fp32 matmuls on Tensor Cores: conservatively a third of forward + backward.
TF32_SPEEDUP_SHARE = 1 / 3
# float64 runs at half float32's rate at best (CPU vector units, datacenter GPUs; 1/32-1/64 on
# most consumer GPUs): at least half of forward + backward goes with it.
FP64_SPEEDUP_SHARE = 0.5
FP64_PARAMETERS = 0.5  # share of a model's parameters in float64 that makes it a float64 model


def _float64_models(config: dict) -> list[dict]:
    """The models seen training with FP64_PARAMETERS or more of their parameters in float64."""
    heavy = []
    for model in config.get("models") or []:
        dtypes = model.get("dtypes") or {}
        total = sum(dtypes.values())
        if total and dtypes.get("float64", 0) >= FP64_PARAMETERS * total:
            heavy.append(model)
    return heavy


@rule(
    id="float64-model",
    title="The model trains in float64",
    severity="high",
    inputs="parameter dtypes of the models seen training; the step's forward and backward share",
    threshold=f"{percent(FP64_PARAMETERS)} or more of a trained model's parameters are float64",
    why="float64 runs at half float32's rate at best (CPUs, datacenter GPUs) and at 1/32-1/64 of it on "
        "most consumer GPUs, moves twice the bytes and has no Tensor-Core or AMX path, while training "
        "needs no more than float32. It comes from torch.set_default_dtype(torch.float64), .double(), "
        "or NumPy's float64 arrays made into parameters or inputs.",
    doc="https://docs.pytorch.org/docs/stable/generated/torch.set_default_dtype.html",
)
def float64_model(facts: Facts) -> Evidence | None:
    heavy = _float64_models(facts.config)
    if not heavy:
        return None
    try:
        share = _compute_share(facts)
    except Missing:
        share = None  # too few steps for the split: the finding stands on the dtypes
    names = ", ".join(f"{m['class']} ({m['dtypes'].get('float64', 0):,} float64 parameters)" for m in heavy)
    return Evidence(
        observed=f"{names} trains in float64"
                 + (f"; forward + backward take {percent(share)} of a step" if share is not None else ""),
        numbers={"models": [m["class"] for m in heavy], "compute_share": share},
        fix="model = model.float()   # and the inputs: x = x.float(); torch.from_numpy(a).float()\n"
            "# drop torch.set_default_dtype(torch.float64) / .double() where the job sets them",
        gain=FP64_SPEEDUP_SHARE * share if share is not None else None,
        gain_text=None if share is not None else "2x faster matmuls and half the memory traffic at least; "
                                                  "far more on consumer GPUs",
    )


def _compute_share(facts: Facts) -> float | None:
    window = facts.window
    forward, backward = window.get("forward_ratio"), window.get("backward_ratio")
    if forward is None or backward is None:
        return None
    return forward + backward


def _accelerated(facts: Facts) -> str | None:
    """Where reduced precision pays: 'cuda' (bf16/fp16 Tensor Cores), 'cpu' (AVX512-BF16 or
    AMX), or None."""
    hardware = facts.config.get("hardware") or {}
    if facts.on_cuda:
        devices = hardware.get("cuda_devices")
        if not devices:
            raise Missing("CUDA device capability")
        return "cuda" if all(device.get("tensor_cores") for device in devices) else None
    if hardware.get("cpu_bf16") is None:
        raise Missing("CPU capability")
    return "cpu" if hardware["cpu_bf16"] else None


def _native_bf16(facts: Facts) -> bool | None:
    """Whether the job's hardware runs bf16 natively (every GPU it uses at compute capability
    8.0+, config.cuda_bf16; a CPU with AVX512-BF16/AMX); None where that was not read."""
    hardware = facts.config.get("hardware") or {}
    if facts.on_cuda:
        devices = hardware.get("cuda_devices") or []
        return all(device.get("bf16") for device in devices) if devices else None
    value = hardware.get("cpu_bf16")
    return None if value is None else bool(value)


@rule(
    id="amp-off",
    title="Mixed precision (AMP) is off on hardware that accelerates it",
    severity="medium",
    inputs="autocast state seen inside the forward, parameter dtypes, GPU compute capability or CPU bf16 "
           "support, the model's forward + backward timed once in fp32 and under autocast",
    threshold=f"no autocast and fp32 parameters on Tensor-Core GPUs (sm_70+) or a CPU with AVX512-BF16/AMX, "
              f"and autocast measured to save >= {AMP_MIN_GAIN:.0%} of a step on the job's own model and batch, "
              f"faster in >= {AMP_CONSISTENT:.0%} of >= {AMP_MIN_PAIRS} interleaved timings "
              "(on a GPU where it could not be timed: estimated, and said so)",
    why="On such hardware bf16/fp16 matmuls and convolutions can run 2x faster than fp32 and "
        "move half the bytes, but whether a job gains depends on its model and machine: small "
        "layers gain nothing and the casts cost time, so the gain is timed on the job's own model.",
    doc=AMP_DOC,
    can_apply=True,
)
def amp_off(facts: Facts) -> Evidence | None:
    # (The job's own precision: where the autocast seen is apply mode's, the advice to write it
    # into the job stands, with what apply mode measured of it: report/summary.py apply_line.)
    if facts.job_precision is not None or _float64_models(facts.config):
        return None  # a float64 model: float64-model first, AMP once it trains in float32
    autocast = facts.config.get("autocast")
    if autocast is None:
        raise Missing("autocast state (no forward seen)")
    device = _accelerated(facts)
    if device is None:
        return None
    share = _compute_share(facts)
    trial = (facts.snapshot.get("habits") or {}).get("amp_trial")
    measured = trial is not None and not trial.get("skipped") and trial.get("fp32_seconds")
    if measured:
        step = facts.window["step_seconds"]["median"]
        saved = trial["fp32_seconds"] - trial["reduced_seconds"]
        gain = saved / step if step > 0 else 0.0
        if share is not None:
            gain = min(gain, share)  # timed apart from the step: never more than its compute
        pairs = trial.get("pairs") or 0
        if gain < AMP_MIN_GAIN or pairs < AMP_MIN_PAIRS or (trial.get("faster_pairs") or 0) < AMP_CONSISTENT * pairs:
            return None  # not measurably faster: too little, or not in most of the pairs
        bf16 = trial["dtype"] == "bfloat16"
        what = (f"{trial['dtype']} autocast measured {trial['speedup']:.2f}x as fast on the model's forward + "
                f"backward ({trial.get('model') or 'the model'}, this job's batch): {seconds(trial['fp32_seconds'])} "
                f"-> {seconds(trial['reduced_seconds'])} of a {seconds(step)} step, faster in "
                f"{trial['faster_pairs']} of {pairs} interleaved pairs")
        gain_text = f"about {gain:.0%} shorter steps (measured on the job's model)"
    elif device == "cpu":
        raise Missing("the model timed in fp32 and bf16" + (f" ({trial['skipped']})" if trial else ""))
    else:
        bf16 = _native_bf16(facts)  # (_accelerated found the devices)
        what = ("forward + backward take " + percent(share) + " of a step") if share is not None else None
        gain = AMP_SPEEDUP_SHARE * share if share is not None else None
        gain_text = (f"up to {gain:.0%} shorter steps (an estimate, not measured on this job: Tensor Cores run "
                     "bf16/fp16 matmuls about 2x faster)" if gain is not None
                     else "typically 1.5-3x faster matmuls and convolutions (not measured on this job)")
    # What apply mode's AMP action asks too: a safe job, and a gain measured clearly enough.
    refusal = (amp_refusal(facts.config) or shadow_refusal(trial if measured else None)
               or (small_gain_refusal(gain, trial) if measured else None))
    if bf16:
        fix = (f"with torch.autocast(device_type=\"{device}\", dtype=torch.bfloat16):\n"
               "    loss = loss_fn(model(x), y)\nloss.backward()")
    else:
        fix = ("scaler = torch.amp.GradScaler(\"cuda\")\n"
               "with torch.autocast(device_type=\"cuda\", dtype=torch.float16):\n"
               "    loss = loss_fn(model(x), y)\n"
               "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()")
    # The framework owns the precision (and, for fp16, the GradScaler) where there is one.
    fix = facts.spoken(
        fix,
        lightning=f"trainer = L.Trainer(..., precision=\"{'bf16-mixed' if bf16 else '16-mixed'}\")",
        transformers=f"TrainingArguments(..., {'bf16' if bf16 else 'fp16'}=True)",
        accelerate=f"accelerator = Accelerator(mixed_precision=\"{'bf16' if bf16 else 'fp16'}\")")
    return Evidence(
        observed=f"autocast is off and the model is fp32 on {device.upper()} hardware with "
                 f"{'bf16' if bf16 else 'fp16'} acceleration" + (f"; {what}" if what else ""),
        numbers={"device": device, "dtype": "bfloat16" if bf16 else "float16", "compute_share": share,
                 "measured": bool(measured), **({"trial": trial} if measured else {}),
                 **({"timing": "pending"} if trial is None else {}),  # the model not timed yet
                 **({"not_applicable": refusal} if refusal else {})},
        fix=fix,
        can_apply=refusal is None,  # the test apply mode's AMP action asks
        gain=gain,
        gain_text=gain_text,
    )


@rule(
    id="tf32-off",
    title="TF32 is off for fp32 matmuls on an Ampere-or-newer GPU",
    severity="low",
    inputs="float32 matmul precision and TF32 flags, GPU compute capability, autocast state",
    threshold="fp32 training (no autocast) on sm_80+ with float32_matmul_precision 'highest'",
    why="TF32 runs fp32 matmuls on Tensor Cores with a 10-bit mantissa, accurate enough for "
        "training in practice (PyTorch's own guidance); 'highest' leaves that speed unused.",
    doc="https://docs.pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices",
)
def tf32_off(facts: Facts) -> Evidence | None:
    if not facts.on_cuda:
        raise Missing("a CUDA job")
    if facts.reduced_precision is not None:
        return None
    devices = facts.need((facts.config.get("hardware") or {}).get("cuda_devices") or None, "GPU capability")
    backends = facts.config["backends"]
    if not all(d["capability"][0] >= 8 for d in devices):
        return None
    if backends.get("float32_matmul_precision") != "highest" or backends.get("matmul_allow_tf32"):
        return None
    share = _compute_share(facts)
    return Evidence(
        observed="float32 matmuls run in full fp32 precision on "
                 + ", ".join(d["name"] for d in devices),
        numbers={"float32_matmul_precision": backends.get("float32_matmul_precision"),
                 "cudnn_allow_tf32": backends.get("cudnn_allow_tf32"), "compute_share": share},
        fix='torch.set_float32_matmul_precision("high")   # TF32 for fp32 matmuls\n'
            "torch.backends.cudnn.allow_tf32 = True",
        gain=TF32_SPEEDUP_SHARE * share if share is not None else None,
    )


@rule(
    id="fp16-without-scaler",
    title="fp16 autocast without a GradScaler",
    severity="high",
    inputs="autocast dtype seen inside the forward; GradScaler presence and state",
    threshold="float16 autocast with no enabled GradScaler",
    why="fp16 gradients below 6e-8 flush to zero: without loss scaling small gradients vanish "
        "and training silently stalls or diverges. bf16 has fp32's range and needs no scaler.",
    doc="https://docs.pytorch.org/docs/stable/notes/amp_examples.html",
)
def fp16_without_scaler(facts: Facts) -> Evidence | None:
    autocast = facts.need(facts.config.get("autocast"), "autocast state")
    fp16 = [device for device, dtype in autocast.items() if dtype == "float16"]
    if not fp16:
        return None
    scaler = facts.scaler
    if scaler.get("present") and scaler.get("enabled"):
        return None
    device = fp16[0]
    return Evidence(
        observed=f"autocast runs in float16 on {device} and no enabled GradScaler scales the loss",
        numbers={"autocast": autocast, "grad_scaler": {k: scaler.get(k) for k in ("present", "enabled")}},
        fix=facts.spoken(
            f"scaler = torch.amp.GradScaler(\"{device}\")\n"
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()\n"
            f"# or: torch.autocast(\"{device}\", dtype=torch.bfloat16) and no scaler",
            lightning="trainer = L.Trainer(..., precision=\"16-mixed\")  # autocast and a GradScaler\n"
                      "# or: precision=\"bf16-mixed\" (no scaler needed)",
            transformers="TrainingArguments(..., fp16=True)  # autocast and a GradScaler\n# or: bf16=True",
            accelerate="accelerator = Accelerator(mixed_precision=\"fp16\")  # autocast and a GradScaler\n"
                       "# or: mixed_precision=\"bf16\""),
        gain_text="correct gradients (no underflow), not speed",
    )


SKIP_RATE = 0.02
MIN_SCALER_STEPS = 50


@rule(
    id="scaler-skips",
    title="GradScaler skips optimizer steps",
    severity="high",
    inputs="GradScaler skipped steps, back-offs and scale, read without a sync per step; whether the hardware "
           "runs bf16 natively (which fix)",
    threshold=f"skip rate >= {percent(SKIP_RATE)} over >= {MIN_SCALER_STEPS} steps past warm-up, or scale < 1",
    why="By design GradScaler skips about 1 step in 2000 (a back-off after each growth); 2% is "
        "40x that: real overflows in fp16, each a wasted step. A scale below 1 means gradients "
        "overflow even unscaled.",
    doc="https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling",
)
def scaler_skips(facts: Facts) -> Evidence | None:
    scaler = facts.scaler
    if not scaler.get("present") or not scaler.get("enabled"):
        raise Missing("an enabled GradScaler")
    window = facts.window
    steps = window["steps"]
    skipped = window.get("skipped_steps") or 0
    if steps < MIN_SCALER_STEPS:
        raise Missing("enough steps")
    rate = skipped / steps
    scale = scaler.get("scale")
    collapsed = scale is not None and scale < 1
    if rate < SKIP_RATE and not collapsed:
        return None
    native = _native_bf16(facts)
    return Evidence(
        observed=f"{skipped} of the last {steps} optimizer steps were skipped ({percent(rate)}), "
                 f"longest run {scaler.get('longest_skip_run')}, {scaler.get('backoff_events')} back-offs, "
                 f"scale now {scale:g}" if scale is not None else f"{skipped} of {steps} steps skipped",
        numbers={"skip_rate": rate, "skipped_steps": skipped, "steps": steps, "scale": scale,
                 "longest_skip_run": scaler.get("longest_skip_run"), "backoff_events": scaler.get("backoff_events"),
                 "bf16_native": native},
        fix=_overflow_fix(facts, native),
        gain=rate or None,  # a collapsed scale with no skips yet: a finding for correctness, not speed
        gain_text=f"{percent(rate)} of steps stop being wasted" if rate >= 0.005 else None,
    )


_FIND_OVERFLOW = ("find the overflow: softmax/sum/exp in fp16, eps like 1e-8, float('inf') masks:\n"
                  "#   scores = scores.float().softmax(-1)   and use torch.finfo(x.dtype).min instead of -inf constants")


def _overflow_fix(facts: Facts, native: bool | None) -> str:
    """bf16 autocast (fp32's range: no overflow, no scaler) where the hardware runs it natively;
    where it only emulates bf16 (V100, T4, a CPU without bf16 units: slower than fp32, 14x on
    an AVX2 CPU's MLP) finding the overflow is the fix, and bf16 is not offered."""
    device = "cuda" if facts.on_cuda else "cpu"
    if native is False:
        where = "this GPU (compute capability below 8.0)" if facts.on_cuda else "this CPU (no AVX512-BF16/AMX)"
        return f"# {_FIND_OVERFLOW}\n# (bf16, which needs no scaler, is emulated on {where}: slower than fp32)"
    return (f'with torch.autocast(device_type="{device}", dtype=torch.bfloat16):   # fp32 range: no overflow, '
            "no scaler" + ("" if native else " (where the hardware runs bf16: compute capability 8.0+, "
                                               "AVX512-BF16/AMX)") + "\n"
            "    loss = loss_fn(model(x), y)\n"
            "# staying on fp16? " + _FIND_OVERFLOW)


MIN_ALIGNED_SIZE = 64


@rule(
    id="tensor-core-alignment",
    title="Layer sizes are not multiples of 8 under reduced precision",
    severity="low",
    inputs="Linear/Conv/Embedding sizes of the model; autocast dtype",
    threshold=f"fp16/bf16 in use and a Linear/Conv/Embedding size >= {MIN_ALIGNED_SIZE} not divisible by 8",
    why="Tensor Cores (and AMX tiles) work on blocks of 8 (fp16/bf16) elements; other sizes fall "
        "back to padded or slower kernels. Sizes under 64 (RGB inputs, class heads) cost too "
        "little to matter.",
    doc="https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html#tensor-core-shape",
)
def tensor_core_alignment(facts: Facts) -> Evidence | None:
    dtype = facts.reduced_precision
    if dtype is None:
        raise Missing("reduced precision in use")
    misaligned = [entry for model in facts.models for entry in model.get("not_multiple_of_8") or []
                  if any(value % 8 and value >= MIN_ALIGNED_SIZE for key, value in entry.items()
                         if key not in ("module", "type"))]
    count = len(misaligned)
    if not count:
        return None
    listed = ", ".join(
        f"{entry['module']} ({entry['type']} " + "x".join(str(v) for k, v in entry.items() if k not in ("module", "type")) + ")"
        for entry in misaligned[:4])
    ours = facts.tuneups("amp")  # the autocast is apply mode's: the sizes matter once the job adopts it
    return Evidence(
        observed=f"{count} layers under {dtype} have sizes not divisible by 8: {listed}"
                 + (f" (under the autocast tuneup's apply mode switched on, change {ours.get('id')}; "
                    "not the job's own precision)" if ours else ""),
        numbers={"count": count, "layers": misaligned[:10], "dtype": dtype},
        fix="nn.Linear(in_features, 8 * math.ceil(out_features / 8))   # pad sizes (and vocabularies) to multiples of 8",
        gain_text="full Tensor-Core throughput for those layers",
        severity="medium" if facts.on_cuda else None,
    )
