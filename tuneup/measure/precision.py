"""What bf16 (or fp16) autocast would save on this job, measured once on its own model.

Whether reduced precision pays depends on the model and the machine, not only on the
hardware's instruction set: on a 2-core CPU with bf16 units a 1024-wide MLP's step was 0.7-0.8x
as fast under bf16 autocast with two threads and 1.0x with one (the casts cost what the matmuls
save), and timing its layers one by one said 1.0-1.8x (caches warm, no casts between layers).
So the amp-off rule states the gain of the model's own forward + backward, timed whole:

    close of step N     the trial waits for the trained model (the largest, if several)
    next detail step    its training forward's inputs, cloned (one batch) by the model probe's
                        forward wrapper before the forward runs (tuneup's own time)
    close of that step  the forward + backward timed on that input in fp32
                        and under autocast, interleaved, medians (Recorder.on_close, on the
                        training thread, between two steps, once a run, within a budget of a
                        few steps' time)

The job sees none of it:
- torch.func.functional_call runs the model with its parameters detached (gradients by
  torch.autograd.grad: nothing reaches the job's .grad) and its buffers cloned (BatchNorm's
  running statistics stay the job's);
- the random stream is forked (torch.random.fork_rng): dropout draws, and the job's stream
  goes on as if nothing ran;
- every module hook of the model is set aside during the timing, and tuneup's model probe is
  off (offstep.unseen); a job with global module hooks is not timed (they would see the forwards).
Not timed: a compiled model (its graphs run the step, not its forward), a job under autocast, an FSDP model
(sharded parameters), a model whose output holds no tensor a backward can start from. What the
forward keeps in its modules' own attributes (a call counter, a running mean kept as a plain
tensor, a memory bank's queue) is put back as it was (offstep._ModuleState); what it does
outside them (a global, a print) is not undone.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from .hotpath import StepTimeline
from .offstep import MISSES, ModelCapture, unseen
from .terms import CONSISTENT, MIN_PAIRS

FROM_STEP = 40  # past the warm-up the rules leave out: the model runs as it will
# Interleaved fp32 / reduced pairs after one warm-up pair: the result says in how many the
# reduced one was faster (a machine's noise can exceed the difference: a 2-core CPU's MLP
# measured 0.84x to 1.40x on four runs of four pairs).
REPS = 12
# The timing's budget: BUDGET_STEPS of the job's recent steps, within [MIN_BUDGET, MAX_BUDGET]
# seconds, once a run, counted from after the warm-up pair (a first bf16 call can take a
# machine's oneDNN set-up: on a busy machine that alone cut the timing to 3 pairs); fewer
# pairs where they take longer, at least MIN_PAIRS (SHADOW_MIN_PAIRS, measure/terms.py: enough for apply
# mode to act on).
BUDGET_STEPS = 30
MIN_BUDGET, MAX_BUDGET = 0.05, 3.0
MAX_INPUT_BYTES = 1 << 30  # a larger batch is not cloned


def premise(config: dict[str, Any] | None) -> bool:
    """Whether the trial is worth running: no autocast seen in the forward, no half- or
    double-precision model, hardware that accelerates reduced precision (amp-off's premise)."""
    if not config or config.get("autocast") is None or any((config.get("autocast") or {}).values()):
        return False
    for model in config.get("models") or []:
        if any(dtype in (model.get("dtypes") or {}) for dtype in ("float16", "bfloat16", "float64")):
            return False
    hardware = config.get("hardware") or {}
    return bool(hardware.get("cpu_bf16") or any(d.get("tensor_cores") for d in hardware.get("cuda_devices") or []))


def reduced_dtype(config: dict[str, Any] | None, device: torch.device) -> torch.dtype | None:
    """The autocast dtype the hardware accelerates on `device`, per the configuration (the
    job's cpu_bf16 option included), or None."""
    hardware = (config or {}).get("hardware") or {}
    if device.type == "cpu":
        return torch.bfloat16 if hardware.get("cpu_bf16") else None
    if device.type == "cuda":
        devices = hardware.get("cuda_devices") or []
        if not devices or not all(d.get("tensor_cores") for d in devices):
            return None
        return torch.bfloat16 if all(d.get("bf16") for d in devices) else torch.float16
    return None


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch 2.3: no device argument (CUDA's state); the CPU's has its own call
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _clone(value: Any) -> Any:
    """The forward's arguments with every tensor in them copied (torch's pytree: tuples,
    lists, dicts, namedtuples and the containers libraries register, such as ModelOutput)."""
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), value)


def _bytes(value: Any) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


def _scalar(output: Any) -> torch.Tensor | None:
    """The sum of every floating-point tensor in the output that autograd can start from, in
    fp32; None when there is none."""
    found = [leaf.float().sum() for leaf in tree_leaves(output)
             if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.grad_fn is not None]
    return torch.stack(found).sum() if found else None


class PrecisionTrial(ModelCapture):
    name = "precision"

    def __init__(self, timeline: StepTimeline, model_probe: Any) -> None:
        super().__init__(model_probe)
        self.on = True
        self.timeline = timeline
        self.state = "waiting"  # capturing, then done
        self.result: dict[str, Any] | None = None

    # --- the schedule (Recorder.on_close, on the training thread) -------------------------

    def due(self, step: int, config: dict[str, Any] | None) -> bool:
        return self.on and self.state == "waiting" and step >= FROM_STEP and premise(config)

    def skip(self, reason: str) -> None:
        """No trial for this job (a compiled model, say): the reason stands as its result."""
        self.state, self.result = "done", {"skipped": reason}

    def finish(self, config: dict[str, Any] | None, step_seconds: float) -> None:
        """Time the captured input. A failure (an out-of-memory input, say) ends the trial with
        its reason, and the probe is off (`timeline.fail`: one warning)."""
        self.release()
        self.state = "done"
        model, captured, self._model, self._input = self._model, self._input, None, None
        try:
            if self._failure is not None:
                raise self._failure
            if self._skip is not None:
                self.result = {"skipped": self._skip}
            elif model is None or captured is None:
                self.result = {"skipped": f"no training forward of the model ran in {MISSES} watched steps"}
            else:
                budget = min(MAX_BUDGET, max(MIN_BUDGET, BUDGET_STEPS * step_seconds))
                self.result = self._time(model, captured, config, budget)
        except Exception as exc:
            self.result = {"skipped": f"the timing failed: {type(exc).__name__}: {exc}"}
            self.on = False
            self.timeline.fail(self.name, exc)

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first training forward's input, cloned. It runs inside the job's forward, before
        the model's: it never raises (a failure is kept for finish)."""
        try:
            if self._input is not None or self._skip is not None or not (module.training and torch.is_grad_enabled()):
                return
            parameter = next(module.parameters(), None)
            if parameter is None:
                self._skip = "the model has no parameters"
            elif _autocast_on(parameter.device.type):
                self._skip = "the forward runs under autocast"
            elif _bytes((args, kwargs)) > MAX_INPUT_BYTES:
                self._skip = "the batch is too large to copy"
            else:
                self._input = (_clone(args), _clone(kwargs))
        except Exception as exc:
            self._failure = exc
        return None

    # --- timing --------------------------------------------------------------------------

    def _time(self, model: nn.Module, captured: tuple[tuple, dict], config: dict[str, Any] | None,
              budget: float) -> dict[str, Any]:
        parameter = next(model.parameters())
        device = parameter.device
        reduced = reduced_dtype(config, device)
        if reduced is None:
            return {"skipped": f"no reduced precision is accelerated on {device.type}"}
        params = {name: p.detach().requires_grad_(p.requires_grad) for name, p in model.named_parameters()}
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        leaves = [p for p in params.values() if p.requires_grad]
        if not leaves:
            return {"skipped": "the model has no trainable parameters"}
        # The root's input: DDP moves it to the device itself before its module's forward
        # (torch/nn/parallel/distributed.py _pre_forward: _to_kwargs to device_ids[0]).
        args, kwargs = tree_map_only(torch.Tensor, lambda t: t if t.device == device else t.to(device), captured)
        cuda = device.type == "cuda"

        def once(low: bool) -> float:
            if cuda:
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            with torch.autocast(device.type, dtype=reduced, enabled=low):
                output = torch.func.functional_call(model, (params, buffers), args, kwargs)
            total = _scalar(output)
            if total is None:
                raise _NoBackward
            torch.autograd.grad(total, leaves, allow_unused=True)
            if cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - began

        times: dict[bool, list[float]] = {False: [], True: []}
        try:
            with unseen(model, self.models), torch.random.fork_rng(devices=[device] if cuda else []), \
                    torch.enable_grad():
                once(False), once(True)  # a pair to warm up (first calls, caches, kernel choices)
                began = time.perf_counter()
                for rep in range(2 * REPS):
                    if rep == REPS:
                        if not _unclear(times):
                            break
                        began = time.perf_counter()  # the second block's budget
                    elif rep >= MIN_PAIRS and time.perf_counter() - began + times[False][-1] + times[True][-1] > budget:
                        break
                    for low in ((False, True) if rep % 2 else (True, False)):
                        times[low].append(once(low))
        except _NoBackward:
            return {"skipped": "the model's output holds no tensor a backward can start from"}
        fp32, low = statistics.median(times[False]), statistics.median(times[True])
        return {"device": device.type, "dtype": str(reduced).replace("torch.", ""), "model": type(model).__name__,
                "pairs": len(times[False]), "faster_pairs": _faster(times),
                "fp32_seconds": fp32, "reduced_seconds": low, "speedup": fp32 / low if low > 0 else None}


def _faster(times: dict[bool, list[float]]) -> int:
    """The pairs in which the reduced-precision pass was faster."""
    return sum(low < fp32 for fp32, low in zip(times[False], times[True]))


def _unclear(times: dict[bool, list[float]]) -> bool:
    """Faster in more than half the pairs but fewer than CONSISTENT: more pairs may settle it."""
    pairs = len(times[False])
    return 0.5 * pairs < _faster(times) < CONSISTENT * pairs


class _NoBackward(Exception):
    """The output has nothing to differentiate."""
