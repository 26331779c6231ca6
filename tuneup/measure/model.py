"""Model probe: forward and backward time, the loss, and which models are being trained.

Auto mode finds the models by watching one step through `nn.Module.__call__`, replaced for
that step by a wrapper posing as torch's own (`_patching.measured`): a module called while no
other module is running is a root. Not global module hooks: any hook sends every module call
down `_call_impl`'s slow path, through a nested `inner()` (torch/nn/modules/module.py), so an
exception in the first step's forward (a shape error, most often) would show torch frames it
does not show without tuneup; the wrapper takes its own frame off the traceback. After that
step the roots are timed through their class's `forward`, patched to check `id(module)` against the roots: a module hook
would push every call of the root onto nn.Module's slow path (about 12 µs on a small CPU
host), and an instance attribute would be copied by `copy.deepcopy(model)` (EMA models)
and break `torch.save(model)`. The patched forward poses as the model's own to TorchScript,
fx and dynamo (`_patching.measured`: `torch.jit.script(model)`, `fx.symbolic_trace(model)`
and `torch.compile(model)` see exactly what they would without tuneup). A root that already
has an instance-level `forward` (as Accelerate installs) gets hooks instead, made inert when
copied or pickled. The leaf modules' call order seen during discovery is kept for the
configuration probe (Conv→BatchNorm checks need the order modules actually run in, not
their declared order).

Backward is timed through `Tensor.backward` (what `loss.backward()` calls), not
`torch.autograd.backward`: TorchScript resolves the latter by identity (an `aten::backward`
builtin in torch/jit/_builtins.py), so replacing it breaks any scripted function that calls it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.fx import _symbolic_trace as _fx_tracing

from .._patching import HELD_TRAINING_OFF_DETAIL, TRAINING_OFF_DETAIL, PatchSet, measured
from .hotpath import StepTimeline, backward_hooks, first_input, forward_hooks

_UNTIMED = "untimed"  # discovery's token for a module compiled in place

# Autocast is thread-local, so it can only be read on the training thread, inside forward.
_AUTOCAST_DEVICES = ("cpu", "cuda")


# torch < 2.4 has no device argument: is_autocast_enabled() is CUDA's, the CPU's and both
# dtypes have functions of their own (deprecated from 2.4 on, with a warning: used only there).
_LEGACY_AUTOCAST = {
    "cpu": ("is_autocast_cpu_enabled", "get_autocast_cpu_dtype"),
    "cuda": ("is_autocast_enabled", "get_autocast_gpu_dtype"),
}


def read_autocast() -> dict[str, str | None]:
    """{device: dtype name or None} for the autocast state of the calling thread."""
    state: dict[str, str | None] = {}
    for device in _AUTOCAST_DEVICES:
        try:
            try:
                enabled = torch.is_autocast_enabled(device)
                dtype = torch.get_autocast_dtype(device) if enabled else None
            except (TypeError, AttributeError):  # torch 2.3: no device argument
                is_enabled, get_dtype = (getattr(torch, name) for name in _LEGACY_AUTOCAST[device])
                enabled = is_enabled()
                dtype = get_dtype() if enabled else None
        except (TypeError, RuntimeError, AttributeError):
            continue
        state[device] = str(dtype).replace("torch.", "") if dtype is not None else None
    return state


def forward_autocast(module: nn.Module) -> dict[str, str]:
    """{device: dtype name} of the autocast a module's own forward enters, where its forward is
    set on the instance and decorated by torch.autocast: Accelerate's prepare_model with mixed
    precision (the HF Trainer's fp16/bf16 too) sets `model.forward` to the forward under
    `autocast(...)` used as a decorator, behind convert_outputs_to_fp32. The decorator keeps its
    autocast in the closure of the function it returns (torch/amp/autocast_mode.py
    autocast_decorator: `decorate_autocast`), reached through the wrappers' `__wrapped__`. A
    forward pre-hook runs before that forward, so the thread's state read there shows none."""
    forward = module.__dict__.get("forward")
    function = getattr(forward, "__func__", forward)
    found: dict[str, str] = {}
    for _ in range(8):  # a few wrappers deep at most
        if function is None:
            break
        for cell in getattr(function, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.amp.autocast) and getattr(value, "_enabled", False):
                found.setdefault(value.device, str(value.fast_dtype).replace("torch.", ""))
        function = getattr(function, "__wrapped__", None)
    return found


def graph_parameter(tensor: torch.Tensor, limit: int = 4096) -> torch.Tensor | None:
    """A parameter the autograd graph of `tensor` reaches (an AccumulateGrad node's
    `variable`; a leaf that is no nn.Parameter where none is), looking at `limit` nodes at
    most. The graph's nodes stay after a backward that freed its buffers."""
    stack, seen, leaf = [tensor.grad_fn], set(), None
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, nn.Parameter):
            return variable
        if leaf is None and isinstance(variable, torch.Tensor):
            leaf = variable
        stack.extend(following for following, _ in node.next_functions)
    return leaf


def tracing() -> bool:
    """Whether torch.jit.trace, fx.symbolic_trace or torch.export is running the model rather
    than the job. fx's flag is read as is: its getter, is_fx_tracing(), logs a warning."""
    return bool(torch._C._get_tracing_state()) or getattr(_fx_tracing, "_is_fx_tracing_flag", False)


class ModelProbe:
    name = "model"
    clock = staticmethod(perf_counter)
    tracing = staticmethod(tracing)

    def __init__(self, timeline: StepTimeline, explicit: list[nn.Module] | None) -> None:
        self.on = True
        self.timeline = timeline
        self.explicit = explicit is not None  # models were named: no discovery
        self._named = explicit or []  # hooked at install, then let go (the job owns them)
        # Roots by id, held weakly: a model class may define __eq__ (and so be unhashable),
        # and the job owns its models.
        self.roots: dict[int, weakref.ref] = {}
        self.gradients: Any = None  # gradients.GradientNorms: a hand-written update's, after the backward
        # Ids of the roots being trained: named ones (explicit mode), and those discovery saw in
        # a training forward (train() mode, autograd on). Another root (a teacher, an EMA copy,
        # a target network) is part of the step, never an evaluation.
        self.trained: set[int] = set()
        self.timed = False  # a root was ever timed (it may be gone since: the job dropped it)
        self._patched_classes: set[type] = set()
        self.leaf_order: list[weakref.ref] = []  # leaf modules in call order, first discovery step
        self.autocast: dict[str, str | None] | None = None
        self.read_config_next_forward = True
        self.captures: list[Any] = []  # offstep.ModelCapture: waiting for a detail step's training forward
        self._patches: PatchSet | None = None
        self.discovering: PatchSet | None = None  # nn.Module.__call__, replaced for discovery
        self._ours: Any = None  # the __call__ discovery stood in with, once lifted
        self._candidates: dict[int, nn.Module] = {}  # by id: identity, never the model's __eq__
        self._root_called = False  # a module with parameters was called outermost while discovering
        self._depth = 0
        self._discovery_evaluation = False  # the outermost forward discovery sees is an evaluation
        self.eval_with_grad = 0  # forwards of a model in eval() mode with autograd recording
        self.graphs = ForwardGraphs()  # training forwards whose graph no backward uses
        self.grad_enabled = torch.is_grad_enabled
        self.backward_depth = 0  # a tensor subclass's __torch_function__ calls Tensor.backward again
        # Apply mode's start-time changes (act/experimenter.py at_start), called with a model
        # discovery finds in a training forward, before its first module runs; handles its own errors.
        self.before_training: Any = None
        # Loops that update parameters by hand: one parameter's gradient as the latest backward
        # left it (weakly: the job frees it at will), to tell an update from accumulation.
        self._watched: weakref.ref | None = None
        self._gradient: tuple[weakref.ref, int] | None = None
        self._version = 0  # ... and that parameter's version counter then (parameters_moved)
        self._repick = False  # the next backward picks the parameter afresh (forget_watched)
        timeline.parameters_moved = self.parameters_moved

    # --- install --------------------------------------------------------------------

    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        patches.replace(torch.Tensor, "backward", self._wrap_backward)
        if self.explicit:
            for model in self._named:
                self._hook_root(model)
        else:
            self.discover()
        self._named = []

    def discover(self) -> None:
        """Watch the next step through nn.Module.__call__ to find root modules (auto mode)."""
        if self.explicit or self.discovering is not None or not self.on:
            return
        self._depth = 0
        self._candidates = {}
        self._root_called = False
        self.discovering = PatchSet()
        self.discovering.replace(nn.Module, "__call__", self._discovery_call)
        self.timeline.add_listener("model-discovery", self.end_discovery)

    def _discovery_call(self, original):
        return measured(original, self._discovery_pre, self._discovery_post, self.fail)

    def end_discovery(self, step: int = 0) -> None:
        """End discovery once a forward was seen (or the probe is off): a new root's, at the
        first backward after it or a step close; only known roots', at a step close (`step`):
        the step called no new model (a GAN's second optimizer, first seen at the close of
        step 1, looks for its generator through the discriminator's first backward of step 2)."""
        if not self.on:
            self._stop_discovery()
            return
        if not self._candidates and not (step and self._root_called):
            return  # no new root yet: keep watching
        self._stop_discovery()
        for model in self._candidates.values():
            self._hook_root(model)
        self._candidates = {}

    def _stop_discovery(self) -> None:
        self._lift_discovery()
        self.timeline.remove_listener("model-discovery")

    def _lift_discovery(self) -> None:
        """torch's own nn.Module.__call__ back (the roots seen so far stay candidates, hooked
        at the step's close). Also at once when a compiled model is about to run: dynamo
        traces the module calls inside it through `type(module).__call__` and guards on that
        function (its closure: `dict(type(fn).__mro__[1].__dict__)['__call__'].__closure__`),
        so a graph traced through ours would recompile once discovery put torch's back."""
        if self.discovering is not None:
            ours = vars(nn.Module)["__call__"]
            self.discovering.undo_all()
            _restore_dynamo_capture(ours, vars(nn.Module)["__call__"])
            self.discovering = None
            self._ours = ours  # for a compiled wrapper built while it stood (_rebind)

    def root_models(self) -> list[nn.Module]:
        """The root models still alive."""
        return [model for model in (ref() for ref in list(self.roots.values())) if model is not None]

    def cuda_device(self) -> torch.device | None:
        """The CUDA device the models train on (their first parameter's), if any."""
        for model in self.root_models():
            parameter = next(model.parameters(), None)
            if parameter is not None and parameter.is_cuda:
                return parameter.device
        return None

    def _hook_root(self, model: nn.Module) -> None:
        key = id(model)
        if key in self.roots or self._patches is None:
            return
        if isinstance(model, torch.jit.ScriptModule):
            # TorchScript runs its forward; no Python wrapper reaches it, and its class refuses
            # module hooks (torch/jit/_script.py: RecursiveScriptModule's register_forward_pre_hook
            # and the like raise "... is not supported on ScriptModules"). Not a root: the step's
            # eager roots are timed as ever, the scripted part's time falls in the step's other time.
            return
        self.roots[key] = weakref.ref(model)
        if self.explicit:
            self.trained.add(key)
        self.timed = True
        weakref.finalize(model, self._forget_root, key)  # an id is reused once its object dies
        if vars(model).get("_compiled_call_impl") is not None:
            # Compiled in place (model.compile()): its class's forward runs inside the compiled
            # code, where a patch would be guarded on (a recompile) and never run; the compiled
            # call is wrapped instead, on the instance, where torch calls it eagerly
            # (Module._wrapped_call_impl). Neither copies nor pickles take it along: torch's
            # Module.__getstate__ drops `_compiled_call_impl`.
            self._patches.replace(model, "_compiled_call_impl",
                                  lambda compiled: self.timed_compiled(model, compiled, model))
            return
        inner = _optimized_inner(model)
        if inner is not None:
            # torch.compile(model): the OptimizedModule's own `forward`, set on the instance
            # (OptimizedModule._initialize), wrapped there the same way. Instance hooks instead
            # put every step of it on nn.Module's slow call path (_call_impl with hooks) and read
            # its `training` property: +150 µs a step on a 0.4 ms compiled step
            # (benchmarks/bench_compile.py). Copies and pickles rebuild the wrapper from the
            # module it wraps (OptimizedModule.__reduce__), without this.
            self._patches.replace(model, "forward", lambda compiled: self.timed_compiled(model, compiled, inner))
            return
        if "forward" in vars(model):
            self._patches.add_handle(model.register_forward_pre_hook(_RootHook(self._root_pre), with_kwargs=True))
            self._patches.add_handle(model.register_forward_hook(_RootHook(self._root_post), always_call=True))
            return
        cls = type(model)
        if cls not in self._patched_classes:
            self._patched_classes.add(cls)
            self._patches.replace(cls, "forward", self._wrap_forward)

    def _forget_root(self, key: int) -> None:
        self.roots.pop(key, None)
        self.trained.discard(key)

    def timed_compiled(self, model: nn.Module, compiled: Any, trains: nn.Module) -> Any:
        """A model's compiled call, timed as a root's forward (forward_hooks, given the model
        as their first argument), on detail steps and for a model in eval() mode as
        _wrap_forward does; `trains` is the module whose `training` says which (the model, or
        the one torch.compile wrapped). Both held weakly: the wrapper lives on the model itself."""
        before, after = forward_hooks(self)  # hotpath.py
        held = weakref.ref(model)

        def with_model(call_args: tuple, kwargs: dict) -> tuple:
            return (held(), *call_args)

        return measured(compiled, lambda call_args, kwargs: before(with_model(call_args, kwargs), kwargs),
                        lambda token, result, call_args, kwargs: after(token, result, with_model(call_args, kwargs),
                                                                       kwargs),
                        self.fail, gate=self.timeline, skip=HELD_TRAINING_OFF_DETAIL, held=weakref.ref(trains))

    def _wrap_forward(self, original):
        before, after = forward_hooks(self)  # hotpath.py
        # Off detail steps only a module in eval() mode is looked at (evaluation with grad).
        return measured(original, before, after, self.fail, gate=self.timeline, skip=TRAINING_OFF_DETAIL)

    def uninstall_discovery(self) -> None:
        if self.discovering is not None:
            self._stop_discovery()

    # --- hooks ----------------------------------------------------------------------

    def _discovery_pre(self, args: tuple, kwargs: dict) -> Any:
        """Before a module's call (args[0] the module; never while dynamo traces: measured
        skips to torch's own call). A token (True, or _UNTIMED for a module compiled in
        place) where `_discovery_post` has a depth to take back; None where it has none."""
        module = args[0] if args else None
        if not self.on or not isinstance(module, nn.Module):
            return None
        compiled = is_compiled(module)
        if compiled:
            self._lift_discovery()  # before dynamo traces the module calls inside it
            _rebind(module, self._ours)
            if self._depth:
                # Compiled in place inside a root: dynamo's code, not timed, and what it calls
                # eagerly (modules of torch's own, which dynamo skips) is no root either.
                self._depth += 1
                return _UNTIMED
        if self._depth == 0:
            if next(module.parameters(), None) is None:
                # A loss module or other parameter-free callable, not a model: the model
                # may run compiled, where this wrapper never sees it.
                return None
            self._root_called = True
            timeline = self.timeline
            # Before training starts, a forward in eval() mode is an evaluation (a loop
            # that evaluates at iteration 0), not the step's forward.
            # (Once a training forward was seen, another model in eval() mode, a teacher say,
            # is part of the step.)
            self._discovery_evaluation = not module.training and (not self.trained or id(module) in self.trained)
            if self._discovery_evaluation:
                timeline.evaluation_forward(perf_counter())
            else:
                if torch.is_grad_enabled():  # a training forward
                    if timeline.evaluating:
                        timeline.evaluation_ends(perf_counter())
                    self.trained.add(id(module))
                timeline.forward_begin(perf_counter())
            if id(module) not in self._candidates and id(module) not in self.roots:
                self._candidates[id(module)] = module
                self.read_config(module)
                if self.before_training is not None and not self._discovery_evaluation:
                    self.before_training(module)  # before the model's first module runs
        self._depth += 1
        if len(self.leaf_order) < 10_000 and next(module.children(), None) is None:
            if not self.roots:
                self.leaf_order.append(weakref.ref(module))
        return True

    def _discovery_post(self, token: Any, output: Any, args: tuple, kwargs: dict) -> None:
        """After a module's call, returned or raised (measured: output None then)."""
        if self.on and self._depth > 0:
            self._depth -= 1
            if self._depth == 0 and token is not _UNTIMED:
                if self._discovery_evaluation:
                    self.timeline.evaluation_forward_ended(perf_counter())
                else:
                    self.timeline.forward_end(perf_counter())

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A root with its own instance-level forward (Accelerate): what forward_hooks does."""
        if not self.on:
            return
        try:
            timeline, grad = self.timeline, torch.is_grad_enabled()
            if timeline.backward_end is not None and timeline.forward_depth == 0:
                self.hand_boundary(module)  # parameters updated by hand
            if module.training:
                if grad:  # a training forward
                    if timeline.evaluating:
                        timeline.evaluation_ends(perf_counter())
                    self.trained.add(id(module))
            else:
                if grad:
                    self.eval_with_grad += 1
                if id(module) in self.trained and timeline.forward_depth == 0 and not timeline.in_optimizer:
                    timeline.evaluation_forward(perf_counter())
                    return
            if timeline.forward_depth == 0:
                if self.captures and module.training and timeline.detail:
                    self.give_input(module, args, kwargs)
                if self.read_config_next_forward:
                    self.read_config(module)
            timeline.forward_begin(perf_counter())
        except Exception as exc:
            self.fail(exc)

    def give_input(self, root: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a detail step's outermost training forward of a root (its inputs, without the
        module): the one-shot captures waiting for one (offstep.ModelCapture) take them. Their
        time (the precision trial clones the batch) is tuneup's own, out of the step's."""
        began = perf_counter()
        for capture in list(self.captures):
            capture.take(root, args, kwargs)
        self.timeline.own_time(perf_counter() - began)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.on:
            return
        try:
            timeline = self.timeline
            if timeline.evaluating and id(module) in self.trained and not module.training:
                timeline.evaluation_forward_ended(perf_counter())
            else:
                timeline.forward_end(perf_counter())
                if timeline.detail and timeline.forward_depth == 0 and module.training and torch.is_grad_enabled():
                    self.graphs.watch(module, output, timeline.ring.count + 1)
        except Exception as exc:
            self.fail(exc)

    def count_input(self, args: tuple, kwargs: dict) -> None:
        """A training forward on a detail step of a loop that fetches no batch from a
        DataLoader: its batch dimension (dim 0 of the root's first tensor argument) is that
        step's samples, added up over its forwards (gradient accumulation)."""
        value = first_input(args, kwargs)
        if value is not None and value.dim():
            ring = self.timeline.ring
            ring.put("input_samples", ring.count + 1, float(value.shape[0]), add=True)

    # --- the step boundary of loops that update parameters by hand (no optimizer) ----------

    def mark_gradients(self, loss: Any = None) -> None:
        """After a backward (of `loss`): remember a trained parameter's gradient (the object and
        its version counter, which every in-place change bumps: zero_(), clipping's mul_,
        accumulation) and the parameter's own version. Where no root model is known (its
        forwards all ran inside compiled code), the parameter is one the backward reached.
        The parameter watched so far is picked again where this backward left its gradient as
        it was (another model's: one trained before, still alive)."""
        parameter = self._watched() if self._watched is not None else None
        gradient = parameter.grad if parameter is not None else None
        if gradient is None or self._repick or (self._gradient is not None and self._gradient[0]() is gradient
                                                and gradient._version == self._gradient[1]):
            self._repick = False
            parameter = graph_parameter(loss) if isinstance(loss, torch.Tensor) else None
            if parameter is None or parameter.grad is None:
                parameter = next((p for model in self.root_models() for p in model.parameters() if p.grad is not None), None)
            self._watched = weakref.ref(parameter) if parameter is not None else None
            gradient = parameter.grad if parameter is not None else None
        self._gradient = (weakref.ref(gradient), gradient._version) if gradient is not None else None
        self._version = parameter._version if parameter is not None else 0

    def forget_watched(self) -> None:
        """The next backward picks the parameter to watch afresh (a compilation began); the one
        watched now still tells whether the parameters changed since the latest backward."""
        self._repick = True

    def parameters_moved(self) -> bool:
        """Whether the watched parameter changed in place since the latest backward: an
        optimizer's update bumps its version counter, inside a compiled graph too: AOTAutograd
        either writes a mutated input back with copy_ after the graph or, where the graph
        mutates it in place, bumps the counter itself (torch/_functorch/_aot_autograd/
        runtime_wrappers.py: the epilogue's `original_inpt.copy_(updated_inpt)`,
        increment_mutation_versions); at least once per compiled AdamW or SGD step on torch 2.13. So
        does `p -= lr * p.grad` under no_grad; a `p.data` update does not (see hand_boundary)."""
        parameter = self._watched() if self._watched is not None else None
        return parameter is not None and parameter._version != self._version

    def hand_boundary(self, module: nn.Module) -> None:
        """A root's forward after a backward, in a loop where no optimizer stepped: the step
        closes here unless this is a training forward and the gradients are as the backward
        left them (gradient accumulation: the update comes later). Cleared (zero_grad, `p.grad
        = None`), zeroed in place or clipped, they were used: an update happened. An evaluation
        forward (eval() or no grad) after a backward ends the training step as well.

        Not seen: a loop that zeroes gradients through `.data` (`p.grad.data.zero_()`), which
        bypasses the version counter (torch's `Tensor.data` is a fresh alias with a counter of
        its own: VariableHooks::variable_data, torch/csrc/autograd/variable.cpp); such a loop
        can mark its steps with tuneup.step().

        Not while updates are only watched (StepTimeline.watching: an optimizer stepped
        before): there the parameters' versions alone end a step, as a framework's gradient
        accumulation may hand out new gradient tensors at every backward (sharded ones)."""
        if self.tracing() or self.timeline.watching:
            return
        if module.training and self.grad_enabled() and self._gradient is not None:
            parameter = self._watched() if self._watched is not None else None
            gradient = parameter.grad if parameter is not None else None
            held, version = self._gradient
            if gradient is not None and held() is gradient and gradient._version == version:
                return  # accumulating
        self.timeline.hand_update(self.clock())

    def read_config(self, module: nn.Module | None = None) -> None:
        """The thread-local config (autocast) as the forward of `module` (a root, when known) sees it."""
        self.read_config_next_forward = False
        autocast = read_autocast()
        if module is not None and "forward" in module.__dict__:
            for device, dtype in forward_autocast(module).items():
                if autocast.get(device) is None:
                    autocast[device] = dtype
        self.autocast = autocast

    def _wrap_backward(self, original):
        before, after = backward_hooks(self)  # hotpath.py
        # Gated on detail steps: dynamo never traces Tensor.backward (a graph break; this
        # wrapper's frame is one of torch/_tensor.py's, which it skips).
        return measured(original, before, after, self.fail, gate=self.timeline)

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.forward_depth = 0
        self.timeline.fail(self.name, exc)


def is_compiled(module: nn.Module) -> bool:
    """torch.compile(module)'s wrapper, or a module compiled in place (module.compile())."""
    return getattr(module, "_compiled_call_impl", None) is not None or _optimized(module)


def _optimized(module: nn.Module) -> bool:
    """torch.compile(module)'s wrapper (OptimizedModule)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    return eval_frame is not None and isinstance(module, getattr(eval_frame, "OptimizedModule", ()))


def _optimized_inner(module: nn.Module) -> nn.Module | None:
    """The module torch.compile(module)'s wrapper (OptimizedModule) wraps, if it is one whose
    `forward` is set on the instance, as torch sets it."""
    if not _optimized(module):
        return None
    inner = vars(module).get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, nn.Module) and "forward" in vars(module) else None


def _rebind(module: nn.Module, ours: Any) -> None:
    """A torch.compile(module) wrapper built while discovery stood in for nn.Module.__call__
    holds ours for good: OptimizedModule binds `self._orig_mod.__call__` once, when it is built
    (`_initialize`, torch/_dynamo/eval_frame.py), for models of the job's own classes. Built
    again, as torch built it, now that torch's own is back: dynamo then traces what it traces
    without tuneup, and nothing of discovery's is left behind."""
    bound = getattr(getattr(module, "forward", None), "__wrapped__", None)
    if ours is not None and getattr(bound, "__func__", None) is ours:
        initialize = getattr(module, "_initialize", None)
        if initialize is not None:
            initialize()


def _restore_dynamo_capture(ours: Any, original: Any) -> None:
    """dynamo keeps `nn.Module.__call__` as it was when torch._dynamo was imported
    (`unpatched_nn_module_call` in torch/_dynamo/utils.py, imported by name into
    variables/nn_module.py) and short-cuts a module call to its forward only while the
    module's `__call__` *is* that function. Imported during discovery, it kept ours: put back
    torch's own, or every compiled module call would be traced through `__call__` for good."""
    for name in ("torch._dynamo.utils", "torch._dynamo.variables.nn_module"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "unpatched_nn_module_call", None) is ours:
            module.unpatched_nn_module_call = original


class ForwardGraphs:
    """Whether the autograd graphs of training forwards are ever used by a backward. A forward
    of a model in train() mode with autograd on records a graph and keeps its activations for
    a backward; one whose output no backward reaches (images sampled from a generator every N
    steps, a metric computed on the side) paid for both for nothing.

    On detail steps, the root forward's output tensors (the output, or the elements of a
    tuple, list or dict output) get one flag, set by a pre-hook on each one's grad_fn
    (`Node.register_prehook`: it runs when a backward, Tensor.backward or autograd.grad,
    reaches that node). Nothing of the graph is held: a graph the job drops is dropped. The
    background thread decides once the forward's step and the next one have closed (`settle`),
    so a graph whose backward comes a step later is used, and the run's last steps are left
    undecided."""

    GRACE_STEPS = 1
    MAX_OUTPUTS = 8  # tensors of one output looked at
    MAX_PENDING = 10_000

    def __init__(self) -> None:
        self.pending: deque[tuple[int, str, list[bool]]] = deque()  # (step, model class, [used])
        self.watched = 0  # forwards decided
        self.unused = 0
        self.unused_by_model: dict[str, int] = {}
        self._settling = threading.Lock()  # the sampler's drain and a snapshot's catch-up

    def watch(self, module: nn.Module, output: Any, step: int) -> None:
        """Training thread, after a detail step's training forward of a root. Nothing more is
        watched while MAX_PENDING wait (no background thread settling them: bounded memory)."""
        if len(self.pending) >= self.MAX_PENDING:
            return
        if isinstance(output, torch.Tensor):
            tensors = [output]
        elif isinstance(output, (tuple, list)):
            tensors = list(output[:self.MAX_OUTPUTS])
        elif isinstance(output, dict):  # and Hugging Face's ModelOutput
            tensors = list(output.values())[:self.MAX_OUTPUTS]
        else:
            return
        used = [False]

        def reached(grad_outputs: Any) -> None:
            used[0] = True

        nodes = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not nodes:
            return  # no graph recorded (no parameter needs grad, a frozen model)
        for node in nodes:
            node.register_prehook(reached)
        self.pending.append((step, type(module).__name__, used))

    def settle(self, closed: int) -> None:
        """Background thread: decide the forwards of steps up to `closed` - GRACE_STEPS."""
        pending = self.pending
        with self._settling:
            while pending and pending[0][0] <= closed - self.GRACE_STEPS:
                _, name, used = pending.popleft()
                self.watched += 1
                if not used[0]:
                    self.unused += 1
                    self.unused_by_model[name] = self.unused_by_model.get(name, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {"training_forwards_watched": self.watched, "training_forwards_unused": self.unused,
                "unused_forward_models": dict(self.unused_by_model)}


class _RootHook:
    """A module hook that copies and pickles as a no-op (deepcopy for EMA, torch.save(model))."""

    def __init__(self, call) -> None:
        self.call = call

    def __call__(self, *args: Any) -> None:
        return self.call(*args)

    def __reduce__(self):
        return (_inert_hook, ())

    def __deepcopy__(self, memo: dict) -> Any:
        return _inert_hook()


class _InertHook:
    def __call__(self, *args: Any) -> None:
        return None


def _inert_hook() -> _InertHook:
    return _InertHook()
