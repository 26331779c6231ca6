"""The FLOPs a training step does, counted on the job's own model with torch's own counter,
and how much of the device's peak they reach (model FLOPs utilization, MFU).

Counted, not guessed: `torch.utils.flop_counter.FlopCounterMode` is a dispatch mode that adds
up each aten op's FLOPs from its shapes (2·m·n·k for a matmul, the convolution's and
attention's formulas: torch/utils/flop_counter.py `flop_registry`); ops it has no formula for
(elementwise, softmax, norms) count nothing, as in the usual MFU convention. It runs around one
forward and backward of the model on the input a training forward took, on meta tensors: the
same shapes and dtypes, no data, no device memory, no arithmetic:

    close of step N     the count waits for the trained model (the largest, if several)
    next detail step    its training forward's input, as meta tensors (shapes and dtypes only),
                        taken by the model probe's forward wrapper before the forward runs
    close of that step  forward + backward on meta parameters under the counter, the model's
                        hooks set aside and tuneup's probe off (offstep.unseen), on the
                        training thread between two steps

The job's step is untouched: its tensors, gradients and random stream are never used (the
counted ones are meta copies), so its results are bit-identical to an uncounted run. A model
whose forward depends on its data (nonzero, a boolean mask, .item()) cannot run on shapes alone:
the count is skipped and says why, as it is for a compiled model (its graphs run the step, not
its forward), an FSDP one and a job with global module hooks.

Looked at again after every lifecycle check past the first count (RECHECK_STEPS: each one, 64
steps apart; the look waits for the next detail step, so paced detail steps make looks rarer:
12 in 3,000 steps of bench_flops.py's 0.6 ms step): a one-shot capture reads, before that
detail step's training forward, the input's
shapes and the precision the step runs in; a new signature is counted (at most MAX_COUNTS;
where they vary, the FLOPs per batch are the median of the counts, an estimate). The precision
is no part of a count: it changes no FLOP, only the peak MFU divides by, so a loop that turns on
bf16 autocast at step 100 (or apply mode's AMP change, whose forward enters autocast around
tuneup's wrapper: actions/amp.py) is read as bf16 from the next look on, without a recount.
A count keeps its FLOPs by kind (matmul, convolution, fp8 matmul: torch._scaled_mm), as each
kind's precision is set apart (TF32 for matmuls and for cuDNN's convolutions are separate
flags), and MFU divides by the FLOP-weighted peak (utilization.py).
Nothing of this runs on ordinary steps: the per-step figures (achieved FLOP/s, MFU) are the
count over the measured step time, computed where the snapshot is read (utilization.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from .config import tf32_allowed
from .model import forward_autocast
from .offstep import ModelCapture, unseen

FROM_STEP = 6  # past the first detail steps: the model and its input are what training uses
RECHECK_STEPS = 1  # after the first count, a look (shapes, precision) at the next lifecycle check this far on
MAX_COUNTS = 8  # distinct input shapes counted, at most
TOP_MODULES = 5


def _meta(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                      device="meta"), value)


def _signature(args: tuple, kwargs: dict) -> tuple:
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                 for leaf in tree_leaves((args, kwargs)))


def _first_dim(args: tuple, kwargs: dict) -> int | None:
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


KINDS = ("matmul", "conv", "fp8")  # the kinds of FLOP whose precision is set apart
# FlopCounterMode's ops (torch/utils/flop_counter.py flop_registry) that are convolutions, run
# by cuDNN on CUDA (TF32 per torch.backends.cudnn's flag, not the matmul one); _scaled_mm is the
# fp8 matmul (its operands float8, scaled: torchao's Float8Linear, Transformer Engine's own
# kernels aside); everything else counted (mm, addmm, bmm, baddbmm, attention) is a matmul.
_CONV_OPS = {"convolution", "_convolution", "cudnn_convolution", "convolution_overrideable",
             "convolution_backward", "cudnn_convolution_transpose"}
_FP8_OPS = {"_scaled_mm"}


def _kind(op: Any) -> str:
    name = getattr(op, "__name__", str(op))
    return "conv" if name in _CONV_OPS else "fp8" if name in _FP8_OPS else "matmul"


def _dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` as "bfloat16"; every float8 dtype as "fp8" (the peak's key)."""
    name = str(dtype).replace("torch.", "")
    return "fp8" if name.startswith("float8") else name


def _step_precision(module: nn.Module, parameter: torch.Tensor) -> dict[str, str]:
    """{"matmul", "conv"}: the precision the forward's matmuls and convolutions run in, read
    before the forward on the training thread: autocast's dtype where it is on, in the thread
    or entered by the module's own forward (Accelerate's, after this looks: model.py
    forward_autocast; autocast casts both to its dtype), else the parameters'; fp32 on CUDA is
    TF32 for the kinds whose flag allows it (config.tf32_allowed)."""
    device = parameter.device.type
    try:
        if torch.is_autocast_enabled(device):
            dtype = _dtype_name(torch.get_autocast_dtype(device))
            return {"matmul": dtype, "conv": dtype}
    except (TypeError, AttributeError, RuntimeError):  # an older torch: autocast state by device kind
        pass
    entered = forward_autocast(module).get(device)
    if entered is not None:
        return {"matmul": entered, "conv": entered}
    dtype = _dtype_name(parameter.dtype)
    if dtype != "float32" or device != "cuda":
        return {"matmul": dtype, "conv": dtype}
    return {kind: "tf32" if tf32_allowed(kind) else "float32" for kind in ("matmul", "conv")}


def _by_kind(counts: dict[Any, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, flops in counts.items():
        if flops:
            out[_kind(op)] = out.get(_kind(op), 0) + flops
    return out


def precision_label(precisions: dict[str, str], by_kind: dict[str, float]) -> str | None:
    """The step's precision as one name: the kinds' precisions, the most FLOPs first, joined
    by "+" where they differ ("float32+tf32": fp32 matmuls, TF32 convolutions)."""
    names = [precisions[kind] for kind in sorted(by_kind, key=lambda kind: -by_kind[kind]) if kind in precisions]
    return "+".join(dict.fromkeys(names)) or None


def _repeated(name: str, modules: dict[str, nn.Module]) -> str:
    """`name` with its block index starred: the first numeric part whose container holds two
    or more children of that child's class (a ModuleList of layers), so `Sequential.0.layers.1.mlp`
    (an encoder wrapped in a Sequential) groups as `Sequential.0.layers.*.mlp`; as it is where none."""
    parts = name.split(".")
    for index in range(1, len(parts)):
        if not parts[index].isdigit():
            continue
        container = modules.get(".".join(parts[:index]))
        child = modules.get(".".join(parts[:index + 1]))
        if container is not None and child is not None and \
                sum(type(other) is type(child) for other in container.children()) >= 2:
            return ".".join(parts[:index] + ["*"] + parts[index + 1:])
    return name


def _top_modules(root: nn.Module, counts: dict[str, dict[Any, int]], forward: dict[str, int]) -> list[dict[str, Any]]:
    """The modules that do the FLOPs (those counted with no counted child), the largest first;
    a layer repeated in every block is one entry (`blocks.*.mlp`: the same class and parameter
    shapes at the same place, the block's index starred by _repeated).

    Only modules that did FLOPs in the forward (`forward`: the counts after it) are credited
    with their backward's: torch's ModuleTracker enters a module's backward with a grad hook on
    its outputs and leaves it with one on its inputs, and where the output is the input tensor
    itself (Dropout(p=0) and Identity return it: ATen's dropout returns its input at p == 0)
    the leaving hook, registered first, runs first, so the module stays entered and is credited
    with every FLOP of the rest of the backward (torch/utils/module_tracker.py, _fw_pre_hook and
    _fw_post_hook). A TransformerEncoder's zero-dropouts took 70% of its FLOPs that way."""
    prefix = type(root).__name__
    modules = {(f"{prefix}.{name}" if name else prefix): module for name, module in root.named_modules()}
    totals = {name: sum(ops.values()) for name, ops in counts.items() if name != "Global" and forward.get(name)}
    leaves = [name for name, flops in totals.items() if flops
              and not any(other.startswith(name + ".") and totals[other] for other in totals)]
    grouped: dict[tuple, list[tuple[str, float]]] = {}
    for name in leaves:
        module = modules.get(name)
        shapes = tuple(tuple(p.shape) for p in module.parameters(recurse=False)) if module is not None else ()
        key = (_repeated(name, modules), type(module).__name__ if module is not None else "?", shapes)
        grouped.setdefault(key, []).append((name, totals[name]))
    whole = sum(totals[name] for name in leaves) or 1
    ranked = sorted(grouped.items(), key=lambda item: -sum(flops for _, flops in item[1]))[:TOP_MODULES]
    return [{"module": pattern if len(members) > 1 else members[0][0], "class": cls, "count": len(members),
             "flops": sum(flops for _, flops in members), "share": sum(flops for _, flops in members) / whole}
            for (pattern, cls, _), members in ranked]


class FlopCount(ModelCapture):
    name = "flops"

    def __init__(self, model_probe: Any) -> None:
        super().__init__(model_probe)
        self.on = True
        self.state = "waiting"  # capturing, then counted (rechecking after RECHECK_STEPS) or done
        self.next_look = FROM_STEP
        self.counts: dict[tuple, dict[str, Any]] = {}  # by input signature
        self.last: dict[str, Any] | None = None  # the latest count
        self.skipped: str | None = None
        self.seconds = 0.0  # counting's own time
        self.precision: dict[str, str] | None = None  # {"matmul", "conv"}: the latest look's (_step_precision)
        self._input: tuple[Any, Any, tuple, dict[str, str] | None] | None = None  # meta args, kwargs, signature, precision

    def due(self, step: int) -> bool:
        return self.on and self.state in ("waiting", "counted") and step >= self.next_look

    def skip(self, reason: str) -> None:
        self.state, self.skipped = "done", reason
        self.release()

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the job's forward, inside it: never raises (a failure waits for finish)."""
        try:
            if self._input is None and module.training and torch.is_grad_enabled():
                parameter = next(module.parameters(), None)
                signature = _signature(args, kwargs)
                precision = _step_precision(module, parameter) if parameter is not None else None
                known = signature in self.counts or len(self.counts) >= MAX_COUNTS
                inputs = (None, None) if known else (_meta(args), _meta(kwargs))
                self._input = (*inputs, signature, precision)
        except Exception as exc:
            self._failure = exc
        return None

    def finish(self, step: int, on_fail: Any) -> None:
        """At the close of the step captured (or given up on): count the input if its shapes are new."""
        self.release()
        model, captured, self._model, self._input = self._model, self._input, None, None
        self.state, self.next_look = "counted", step + RECHECK_STEPS
        began = time.perf_counter()
        try:
            if self._failure is not None:
                raise self._failure
            if model is None or captured is None:
                self.state, self.next_look = ("counted" if self.counts else "waiting"), step + 1
                return
            args, kwargs, signature, precision = captured
            if precision is not None:
                self.precision = precision  # the step's, as of this look: a count's or not
            if signature in self.counts:
                self.last = self.counts[signature]
                return
            if len(self.counts) >= MAX_COUNTS:  # room for no more shapes: the precision still looked at
                return
            self.last = self.counts[signature] = self._count(model, args, kwargs)
        except _Skip as exc:
            self.skip(str(exc))
        except Exception as exc:
            self.on = False
            self.skip(f"the count failed: {type(exc).__name__}: {exc}")
            on_fail(self.name, exc)
        finally:
            self.seconds += time.perf_counter() - began

    def _count(self, model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
        from torch.utils.flop_counter import FlopCounterMode

        parameter = next(model.parameters(), None)
        if parameter is None:
            raise _Skip("the model has no parameters")
        params = {name: torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta").requires_grad_(p.requires_grad)
                  for name, p in model.named_parameters()}
        buffers = {name: torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="meta")
                   for name, b in model.named_buffers()}
        leaves = [p for p in params.values() if p.requires_grad]
        counter = FlopCounterMode(display=False)
        try:
            with unseen(model, self.models), torch.enable_grad(), counter:
                output = torch.func.functional_call(model, (params, buffers), args, kwargs)
                forward = counter.get_total_flops()
                by_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
                found = [leaf.float().sum() for leaf in tree_leaves(output)
                         if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.grad_fn is not None]
                if found and leaves:
                    torch.autograd.grad(torch.stack(found).sum(), leaves, allow_unused=True)
                total = counter.get_total_flops()
        except Exception as exc:
            # The model's own code on meta tensors: an op that needs data (.item(), a boolean
            # mask), one without a meta kernel, an assertion on values. Shapes alone cannot run it.
            raise _Skip(f"the forward cannot run on shapes alone ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None
        device = parameter.device
        cuda = device.type == "cuda"
        name = torch.cuda.get_device_name(device) if cuda else None
        capability = list(torch.cuda.get_device_capability(device)) if cuda else None
        counts = counter.get_flop_counts()
        return {"model": type(model).__name__, "forward_flops": forward, "backward_flops": total - forward,
                "flops": total, "flops_by_kind": _by_kind(counts.get("Global", {})), "batch": _first_dim(args, kwargs),
                "device": device.type, "device_name": name, "capability": capability,
                "top_modules": _top_modules(model, counts, by_module)}

    def summary(self) -> dict[str, Any] | None:
        """The latest count (the median over the shapes counted where they vary), or why none,
        with the precision of the latest look: by kind of FLOP (`precisions`) and as one name
        (`dtype`, precision_label)."""
        if self.last is None:
            return {"skipped": self.skipped} if self.skipped else None
        out = dict(self.last, counts=len(self.counts), seconds=self.seconds)
        if len(self.counts) > 1:
            for key in ("forward_flops", "backward_flops", "flops"):
                out[key] = statistics.median(count[key] for count in self.counts.values())
            # The latest count's shares of the kinds, over the median (a sum of medians is not one).
            whole = self.last["flops"] or 1
            out["flops_by_kind"] = {kind: flops * out["flops"] / whole for kind, flops in self.last["flops_by_kind"].items()}
        looked = self.precision or {}
        out["precisions"] = {kind: "fp8" if kind == "fp8" else looked.get(kind, "float32")
                             for kind in out["flops_by_kind"]}
        out["dtype"] = precision_label(out["precisions"], out["flops_by_kind"]) or looked.get("matmul", "float32")
        if self.skipped:
            out["stopped"] = self.skipped
        return out


class _Skip(RuntimeError):
    """No count for this model; the message says why."""
