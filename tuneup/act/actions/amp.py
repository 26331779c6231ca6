"""Mixed precision: autocast around the model's forward, bf16 where the device supports it.

fp16 is used only where bf16 is not supported and the loop already owns a GradScaler that
it calls (`scale`, `step`, `update`): a disabled one (`GradScaler(enabled=flag)`, the
switchable-AMP idiom) is enabled with GradScaler's defaults. As Accelerate does, the
forward's floating-point outputs are cast back to float32, so the loss the loop computes
from them runs in fp32.

Guarded, because reduced precision can overflow. During the guard period every step is a
detail step (the loss is captured) and a step pre-hook checks, before each update, that the
gradients and the loss are finite. If the gradients are not, it hides them from the
optimizer for that one step (it skips every parameter: nothing is updated, no state moves;
they are put back right after, as the loop left them), takes autocast off at once and the
change is rolled back. Reading that check costs one host-device sync per step on CUDA (the
same one GradScaler's step pays), during the guard period only; after it, the loss the agent
reads on detail steps and GradScaler's skips are watched: a non-finite loss or a burst of
skipped steps rolls the change back at the next step close. Model and optimizer state are
never touched: autocast changes no parameter, and a revert restores the GradScaler's state
exactly; but the updates made under autocast until a revert stay in the weights, so autocast
is switched on only where its gain was measured clearly off the job's steps
(measure/precision.py, `shadow_refusal`) and a revert is unlikely.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler

from ..._patching import PatchSet, measured, posing_as
from ...measure.config import amp_facts, cuda_bf16
from ...measure.model import tracing
from ...measure.terms import amp_refusal, shadow_refusal, small_gain_refusal
from ..action import NOT_SLOWER, Action, Change, LiveJob

GUARD_STEPS = 300
SETTLE_STEPS = 5
SKIP_WINDOW = 20  # a burst: this many skipped steps ...
SKIP_BURST = 5  # ... within SKIP_WINDOW steps
CALIBRATION_STEPS = 20  # a GradScaler tuneup enabled searches its scale first: skips expected
LOSS_LOOKBACK = 16
_raw_tolist = torch._C.TensorBase.tolist
# The forward of the trained models' classes under this change; it poses as the model's own
# to TorchScript and fx (see posing_as), and a model being traced (jit.trace, fx, export: a
# checkpoint exported mid-run) is traced as the job wrote it, without autocast. Only training
# forwards run under it: the job's evaluation (eval() mode) and no_grad forwards (its
# validation metrics, a sampler) run as the job wrote them, in its precision.
_AUTOCAST_FORWARD = """
def forward(self, *args, **kwargs):
    if _tuneup_id(self) not in _tuneup_targets or not self.training or not _tuneup_grad_enabled() \
            or _tuneup_tracing():
        return _tuneup_original(self, *args, **kwargs)
    with _tuneup_autocast():
        output = _tuneup_original(self, *args, **kwargs)
    return _tuneup_to_float32(output)
"""


def to_float32(output: Any) -> Any:
    """The forward's outputs with half-precision floating tensors cast to float32."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output
    if isinstance(output, tuple):
        items = [to_float32(item) for item in output]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if isinstance(output, list):
        return [to_float32(item) for item in output]
    if isinstance(output, dict):
        converted = copy.copy(output)  # keeps the mapping's type (OrderedDict, HF ModelOutput)
        for key, value in output.items():
            converted[key] = to_float32(value)
        return converted
    return output


def _nothing_after(token: Any, result: Any, args: tuple, kwargs: dict) -> None:
    return None


def bf16_supported(device: str, index: int | None = None) -> bool:
    """Whether autocast may use bf16 here: on a GPU, where it runs natively (measure/config.py
    cuda_bf16; else fp16 with a GradScaler). On the CPU it always runs (whether it pays is what
    the amp-off rule, which starts this action, and the trial decide)."""
    return device == "cpu" or cuda_bf16(index)


class AmpChange(Change):
    action = "amp"
    settle_steps = SETTLE_STEPS
    # Proposed only on a clear gain measured off the job's steps (measure/precision.py): it stays
    # unless the job's own steps are measurably slower.
    keep = NOT_SLOWER

    def __init__(self, job: LiveJob, models: list[nn.Module], device: str, dtype: torch.dtype,
                 scaler: GradScaler | None) -> None:
        super().__init__()
        self.job = job
        self.device = device
        self.dtype = dtype
        self.guard_steps = GUARD_STEPS
        self.targets = {id(model): weakref.ref(model) for model in models}
        self.classes = list(dict.fromkeys(type(model) for model in models))
        self.scaler = weakref.ref(scaler) if scaler is not None else None
        self.enables_scaler = scaler is not None and not scaler._enabled
        self.scaler_state = dict(vars(scaler)) if self.enables_scaler else None
        name = str(dtype).replace("torch.", "")
        self.description = f"autocast({device}, {name}) around the forward" + (
            "; GradScaler enabled" if self.enables_scaler else "")
        self.before = {"autocast": None, "grad_scaler_enabled": bool(scaler._enabled) if scaler else None}
        self.after = {"autocast": f"{device} {name}", "grad_scaler_enabled": True if scaler else None}
        self.patches = PatchSet()  # the forwards
        self.scaler_patches = PatchSet()  # GradScaler.scale/update while tuneup owns the scaler's state
        self.scaled_in_flight = False  # between the loop's scale() and update(): the scaler must stay as it is
        self.restore_pending = False
        self.guard_until = 0
        self.applied_step = 0
        self.hidden: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.skips: deque[tuple[int, int]] = deque()
        self.reported_losses: set[int] = set()

    # --- apply / revert -----------------------------------------------------------------

    def apply(self) -> None:
        self.applied_step = self.job.timeline.ring.count + 1
        self.guard_until = self.applied_step + self.guard_steps
        device, dtype = self.device, self.dtype

        def wrap(original):
            return posing_as(original, _AUTOCAST_FORWARD, _tuneup_original=original, _tuneup_targets=self.targets,
                             _tuneup_id=id, _tuneup_autocast=lambda: torch.autocast(device, dtype=dtype),
                             _tuneup_to_float32=to_float32, _tuneup_tracing=tracing,
                             _tuneup_grad_enabled=torch.is_grad_enabled)

        for cls in self.classes:
            self.patches.replace(cls, "forward", wrap)
        if self.enables_scaler:
            self.scaler_patches.replace(GradScaler, "scale", self._switching_scale)
            self.scaler_patches.replace(GradScaler, "update", self._tracking_update)
        self.job.add_guard(self._before_update, self._after_update)
        self.job.models.read_config_next_forward = True

    def revert(self) -> None:
        self.patches.undo_all()
        self._restore_scaler()
        self.job.remove_guard(self._before_update, self._after_update)
        self._after_update(None)  # gradients hidden from an update are always given back
        self.job.models.read_config_next_forward = True

    # The loop's own GradScaler is switched on only where a step begins (its scale() call),
    # and back off only between steps (after its update()): switched between scale() and
    # step(), step() would update with gradients still scaled; between step() and update(),
    # update() would fail.

    def _switching_scale(self, original):
        return measured(original, self._before_scale, _nothing_after, self._failed)

    def _before_scale(self, args: tuple, kwargs: dict) -> None:
        scaler = args[0]
        if scaler is self.loop_scaler():
            if self.restore_pending:  # a step that never reached update(): back off before this one
                self._restore_now(scaler)
            elif not scaler._enabled and self.rollback_reason is None:
                vars(scaler).update(vars(GradScaler(scaler._device)))  # enabled, with GradScaler's defaults
            self.scaled_in_flight = scaler._enabled
        return None

    def _tracking_update(self, original):
        return measured(original, self._before_update_call, self._after_update_call, self._failed)

    def _before_update_call(self, args: tuple, kwargs: dict) -> bool | None:
        return True if args[0] is self.loop_scaler() else None

    def _after_update_call(self, token: bool, result: Any, args: tuple, kwargs: dict) -> None:
        self.scaled_in_flight = False
        if self.restore_pending:
            self._restore_now(args[0])

    def _failed(self, exc: BaseException) -> None:
        """Switching the loop's GradScaler failed: never into the job; the change is rolled back."""
        self.rollback_reason = f"switching the GradScaler failed: {type(exc).__name__}: {exc}"

    def loop_scaler(self) -> GradScaler | None:
        """The loop's GradScaler this change uses, while it lives."""
        return self.scaler() if self.scaler is not None else None

    def _restore_scaler(self) -> None:
        """Put the loop's GradScaler back as it was: now, or right after this step's update()
        while a scaled backward is in flight."""
        scaler = self.loop_scaler()
        if self.scaler_state is None or scaler is None:
            self.scaler_patches.undo_all()
        elif self.scaled_in_flight:
            self.restore_pending = True
        else:
            self._restore_now(scaler)

    def _restore_now(self, scaler: GradScaler) -> None:
        vars(scaler).clear()
        vars(scaler).update(self.scaler_state or {})
        self.restore_pending = self.scaled_in_flight = False
        self.scaler_patches.undo_all()

    # --- guards -------------------------------------------------------------------------

    def _before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Before each update in the guard period (and, once rolled back, every update until
        the revert, e.g. a second optimizer's in the same step): are the gradients finite?"""
        timeline = self.job.timeline
        if not self.rollback_reason and timeline.ring.count >= self.guard_until:
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not parameters:
            return
        grads_finite, loss_finite = self._finite([p.grad for p in parameters], timeline.loss)
        if not grads_finite:
            # Hidden for this update only: the optimizer skips parameters without a gradient.
            self.hidden[id(optimizer)] = [(p, p.grad) for p in parameters]
            self.job.skipping.add(id(optimizer))
            for parameter in parameters:
                parameter.grad = None
        if (grads_finite and loss_finite) or self.rollback_reason:
            return
        self.patches.undo_all()  # the next forward runs in full precision, whatever happens next
        self._restore_scaler()
        what = "gradients" if not grads_finite else "loss"
        self.rollback_reason = (f"non-finite {what} at step {timeline.ring.count + 1}" +
                                ("; that update was skipped" if not grads_finite else ""))

    def _after_update(self, optimizer: torch.optim.Optimizer | None) -> None:
        keys = [id(optimizer)] if optimizer is not None else list(self.hidden)
        for key in keys:
            for parameter, grad in self.hidden.pop(key, ()):
                parameter.grad = grad
            self.job.skipping.discard(key)

    @staticmethod
    def _finite(grads: list[torch.Tensor], loss: torch.Tensor | None) -> tuple[bool, bool]:
        """(gradients finite, loss finite), with one device read."""
        with torch.no_grad():
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for grad in grads:
                by_device.setdefault(grad.device, []).append(grad)
            first = next(iter(by_device))
            sums = [torch.stack(torch._foreach_norm(tensors)).float().sum().to(first)
                    for tensors in by_device.values()]
            grad_total = torch.stack(sums).sum()
            if loss is not None and loss.numel() == 1:
                loss_value = loss.detach().reshape(()).float().to(first)
            else:
                loss_value = torch.zeros((), device=first)
            finite = _raw_tolist(torch.isfinite(torch.stack([grad_total, loss_value])))
        return bool(finite[0]), bool(finite[1])

    def check(self, step: int) -> str | None:
        if self.rollback_reason:
            return self.rollback_reason
        return self._nonfinite_loss(step) or self._skip_burst(step)

    def _nonfinite_loss(self, step: int) -> str | None:
        """A non-finite loss read by the agent (inline on CPU, asynchronously on CUDA)."""
        ring = self.job.timeline.ring
        for earlier in range(max(self.applied_step + 1, step - LOSS_LOOKBACK), step + 1):
            # (a step whose loss was not read gives 0.0: finite)
            if not math.isfinite(ring.side("loss", earlier, 0.0)) and earlier not in self.reported_losses:
                self.reported_losses.add(earlier)
                return f"non-finite loss at step {earlier}"
        return None

    def _skip_burst(self, step: int) -> str | None:
        if self.scaler is None:
            return None
        if self.enables_scaler and step < self.applied_step + CALIBRATION_STEPS:
            return None
        skips = self.skips
        skips.append((step, self.job.scalers.skipped))
        while skips and skips[0][0] < step - SKIP_WINDOW:
            skips.popleft()
        burst = skips[-1][1] - skips[0][1]
        if burst >= SKIP_BURST:
            return f"a burst of {burst} skipped steps in {step - skips[0][0]} steps"
        return None


class Amp(Action):
    id = "amp"
    title = "Mixed precision (autocast)"
    fixes = ("amp-off",)
    summary = ("autocast around the model's forward (bf16; fp16 only by switching on a GradScaler the loop "
               "owns), outputs cast to fp32; kept only when faster; rolled back at once on non-finite "
               "gradients (that update skipped) or loss, or a burst of GradScaler skips.")

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        finding = job.finding(*self.fixes)
        if finding is None:
            return None
        models = job.models.root_models()
        if not models:
            return None
        refusal = amp_refusal({  # the test amp-off's "apply mode can make it" asks as well
            "models": [amp_facts(model) for model in models],
            "optimizers": [{"class": type(optimizer).__name__} for optimizer in job.optimizers.optimizers],
            "distributed": {"initialized": job.distributed}})
        if refusal:
            return self.refuse(refusal)
        parameters = [p for model in models for p in model.parameters()]
        if any(p.dtype != torch.float32 for p in parameters if p.is_floating_point()):
            self.done = True  # already in reduced precision
            return None
        devices = {p.device.type for p in parameters}
        if len(devices) != 1 or devices - {"cpu", "cuda"}:
            return self.refuse(f"parameters on {', '.join(sorted(devices))}: autocast needs one CPU or CUDA device")
        device, index = devices.pop(), parameters[0].device.index
        scalers = [s for s in job.scalers.scalers if getattr(s, "_device", None) == device]
        if bf16_supported(device, index):
            enabled = [s for s in scalers if s._enabled]
            change = AmpChange(job, models, device, torch.bfloat16, enabled[0] if enabled else None)
        else:
            change = self._fp16(job, models, device, scalers)
        if change is not None:
            # Switched on only where the gain was measured off the job's steps (measure/
            # precision.py: the model's forward + backward on a copy of its batch, fp32 and
            # autocast interleaved, the job untouched), and clearly: then it stays unless the
            # job's own steps turn out measurably slower (a gain of 1.17x at p=0.15 is kept, not
            # thrown away). A revert cannot take back the bf16 updates made meanwhile, so a
            # change this likely to be undone is not made (the README says so).
            evidence = finding.get("evidence") or {}
            if evidence.get("timing") == "pending":
                return None  # its gain not measured yet: look again once it is
            refusal = (shadow_refusal(evidence.get("trial"))
                       or small_gain_refusal(finding.get("gain"), evidence.get("trial")))
            if refusal:
                return self.refuse(refusal)
        return change

    def _fp16(self, job: LiveJob, models: list[nn.Module], device: str, scalers: list[GradScaler]) -> Change | None:
        if not scalers:
            return self.refuse("this GPU has no bf16, and fp16 needs a GradScaler the loop owns "
                               "(GradScaler(enabled=False) is enough for tuneup to switch it on)")
        calls = job.scalers.calls
        if not (calls["step"] and calls["update"]):
            return self.refuse("the loop calls scaler.scale() but not scaler.step() and scaler.update(): "
                               "enabling its GradScaler would leave the gradients scaled")
        return AmpChange(job, models, device, torch.float16, scalers[0])
