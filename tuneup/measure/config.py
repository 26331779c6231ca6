"""The live configuration, read from the job's own objects: never guessed from defaults.

`read_config()` runs off the training thread. The one thread-local setting, autocast, is
read by the model probe inside forward and passed in.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from .device_values import raw_item

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCH_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
MAX_LISTED = 20


def tf32_allowed(op: str) -> bool:
    """Whether CUDA runs float32 `op`s ("matmul": cuBLAS, "conv": cuDNN) in TF32. torch from 2.9
    keeps one precision per backend and op (torch/backends/__init__.py _FP32Precision, read by
    torch._C._get_fp32_precision_getter): "tf32", "ieee", or "none" for the level above's (cuDNN
    conv, then CUDA's "all", then the generic one; "none" at the top is IEEE). The legacy flags
    map onto it: by default matmul reads "none" (IEEE: torch.get_float32_matmul_precision()
    "highest") and conv "tf32" (torch.backends.cudnn.allow_tf32 is True), and the legacy
    getters raise once both APIs were mixed ("a mix of the legacy and new APIs"), so they are
    read only on a torch without the new one (a job that set the new API alone made them raise too:
    `torch.backends.cuda.matmul.fp32_precision = "tf32"`, then `matmul.allow_tf32` and
    torch.get_float32_matmul_precision() raise RuntimeError on torch 2.13, and the whole
    configuration went unread)."""
    levels = ((torch.backends.cuda.matmul,) if op == "matmul" else (torch.backends.cudnn.conv,)) + (
        torch.backends.cudnn, torch.backends)  # cudnn.fp32_precision is CUDA's "all"
    try:
        for level in levels:
            value = level.fp32_precision
            if value != "none":
                return value == "tf32"
        return False
    except (AttributeError, RuntimeError):  # torch < 2.9: the legacy flags alone
        if op == "matmul":
            return torch.get_float32_matmul_precision() != "highest"
        return bool(torch.backends.cudnn.allow_tf32)



def float32_matmul_precision() -> str:
    """torch.get_float32_matmul_precision(), or what the new API's matmul setting means where
    that getter raises (the legacy and new APIs both used: tf32_allowed)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "high" if tf32_allowed("matmul") else "highest"


def backends() -> dict[str, Any]:
    cudnn = torch.backends.cudnn
    return {
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_allow_tf32": tf32_allowed("conv"),
        "matmul_allow_tf32": tf32_allowed("matmul"),
        "float32_matmul_precision": float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def debug_tools() -> dict[str, Any]:
    try:
        profiler = bool(torch._C._autograd._profiler_enabled())
    except Exception:
        profiler = None
    return {"anomaly_detection": torch.is_anomaly_enabled(), "profiler": profiler}


# The settings apply mode's DataLoader action tunes (act/loader_switch.py reads them from here).
LOADER_KNOBS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")
DEFAULT_PREFETCH_FACTOR = 2  # batches each worker keeps ahead where the loader leaves it unset


def loader_config(loader: DataLoader, job_own: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loader's settings; with `job_own` (the job's own, where apply mode set others on
    the loader), `set_by_tuneup`: the knobs that differ, each with the job's value."""
    context = loader.multiprocessing_context
    if context is not None and not isinstance(context, str):
        context = context.get_start_method()
    config = {
        "dataset": type(loader.dataset).__name__,
        "iterable_dataset": isinstance(loader.dataset, IterableDataset),
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "pin_memory": bool(loader.pin_memory),
        "persistent_workers": bool(loader.persistent_workers),
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
        "drop_last": bool(loader.drop_last),
        "multiprocessing_context": context,
        "worker_init_fn": loader.worker_init_fn is not None,
    }
    if job_own:
        own = dict(job_own)
        if own.get("prefetch_factor") is None:  # workers' default (torch/utils/data/dataloader.py: None -> 2)
            own["prefetch_factor"] = DEFAULT_PREFETCH_FACTOR
        changed = {knob: job_own[knob] for knob in LOADER_KNOBS
                   if knob in own and config[knob] != own[knob] and not (knob == "prefetch_factor"
                                                                         and not config["num_workers"])}
        if changed:
            config["set_by_tuneup"] = changed
    return config


def amp_facts(model: nn.Module) -> dict[str, Any]:
    """What amp_refusal asks of a model, read off the live object: its class, whether it is
    compiled, whether its `forward` is set on the instance (autocast goes on the class's
    forward, which such an instance never calls), whether it has sparse gradients (an
    Embedding or EmbeddingBag with sparse=True: the guard's finiteness check reads dense ones)."""
    return {"class": type(model).__name__, "compiled": is_compiled(model),
            "forward_on_instance": "forward" in vars(model),
            "sparse_gradients": any(getattr(module, "sparse", False) for module in model.modules()
                                    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)))}


def is_compiled(model: nn.Module) -> bool:
    """torch.compile(model) (an OptimizedModule) or model.compile() (in place)."""
    return type(model).__name__ == "OptimizedModule" or getattr(model, "_compiled_call_impl", None) is not None


def plain_number(value: Any) -> float | None:
    """A plain number from a hyperparameter that may be a tensor (a learning rate); never reads
    a device, and a CPU tensor is read with raw_item: tuneup's own read, not the job's."""
    if type(value) is float:
        return value
    if isinstance(value, torch.Tensor):
        return float(raw_item(value)) if value.is_cpu and value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) else None


def _implementation(optimizer: torch.optim.Optimizer) -> str:
    """for-loop, foreach or fused: what optimizer.step() actually runs."""
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    foreach = defaults.get("foreach")
    if foreach is None and "foreach" in defaults:
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach

            params = [p for group in optimizer.param_groups for p in group["params"]]
            _, foreach = _default_to_fused_or_foreach(params, bool(defaults.get("differentiable")), use_fused=False)
        except Exception:
            return "default"
    if "foreach" not in defaults:
        return "n/a"
    return "foreach" if foreach else "for-loop"


def optimizer_config(optimizer: torch.optim.Optimizer, measured_lr: dict[str, Any] | None = None) -> dict[str, Any]:
    """`measured_lr`: the learning rate as read at detail steps (optimizer.py LearningRate)."""
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    return {
        "class": type(optimizer).__name__,
        "implementation": _implementation(optimizer),
        "foreach": optimizer.defaults.get("foreach"),
        "fused": optimizer.defaults.get("fused"),
        "param_groups": len(groups),
        "parameters": sum(p.numel() for p in params),
        "devices": sorted({p.device.type for p in params}),
        "lr": plain_number(groups[0].get("lr")) if groups else None,
        "lr_scheduler": bool(groups and "initial_lr" in groups[0])
        or bool(getattr(optimizer.step, "_wrapped_by_lr_sched", False)),
        "lr_measured": measured_lr,
    }


def trained(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> list[str]:
    """The classes of the models whose parameters `optimizer` updates (a GAN's two Adams: one
    trains the generator, the other the discriminator)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [type(model).__name__ for model in models if any(id(p) in held for p in model.parameters())]


def _sizes(module: nn.Module) -> dict[str, int] | None:
    if isinstance(module, nn.Linear):
        return {"in_features": module.in_features, "out_features": module.out_features}
    if isinstance(module, _CONV):
        return {"in_channels": module.in_channels, "out_channels": module.out_channels}
    if isinstance(module, nn.Embedding):
        return {"num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim}
    return None


def _conv_bias_before_batchnorm(order: list[nn.Module], names: dict[int, str]) -> list[str]:
    found = []
    for first, second in zip(order, order[1:]):
        if (
            isinstance(first, _CONV)
            and first.bias is not None
            and isinstance(second, _BATCH_NORM)
            and second.num_features == first.out_channels
        ):
            name = names.get(id(first))
            if name is not None and name not in found:
                found.append(name)
    return found


def model_config(model: nn.Module, leaf_order: list[nn.Module] | None) -> dict[str, Any]:
    names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}
    if leaf_order:
        order = [m for m in leaf_order if id(m) in names]
        order_source = "execution"
    else:
        order = [m for m in model.modules() if next(m.children(), None) is None]
        order_source = "declaration"
    dtypes: dict[str, int] = {}
    devices: set[str] = set()
    conv_weights = []
    parameters = 0
    for parameter in model.parameters():
        key = str(parameter.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + parameter.numel()
        devices.add(parameter.device.type)
        parameters += parameter.numel()
    misaligned = []
    misaligned_count = 0
    for name, module in model.named_modules():
        if isinstance(module, _CONV) and module.weight.dim() == 4:
            conv_weights.append(module.weight)
        sizes = _sizes(module)
        if sizes and any(value % 8 for value in sizes.values()):
            misaligned_count += 1
            if len(misaligned) < MAX_LISTED:
                misaligned.append({"module": name, "type": type(module).__name__, **sizes})
    if conv_weights:
        channels_last = all(
            w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in conv_weights
        )
        memory_format = "channels_last" if channels_last else "contiguous"
    else:
        memory_format = None
    wrapper = None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        wrapper = "DistributedDataParallel"
    elif isinstance(model, nn.DataParallel):
        wrapper = "DataParallel"
    return {
        **amp_facts(model),  # class, compiled, forward_on_instance, sparse_gradients
        "parameters": parameters,
        "dtypes": dtypes,
        "devices": sorted(devices),
        "training": model.training,
        "memory_format": memory_format,
        "parallel": wrapper,
        "convolutions": sum(1 for m in model.modules() if isinstance(m, _CONV)),
        "conv_bias_before_batchnorm": _conv_bias_before_batchnorm(order, names),
        "module_order": order_source,
        "not_multiple_of_8": misaligned,
        "not_multiple_of_8_count": misaligned_count,
    }


def _proc_cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux): the fallback where torch is too old
    to report them itself."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_CPU_BF16_DETECTED: bool | None = None


def cpu_bf16_detected() -> bool:
    """Whether this CPU has bf16 matrix units (AVX512-BF16 or AMX), as torch's own cpuinfo
    reads them (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`); read once."""
    global _CPU_BF16_DETECTED
    if _CPU_BF16_DETECTED is None:
        try:
            import torch.cpu

            _CPU_BF16_DETECTED = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except (AttributeError, RuntimeError):
            _CPU_BF16_DETECTED = bool(_proc_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return _CPU_BF16_DETECTED


def cuda_bf16(index: int | None = None) -> bool:
    """Whether this GPU runs bf16 natively: compute capability 8.0 (Ampere) or newer.
    torch.cuda.is_bf16_supported() is no test for it: it also says True where bf16 is only
    emulated (V100, T4: `including_emulation=True` by default, torch/cuda/__init__.py), where
    bf16 autocast is slower than fp32 and fp16 with a GradScaler is the reduced precision."""
    return torch.cuda.get_device_capability(index)[0] >= 8


def hardware(cpu_bf16: bool | None = None) -> dict[str, Any]:
    """What the AMP and TF32 rules need: bf16 on this CPU (AVX512-BF16 or AMX: where CPU
    autocast pays off) and, once the job initialized CUDA, each GPU's compute capability.

    `cpu_bf16` (the `cpu_bf16` option, TUNEUP_CPU_BF16) overrides the detected CPU capability:
    None uses what the CPU reports. The advice depends on it (amp-off fires for fp32 jobs on a
    CPU with bf16 units), so tests pin it and `tuneup doctor` shows which one is in force."""
    detected = cpu_bf16_detected()
    out: dict[str, Any] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16": detected if cpu_bf16 is None else cpu_bf16,
        "cpu_bf16_detected": detected,
        "cpu_bf16_source": "detected" if cpu_bf16 is None else "set by the cpu_bf16 option (TUNEUP_CPU_BF16)",
        "cuda_devices": [],
    }
    if torch.cuda.is_initialized():  # never initialize CUDA for the job
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            out["cuda_devices"].append({
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "capability": [major, minor],
                "bf16": cuda_bf16(index),
                "tensor_cores": major >= 7,
            })
    return out


def distributed() -> dict[str, Any]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return {
                "initialized": True,
                "backend": str(dist.get_backend()),
                "world_size": dist.get_world_size(),
                "rank": dist.get_rank(),
            }
    except Exception:
        pass
    return {"initialized": False}


def read_config(
    *,
    loaders: Iterable[DataLoader],
    optimizers: Iterable[torch.optim.Optimizer],
    models: Iterable[nn.Module],
    rate_of: Callable[[torch.optim.Optimizer], dict[str, Any] | None],
    leaf_order: list[weakref.ref],
    autocast: dict[str, str | None] | None,
    set_to_none: bool | None,
    grad_scaler: dict[str, Any],
    cpu_bf16: bool | None = None,
    loaders_job_own: dict[int, dict[str, Any]] | None = None,
    evaluation_loaders: Iterable[DataLoader] = (),
) -> dict[str, Any]:
    """The job's configuration as it stands. `loaders`: the training loop's; `evaluation_loaders`
    those its evaluation phases fetch from (measure/loader.py LoaderProbe.evaluation_fetch),
    listed apart: the rules and the batch size read the training loaders alone."""
    order = [m for m in (ref() for ref in leaf_order) if m is not None]
    models = [model for model in models if next(model.parameters(), None) is not None]
    optimizers = list(optimizers)
    return {
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_initialized": torch.cuda.is_initialized(),
        },
        "backends": backends(),
        "hardware": hardware(cpu_bf16),
        "debug": debug_tools(),
        "autocast": autocast,
        "zero_grad_set_to_none": set_to_none,
        "grad_scaler": {"present": grad_scaler["present"], "enabled": grad_scaler["enabled"]},
        "loaders": [loader_config(loader, (loaders_job_own or {}).get(id(loader))) for loader in loaders],
        "evaluation_loaders": [loader_config(loader) for loader in evaluation_loaders],
        "optimizers": [dict(optimizer_config(optimizer, rate_of(optimizer)), models=trained(optimizer, models))
                       for optimizer in optimizers],
        "models": [model_config(model, order) for model in models],
        "distributed": distributed(),
    }
