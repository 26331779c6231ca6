"""Compile the model in place (`model.compile()`), as a measured experiment. Opt-in only:
apply mode tries it where the user names it (`--actions compile`, TUNEUP_ACTIONS=...,compile),
never by default: compiling takes seconds to minutes of the job's time and changes float
results in their last bits (fused kernels round differently).

torch's `Module.compile()` sets `_compiled_call_impl` on the instance, which
`Module._wrapped_call_impl` calls instead of `_call_impl` (torch/nn/modules/module.py): the
model object, its parameters, its optimizer and the job's references to it stay the same, and
putting the attribute back undoes it. The steps that compile are settle steps (their compile
time is also taken out of step times: measure/compiled.py), so the trial judges compiled
steps against eager ones. Rolled back when compiling fails (dynamo's or the backend's error:
that call runs eagerly instead, so the job never sees it), when the compiled model keeps
recompiling, or when the loss leaves its band; kept only when measurably faster.

Refused, with the reason: a model already compiled, a distributed wrapper or job (each rank
would decide alone), a TorchScript module, a model with module hooks the job registered
(dynamo traces them into the graph, and one added later would recompile or be missed), or one
whose `forward` is set on the instance (a wrapper's, e.g. Accelerate's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..._patching import PatchSet
from ...measure.model import is_compiled
from ..action import Action, Change, LiveJob

SETTLE_STEPS = 5  # the first calls compile forward and backward; a short last batch may recompile
MAX_COMPILES = 8  # during the trial: more is a recompile storm (torch's recompile_limit is 8)
_MISSING = object()
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - a torch without dynamo
        return ()
    return (TorchDynamoException,)


class CompileChange(Change):
    action = "compile"
    settle_steps = SETTLE_STEPS
    backend: Any = "inductor"  # torch.compile's default

    def __init__(self, job: LiveJob, model: nn.Module) -> None:
        super().__init__()
        self.job = job
        self.model = model
        self.description = f"{type(model).__name__}: eager -> model.compile()"
        self.before = {"compiled": False}
        self.after = {"compiled": True}
        self.patches = PatchSet()
        self._own: Any = _MISSING
        self._compiles_at_apply = 0

    def apply(self) -> None:
        model = self.model
        self._own = vars(model).get("_compiled_call_impl", _MISSING)
        self._compiles_at_apply = self._compiles()
        model.compile(backend=self.backend)
        eager = model._call_impl
        errors = _dynamo_errors()
        change = self

        def compiled_or_eager(compiled):
            def call(*args: Any, **kwargs: Any) -> Any:
                if change.rollback_reason is None:
                    try:
                        return compiled(*args, **kwargs)
                    except errors as exc:  # compiling failed: this call, and the rest, run eagerly
                        # BackendCompilerFailed keeps the backend's own error (torch/_dynamo/exc.py).
                        cause = getattr(exc, "inner_exception", None) or exc
                        first = (str(cause).strip().splitlines() or [""])[0][:200]
                        change.rollback_reason = f"torch.compile failed: {type(cause).__name__}: {first}"
                return eager(*args, **kwargs)

            return call

        self.patches.replace(model, "_compiled_call_impl", compiled_or_eager)
        # Timed as a model compiled in place is (measure/model.py: on the instance, detail steps).
        self.patches.replace(model, "_compiled_call_impl",
                             lambda call: self.job.models.timed_compiled(model, call, model))

    def _compiles(self) -> int:
        probe = self.job.compiles
        return probe.compiles if probe is not None else 0

    def check(self, step: int) -> str | None:
        if self.rollback_reason:
            return self.rollback_reason
        compiles = self._compiles() - self._compiles_at_apply
        if compiles > MAX_COMPILES:
            return f"compiled {compiles} times during its trial: something the graph depends on keeps changing"
        return None

    def revert(self) -> None:
        self.patches.undo_all()
        model = self.model
        if self._own is _MISSING:
            vars(model).pop("_compiled_call_impl", None)
        else:
            model._compiled_call_impl = self._own


class Compile(Action):
    id = "compile"
    title = "Compile the model"
    fixes = ("compile-off",)
    opt_in = True  # tried only where the user names it
    needs_finding = False  # named by the user: tried whether or not compile-off fires (it is CUDA-only)
    summary = ("model.compile() in place, only when named (--actions ...,compile); compile steps left out of "
               "the trial; kept when faster; rolled back when compiling fails (that call runs eagerly), on a "
               "recompile storm or a loss out of band.")

    def propose(self, job: LiveJob, recent: dict[str, Any] | None) -> Change | None:
        if recent is None:
            return None
        trained = [model for model in job.models.root_models() if id(model) in job.models.trained]
        if not trained:
            return None
        if len(trained) > 1:
            return self.refuse(f"{len(trained)} models train together; tuneup compiles only a job's one model")
        model = trained[0]
        reason = why_not(model, job)
        if reason:
            return self.refuse(reason)
        return CompileChange(job, model)


def why_not(model: nn.Module, job: LiveJob) -> str | None:
    """Why compiling `model` in place is not safe to try here, or None."""
    name = type(model).__name__
    if job.distributed:
        return "a distributed job: each rank would keep or roll back the compiled model on its own"
    if is_compiled(model):
        return f"{name} is compiled already"
    if isinstance(model, torch.jit.ScriptModule):
        return f"{name} is a TorchScript module"
    wrapper = type(model).__module__.split(".")[:3]
    if wrapper in (["torch", "nn", "parallel"], ["torch", "distributed", "fsdp"]):
        return f"{name} is a distributed wrapper; compile the module it wraps in the script"
    if "forward" in vars(model):
        return f"{name} has a forward set on the instance (a wrapper's); compile it in the script"
    # tuneup puts no hook on a model whose forward is its class's: any found are the job's.
    hooked = [sub for sub in model.modules() if any(getattr(sub, hooks, None) for hooks in _HOOKS)]
    # nn.Module's global hooks (register_module_forward_hook...): the check OptimizedModule makes
    # itself (torch/_dynamo/eval_frame.py), absent from older torch.
    global_hooks = getattr(nn.modules.module, "_has_any_global_hook", lambda: False)()
    if hooked or global_hooks:
        return f"{name} has module hooks the job registered (dynamo would trace them into the graph)"
    return None
