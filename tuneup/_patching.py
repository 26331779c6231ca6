"""Reversible changes to other people's objects.

Every attribute the agent replaces and every hook it registers goes through a PatchSet,
so `detach()` can put each object back exactly as it was (an inherited attribute is
deleted again rather than copied onto the subclass).
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.util
import inspect
import re
import sys
import types
from typing import Any, Callable

_MISSING = object()


def quiet_dynamo_switch() -> Callable[[Any], Any]:
    """The C switch under torch._dynamo.disable (available without importing torch._dynamo),
    looked up when a wrapper is built: importing this module does not import torch, so
    `tuneup report` and the launcher start without it."""
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except ImportError:  # pragma: no cover - a torch without dynamo
        return lambda callback: None
    return set_eval_frame


def dynamo_skips(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, marked so that dynamo's frame callback never sees its frames: a function
    the interpreter calls on its own (a profile function, on every call of a watched step)
    would otherwise be handed to dynamo inside a compiled region, and counted as a frame the
    job's program compiled (torch/_dynamo/convert_frame.py: `counters["frames"]["total"]`
    counts each frame the callback gets). The C flag torch._dynamo.eval_frame.skip_code sets,
    without importing torch._dynamo; a torch without it leaves the function as it is."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(function.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    except (ImportError, AttributeError, TypeError, RuntimeError):  # pragma: no cover - older torch
        pass
    return function


def compile_check() -> tuple[Callable[[], bool], Any]:
    """(dynamo, flags): `dynamo() or flags._is_compiling_flag` is torch.compiler.is_compiling()
    at one Python call instead of two (torch/compiler/__init__.py: is_compiling() calls
    torch.jit.is_scripting() and returns the module's _is_compiling_flag), for the checks that
    run on every step. While dynamo traces it, `is_dynamo_compiling()` folds to True
    (torch/_dynamo/variables/torch.py: a constant) and `or` never reads the flag, so dynamo
    guards on nothing; non-strict torch.export runs the code itself with the flag set
    (torch/_export/utils.py). A torch without either: is_compiling() alone."""
    import torch.compiler as compiler

    dynamo = getattr(compiler, "is_dynamo_compiling", None)
    if dynamo is not None and isinstance(getattr(compiler, "_is_compiling_flag", None), bool):
        return dynamo, compiler
    return compiler.is_compiling, types.SimpleNamespace(_is_compiling_flag=False)


COMPILING = "(_tuneup_dynamo() or _tuneup_flags._is_compiling_flag)"  # in templates: compile_bindings()


def compile_bindings() -> dict[str, Any]:
    dynamo, flags = compile_check()
    return {"_tuneup_dynamo": dynamo, "_tuneup_flags": flags}


# The call of the original in the wrappers' templates. Without keywords (most calls), `f(*args)`:
# `f(*args, **kwargs)` with an empty dict costs a dict and the keyword path of the call, about
# 1,100 instructions a call (callgrind: pass-through wrappers of next, forward, backward and
# zero_grad, 4,600 a 0.4 ms step less written this way; benchmarks/bench_instructions.py --floor).
CALL_ORIGINAL = "(_tuneup_original(*args, **kwargs) if kwargs else _tuneup_original(*args))"

# A measured call of a torch function, posing as it (see posing_as and measured).
_MEASURED = f"""
def measured(*args, **kwargs):
    if {COMPILING}:
        return {CALL_ORIGINAL}
    _tuneup_prior = _tuneup_quiet(None)
    try:
        _tuneup_token = _tuneup_before(args, kwargs)
    except Exception as _tuneup_error:
        _tuneup_token = None
        _tuneup_failed(_tuneup_error)
    finally:
        if _tuneup_prior is not None:
            _tuneup_quiet(_tuneup_prior)
    if _tuneup_token is None:
        return {CALL_ORIGINAL}
    _tuneup_result = None
    try:
        _tuneup_result = {CALL_ORIGINAL}
        return _tuneup_result
    finally:
        _tuneup_prior = _tuneup_quiet(None)
        try:
            _tuneup_after(_tuneup_token, _tuneup_result, args, kwargs)
        except Exception as _tuneup_error:
            _tuneup_failed(_tuneup_error)
        finally:
            if _tuneup_prior is not None:
                _tuneup_quiet(_tuneup_prior)
"""

# Gates for measured(gate=...): calls it skips (straight to the original) without calling
# `before`, for wrappers called on every step: an attribute test or two on the steps they do
# not measure, where is_compiling() and the call of `before` cost several times as much.
# Either way nothing of tuneup's is read while dynamo traces the wrapper (it would guard on it
# and recompile whenever it flips): the gate first only where dynamo never traces the
# wrapper (its file is one dynamo skips: Tensor.backward, Optimizer.zero_grad).
# The gate is the step timeline: `hooked` is True on detail steps and, in loops that update
# their parameters by hand, on every step (hotpath.py StepTimeline.by_hand).
OFF_DETAIL = f"not _tuneup_gate.hooked or {COMPILING}"
# A module's forward: one in train() mode off hooked steps; one in eval() mode is looked at on
# every step (evaluation phases, eval() forwards with grad). Autograd's state is not asked
# here: torch.is_grad_enabled() in this test cost 4,000 instructions a step
# (benchmarks/bench_instructions.py), so a no-grad forward in train() mode is the step's.
# Optimizer.zero_grad: also called, off detail steps, for an optimizer whose instance has a
# `step` of its own (the job compiled it: OptimizerProbe.adopt_compiled_step); never traced.
OPTIMIZER_OFF_DETAIL = f"not (_tuneup_gate.hooked or 'step' in args[0].__dict__) or {COMPILING}"
TRAINING_OFF_DETAIL = f"{COMPILING} or (not _tuneup_gate.hooked and args[0].training)"
# The same for a compiled model's call, wrapped on the instance (ModelProbe.timed_compiled):
# its module is not among the arguments but `held()`, a weak reference to the module whose
# `training` is a plain attribute (torch.compile's OptimizedModule forwards `training` to the
# module it wraps through a property: 5 µs a read, measured by cProfile on a 0.4 ms step).
HELD_TRAINING_OFF_DETAIL = f"{COMPILING} or (not _tuneup_gate.hooked and _tuneup_held().training)"


def measured(original: Any, before: Callable[[tuple, dict], Any], after: Callable[[Any, Any, tuple, dict], None],
             failed: Callable[[BaseException], None], *, home: type | None = None, gate: Any = None,
             skip: str = OFF_DETAIL, held: Any = None) -> types.FunctionType:
    """`original`, posing as itself (posing_as), with `before(args, kwargs)` run ahead of each
    call and, where it returned a token other than None, `after(token, result, args, kwargs)`
    once the call returned (result None if it raised). An exception either raises goes to
    `failed` (the probe turns itself off), never into the job; `failed` may not raise.

    Neither runs while dynamo traces the call (COMPILING comes first and folds to True:
    dynamo traces straight to `original` and guards on none of tuneup's state), and both run
    with dynamo's frame callback off, as torch._dynamo.disable does it
    (torch/_dynamo/eval_frame.py: `set_eval_frame(None)`): inside a compiled function's eager
    parts (after a graph break) dynamo would otherwise compile tuneup's bookkeeping frames as
    the job's own: extra graphs and graph breaks.

    With a `gate` (an object with a `hooked` flag, the StepTimeline), calls are skipped as
    `skip` says: OFF_DETAIL, TRAINING_OFF_DETAIL or HELD_TRAINING_OFF_DETAIL (with `held`, a
    weak reference to the module it reads; see there)."""
    bindings = dict(_tuneup_original=original, _tuneup_before=before, _tuneup_after=after, _tuneup_failed=failed,
                    _tuneup_quiet=quiet_dynamo_switch(), **compile_bindings())
    if gate is None:
        return posing_as(original, _MEASURED, home=home, **bindings)
    template = _MEASURED.replace(f"    if {COMPILING}:", f"    if {skip}:", 1)
    if held is not None:
        bindings["_tuneup_held"] = held
    return posing_as(original, template, home=home, _tuneup_gate=gate, **bindings)


def posing_as(original: Any, template: str, *, home: type | None = None, **bindings: Any) -> types.FunctionType:
    """The function `template` defines, built to pass for `original` wherever torch's
    front-ends look at a function rather than call it.

    - TorchScript compiles a module's `forward` from `inspect.getsource` (which follows
      `__wrapped__` to `original`) and resolves the names in it through the function's own
      `__globals__` and closure (torch/jit/_recursive.py `make_stub`, torch/_jit_internal.py
      `get_closure`); its file is `inspect.getsourcefile` of the function itself
      (torch/_sources.py `get_source_lines_and_file`). A plain wrapper has tuneup's globals and
      file: `torch.jit.script(model)` then fails on any name the model's module imports.
    - fx.symbolic_trace patches the functions it autowraps in the forward's `__globals__`
      (torch/fx/_symbolic_trace.py `Tracer.trace`).
    - dynamo decides by a frame's file whether to trace it or skip it (torch/_dynamo/
      trace_rules.py `check`): torch's own files are skipped, so a wrapper in tuneup's file
      around a torch function is traced where the original would be skipped (an extra graph
      break, an extra frame compiled).

    So the wrapper gets `original`'s globals, file, name and def line (for a function written
    in C, those of `home`, the class that holds it). The names it uses itself are `bindings`:
    closure variables, all `_tuneup_`-prefixed (no clash with the user's names); it uses no
    global name, not even a builtin. An exception passing through it leaves with the
    wrapper's own traceback entry taken off (`unwind`): the traceback is the job's own.
    (Every line of it is numbered as the def line, so where the entry stays, Python 3.10,
    it shows that line rather than a line of tuneup.)

    `template` is the source of one function definition using the names in `bindings`.
    """
    if any(not name.startswith("_tuneup_") for name in bindings):
        raise ValueError("bindings must be named _tuneup_*")
    code = getattr(original, "__code__", None)
    if code is not None:
        filename, line, globals_, name = code.co_filename, code.co_firstlineno, original.__globals__, code.co_name
        qualname = getattr(code, "co_qualname", None)
    else:  # a function written in C: it poses as a function of the class that holds it
        if home is None:
            raise ValueError(f"{original!r} has no code: give the class that holds it as home")
        filename, line, globals_ = _class_place(home)
        name = original.__name__
        qualname = f"{home.__qualname__}.{name}"
    bindings = dict(bindings, _tuneup_unwind=unwind)
    names = tuple(sorted(bindings))
    inner = _factory(template, names)(*(bindings[name] for name in names))
    code = _relocated(inner.__code__, filename, line).replace(co_name=name)
    if qualname is not None and hasattr(code, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=qualname)
    wrapper = types.FunctionType(code, globals_, name, inner.__defaults__, inner.__closure__)
    return functools.update_wrapper(wrapper, original)


_SITE_FACTORY = """
def _tuneup_site_factory(_tuneup_unwind):
    def site(_tuneup_call, *args, **kwargs):
        try:
            return _tuneup_call(*args, **kwargs)
        except BaseException as _tuneup_raised:
            _tuneup_unwind(_tuneup_raised)
            raise
    return site
"""
_SITE_CACHE_SIZE = 1024
_sites: dict[tuple[Any, int], types.FunctionType] = {}


def _site_template() -> types.FunctionType:
    """`site` of _SITE_FACTORY, every instruction on line 1 (co_firstlineno moves them all)."""
    return _on_line_one(_SITE_FACTORY, "_tuneup_site_factory")(unwind)


_factories: dict[tuple[str, tuple[str, ...]], Callable[..., types.FunctionType]] = {}


def _factory(template: str, names: tuple[str, ...]) -> Callable[..., types.FunctionType]:
    """A function of `names` returning the function `template` defines, its body inside a
    try that unwinds what raises through it (posing_as), compiled once per template and
    names: every instruction on line 1, so `_relocated` moves them all to one line. (Parsing
    and compiling each wrapper anew took half of attach(): 8-25 ms of 16-56 ms for its 15
    wrappers, timed around posing_as.)"""
    key = (template, names)
    factory = _factories.get(key)
    if factory is None:
        header, *body = template.strip("\n").splitlines()
        source = (f"def _tuneup_factory({', '.join(names)}):\n    {header}\n        try:\n"
                  + "".join(f"        {text}\n" for text in body)
                  + "        except BaseException as _tuneup_raised:\n"
                  + "            _tuneup_unwind(_tuneup_raised)\n            raise\n"
                  + "    return " + _defined(template) + "\n")
        factory = _factories[key] = _on_line_one(source, "_tuneup_factory")
    return factory


def _on_line_one(source: str, name: str) -> Any:
    """The object `source` defines as `name`, compiled with every instruction on line 1."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if "lineno" in node._attributes:
            node.lineno = node.end_lineno = 1
            node.col_offset = node.end_col_offset = 0
    namespace: dict[str, Any] = {}
    exec(compile(tree, "<tuneup>", "exec"), namespace)
    return namespace[name]


def _relocated(code: types.CodeType, filename: str, line: int) -> types.CodeType:
    """`code` (and the code it nests) in `filename`, every instruction on `line`: the line
    table holds offsets from co_firstlineno, all 0 in code compiled by _on_line_one."""
    consts = tuple(_relocated(value, filename, line) if isinstance(value, types.CodeType) else value
                   for value in code.co_consts)
    return code.replace(co_filename=filename, co_firstlineno=line, co_consts=consts)


def call_site(frame: types.FrameType) -> Callable[..., Any]:
    """A function `site(call, *args, **kwargs)` that calls `call(*args, **kwargs)` from where
    `frame` stands: a frame of its own with that frame's file, line, function name and globals.

    A C function's warning names the innermost Python frame (torch buffers its C++ warnings
    and raises them as Python warnings on the way back to Python: torch/csrc/Exceptions.cpp
    PyWarningHandler; PyErr_WarnEx, stack level 1), and the warning's filters and registry are
    that frame's module's. Called from a wrapper of a C method (the host reads: hotpath.py
    HOST_READ), a warning inside it would name the wrapper's place (torch/_tensor.py, its
    `class Tensor` line); called through this, the job's line and module, as without the
    wrapper. An error inside leaves this frame off its traceback (unwind); dynamo never sees
    the frame (dynamo_skips). One function per
    site, kept for the next call (the first _SITE_CACHE_SIZE sites)."""
    code = frame.f_code
    key = (code, frame.f_lineno)
    site = _sites.get(key)
    if site is None:
        template = _SITE_TEMPLATE
        site_code = _relocated(template.__code__, code.co_filename, max(1, frame.f_lineno or 1)).replace(
            co_name=code.co_name)
        # Its frame is the job's file: inside a compiled function's eager part (a `.item()`
        # after its graph break) dynamo's frame callback would get it as the job's own frame
        # and count it (counters["frames"]["total"], convert_frame.py ConvertFrame.__call__).
        # Skipped: only this frame, the read it calls is handled as without tuneup.
        site = dynamo_skips(types.FunctionType(site_code, frame.f_globals, code.co_name, None, template.__closure__))
        if len(_sites) < _SITE_CACHE_SIZE:
            _sites[key] = site
    return site


class AfterImport(importlib.abc.MetaPathFinder):
    """`after(module)` once a module named in `names` has run, where the job imports it: a
    finder at the head of `sys.meta_path` that lets the normal finders find the module and
    runs it with its own loader, then calls `after`. Nothing is imported that the job does not
    import. `install(patches)`: the PatchSet removes the finder at undo (detach)."""

    def __init__(self, names: tuple[str, ...], after: Callable[[Any], None]) -> None:
        self.names = names
        self.after = after
        self._finding = False

    def install(self, patches: PatchSet) -> None:
        sys.meta_path.insert(0, self)
        patches.add_handle(self)  # undo: remove()

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.names or self._finding:
            return None
        self._finding = True  # the normal finders find it; this one steps aside meanwhile
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderThenCall(spec.loader, self.after)
        return spec


class _LoaderThenCall(importlib.abc.Loader):
    """The module's own loader, then `after(module)` once the module has run."""

    def __init__(self, loader: Any, after: Callable[[Any], None]) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = self.loader  # the module keeps its own loader (reloads, resources)
        self.loader.exec_module(module)
        self.after(module)


def unwind(exc: BaseException) -> None:
    """Take the calling wrapper's own entry off `exc`'s traceback; the wrapper then re-raises
    with a bare `raise`, and the job's traceback is the one it prints without tuneup: no frame
    of a wrapper between the job's call and the function it called.

    Python 3.11+: a bare `raise` re-raises with the exception's own `__traceback__` and adds
    no entry for the frame that re-raises (CPython Python/ceval.c: RAISE_VARARGS 0 goes through
    do_raise to `exception_unwind`, past the `error` label's PyTraceBack_Here; the same for the
    RERAISE a `finally` ends with). Python 3.10 re-raises the traceback its handler caught
    (the frame's exc_info), so there the wrapper's entry stays, at the wrapped function's def
    line (posing_as)."""
    traceback = exc.__traceback__
    if traceback is not None and traceback.tb_frame is sys._getframe(1):
        exc.__traceback__ = traceback.tb_next


def interrupted_at_exit() -> bool:
    """At exit: whether the job's main code ended in an unhandled KeyboardInterrupt (Ctrl-C).
    The top-level handler (PyErr_Print) leaves it in sys.last_value; an interactive session
    leaves any exception there, so one never counts."""
    return (type(getattr(sys, "last_value", None)) is KeyboardInterrupt
            and not hasattr(sys, "ps1") and not sys.flags.interactive)


def keep_the_interrupted_exit() -> None:
    """After a Ctrl-C ended the job (interrupted_at_exit), make the process still exit by
    SIGINT once tuneup's exit-time work ran, as it does without tuneup (status -2; 130 in a
    shell) rather than with status 1.

    CPython exits by SIGINT when a process-wide flag, set when the main code ended in an
    unhandled KeyboardInterrupt, is still set after finalization, which runs the atexit
    handlers (Modules/main.c Py_RunMain). But every exec() or eval() of source text clears it
    first, and sets it again only if that code ends in KeyboardInterrupt itself
    (Python/pythonrun.c run_eval_code_obj): a dataclass or namedtuple created at exit (a module
    the detach imports for the first time) is such an exec. The same mechanism sets it back."""
    try:
        exec("raise KeyboardInterrupt")
    except KeyboardInterrupt:
        pass


def _class_place(cls: type) -> tuple[str, int, dict[str, Any]]:
    """The file and `class` line that define `cls`, and its module's globals: those of the
    Python functions it defines (torch.Tensor says it is torch's; it is written in
    torch/_tensor.py). Line 1 where the line is not found."""
    function = next((value for value in vars(cls).values() if isinstance(value, types.FunctionType)), None)
    if function is not None:
        filename, globals_ = function.__code__.co_filename, function.__globals__
    else:
        filename, globals_ = inspect.getsourcefile(cls) or "<unknown>", vars(sys.modules[cls.__module__])
    return filename, _class_line(filename, cls.__name__), globals_


@functools.lru_cache(maxsize=None)
def _class_line(filename: str, name: str) -> int:
    pattern = re.compile(rf"^class {re.escape(name)}\b")
    try:
        with open(filename, encoding="utf-8") as source:
            for number, text in enumerate(source, start=1):
                if pattern.match(text):
                    return number
    except OSError:
        pass
    return 1


def _defined(template: str) -> str:
    """The name of the function `template` defines."""
    return template.strip().split("(", 1)[0].split()[-1]


class Switch:
    """A replacement of `owner.name` put in place (`on`) and taken out (`off`) at will; each
    only where the attribute is as the other left it: a wrapper someone put there meanwhile
    (a profiler's) is neither covered nor removed."""

    def __init__(self, owner: Any, name: str, own: Any, replacement: Any) -> None:
        self.owner, self.name, self.own, self.replacement = owner, name, own, replacement

    @property
    def in_place(self) -> bool:
        return vars(self.owner).get(self.name, _MISSING) is self.replacement

    def on(self) -> None:
        if vars(self.owner).get(self.name, _MISSING) is self.own:
            setattr(self.owner, self.name, self.replacement)

    def off(self) -> None:
        # Someone wrapped ours after it was put in place: their wrapper stays. Ours checks
        # whether the agent is active, so it passes calls straight through.
        if self.in_place:
            if self.own is _MISSING:
                delattr(self.owner, self.name)
            else:
                setattr(self.owner, self.name, self.own)


class PatchSet:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.replaced: list[tuple[Any, str, Any]] = []  # (owner, name, original) of each replace, in effect or not

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace `owner.name` with `make(original)`; undo restores the exact prior state (a
        switch put in place until undo)."""
        self.switch(owner, name, make).on()

    def switch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Switch:
        """`make(original)`, built now and put in place only between `on()` and `off()`: for a
        wrapper that has work only now and then, where being in place costs every call (a
        host read's wrapper: AdamW's step reads each parameter's step count with .item()).
        Undo leaves the original in place."""
        own = vars(owner).get(name, _MISSING)
        original = getattr(owner, name)
        switch = Switch(owner, name, own, make(original))
        self.replaced.append((owner, name, original))
        self._undo.append(switch.off)
        return switch

    def add_handle(self, handle: Any) -> None:
        """Keep a RemovableHandle (torch hooks) for removal at undo time."""
        self._undo.append(handle.remove)

    def undo_all(self) -> list[BaseException]:
        """Undo in reverse order; never raises, returns what failed."""
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # pragma: no cover - defensive
                errors.append(exc)
        return errors

    def __len__(self) -> int:
        return len(self._undo)


_SITE_TEMPLATE = _site_template()
