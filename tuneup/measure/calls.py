"""Calls of torch functions that tuneup must not replace, seen on a few watched steps.

`torch.tensor(ndarray)` copies (the numpy-copies rule), `torch.nonzero(...)` host reads (the
syncs probe's CPU backend), explicit syncs (`torch.cuda.synchronize()`, `Event.synchronize()`,
`Stream.synchronize()`: sync debug mode misses most of them; dynamo resolves the first by
identity) and gradient clipping (`clip_grad_norm_`/`clip_grad_value_`, the
no-grad-clipping rule) happen in calls of torch functions that torch's own front-ends resolve
by identity or compile from source, so no wrapper may stand in for them:
- TorchScript keys builtins by `id()` (torch/jit/_builtins.py: `_builtin_table[id(builtin)]`,
  looked up by `_find_builtin`): a wrapped `torch.tensor` is no longer `aten::tensor`, so
  scripting any function that calls it compiles the wrapper instead, and fails (`import
  torch.distributed.optim` does so at import);
- a Python function called from scripted code is compiled from its source with the
  function's own globals (torch/jit/_recursive.py `try_compile_fn`, torch/_jit_internal.py
  `get_closure`): a wrapper's source and globals are tuneup's.

Instead, on watched steps only, a profile function on the training thread (`sys.setprofile`
acts on the calling thread alone) notes the calls as they happen:
- `c_call` of `torch.tensor`: a one-shot TorchFunctionMode is pushed for that call. The C
  function hands its arguments to the mode on top of the stack before it runs (torch's
  `handle_torch_function`; torch/overrides.py TorchFunctionMode), so a copy of a NumPy array
  is told from a tensor built from a list, and timed. The mode is popped at the call's
  `c_return`/`c_exception`: no other call ever sees it, and no compiled region runs under it
  (dynamo guards on the mode stack: torch/_dynamo/guards.py make_torch_function_mode_stack_guard);
- `c_call` of `torch.nonzero`: a host read (the output's size lives on the device);
- `call` of the clipping functions' and the explicit syncs' code objects;
- `call` and `return` of the functions that write files and figures (torch.save, numpy's
  save/savez, matplotlib's savefig, PIL's Image.save, torchvision's save_image, those of the
  modules the job has imported): their time and source line (the file-writes rule).

A watched step costs its Python calls a profile event each (1.1-2x the step on this kind of
CPU host), so steps 3-5 are watched, then the gap to the next watched step is chosen so that
the measured extra time stays under WATCH_BUDGET of the training time. Another profiler (the
job's own cProfile, torch.profiler's Python tracer) keeps its place: that step goes unwatched.
"""

from __future__ import annotations

import inspect
import math
import statistics
import sys
import threading
from collections import deque
from time import perf_counter
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .._patching import dynamo_skips
from .hotpath import StepTimeline
from .syncs import MAX_SOURCES, SyncCounter, explicit_sync_codes, format_location, user_frame

EARLY_WATCHES = (3, 4, 5)  # steps 1-2 carry one-off start-up work
WATCH_BUDGET = 0.001  # the watched steps' extra time, as a share of the training time
MIN_GAP, MAX_GAP = 50, 5000  # steps between watched steps after the early ones
COPY_STEPS = 64  # the latest watched steps whose copy time gives the typical step's
RECENT_STEPS = 16  # unwatched steps whose mean is a step's usual time
_TENSOR = torch.tensor
_NONZERO = torch.nonzero


# Functions that write a file or a figure: (module, attribute path). Only modules the job has
# imported are looked at (sys.modules): tuneup imports none of them.
WRITERS = (
    ("torch.serialization", "save"), ("numpy", "save"), ("numpy", "savez"), ("numpy", "savez_compressed"),
    ("numpy", "savetxt"), ("matplotlib.figure", "Figure.savefig"), ("matplotlib.pyplot", "savefig"),
    ("PIL.Image", "Image.save"), ("torchvision.utils", "save_image"),
)
WRITE_SOURCES = 5  # source lines kept


def _write_codes() -> dict[Any, str]:
    """The code objects of WRITERS in the modules already imported, each with its name."""
    codes = {}
    for module_name, path in WRITERS:
        target = sys.modules.get(module_name)
        for part in path.split("."):
            target = getattr(target, part, None)
        code = getattr(inspect.unwrap(target), "__code__", None) if callable(target) else None
        if code is not None:
            codes[code] = f"{module_name.split('.')[0]}.{path.split('.')[-1]}"
    return codes


def _clip_codes() -> frozenset:
    """The code objects that run when a job clips gradients (unwrapped from torch's no_grad
    decorator, whose wrapper code every decorated function shares)."""
    from torch.nn.utils import clip_grad

    codes = set()
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        function = getattr(clip_grad, name, None)
        if function is not None:
            codes.add(inspect.unwrap(function).__code__)
    return frozenset(codes)


class _ArrayData(TorchFunctionMode):
    """Pushed for one `torch.tensor` call: notes whether its data is a NumPy array."""

    def __init__(self, watch: "CallWatch", ndarray: type) -> None:
        super().__init__()
        self.watch = watch
        self.ndarray = ndarray

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        data = args[0] if args else kwargs.get("data")
        if func is not _TENSOR or not isinstance(data, self.ndarray):
            return func(*args, **kwargs)
        began = perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            # Frame 1 is the caller of torch.tensor: the C function adds no Python frame.
            self.watch.copied(perf_counter() - began, sys._getframe(1))


class CallWatch:
    name = "calls"

    def __init__(self, timeline: StepTimeline, syncs: SyncCounter) -> None:
        self.on = True
        self.timeline = timeline
        self.syncs = syncs  # where torch.nonzero host reads are counted (CPU backend)
        self.watching = False
        self.next_watch = EARLY_WATCHES[0]
        self.watched_steps = 0
        self.busy_steps = 0  # steps that would have been watched while another profiler ran
        self.numpy_copies = 0
        self.numpy_copies_in_loader = 0
        self.numpy_copy_seconds = 0.0
        # Each watched step's copy time: its median is the typical step's (a mean over a few
        # watched steps on a busy machine is one descheduled copy: 5x the loop's own measure).
        self.step_copy_seconds: deque[float] = deque(maxlen=COPY_STEPS)
        self._copy_seconds_at_start = 0.0
        self.numpy_sources: dict[str, int] = {}
        self.clip_calls = 0
        self.writes = 0  # file and figure writes on watched steps (outermost calls)
        self.write_seconds = 0.0
        self.write_sources: dict[str, list] = {}  # "file:line (name)" -> [calls, seconds]
        self._writing: tuple[FrameType, float] | None = None  # the write under way: its frame, start
        self._writers: dict[Any, str] = {}
        self._started_at = 0.0
        self._usual = 0.0  # seconds of an unwatched step, when the watched one began
        self._mode: _ArrayData | None = None
        self._pushed = False
        self._failure: BaseException | None = None  # noted inside the mode's handler
        self._thread = 0  # the thread being watched
        self._profile = None
        self._handler_code = _ArrayData.__torch_function__.__code__
        self._clip = _clip_codes()
        self._syncs = explicit_sync_codes()

    def install(self) -> None:
        try:
            import numpy
        except ImportError:  # no NumPy: no arrays to copy
            numpy = None
        if numpy is not None:
            self._mode = _ArrayData(self, numpy.ndarray)
        self._profile = self._make_profile()

    # --- the schedule (a timeline listener) ---------------------------------------------

    def on_close(self, step: int) -> None:
        """Ends a watched step and starts the next one when due."""
        if self.watching:
            self._stop(step)
        if step + 1 == self.next_watch and self.on:
            self._start(step)

    def wake_after(self, step: int) -> int:
        """The next close this watch needs to run at."""
        if self.watching:
            return step + 1
        return self.next_watch - 1 if self.on and self.next_watch > step else 1 << 62

    def _start(self, step: int) -> None:
        # sys.setprofile acts on the calling thread: this must be the one that trains.
        if sys.getprofile() is not None or threading.get_ident() != self.syncs.thread_id:
            self.busy_steps += 1  # the job's own profiler keeps its place
            self.next_watch = self._aligned(step + 1 + MIN_GAP)
            return
        self._usual = self.timeline.ring.recent_step_seconds(RECENT_STEPS)
        self._writers.clear()
        self._writers.update(_write_codes())  # modules the job imported since the last watch
        self._writing = None
        self._copy_seconds_at_start = self.numpy_copy_seconds
        self._started_at = perf_counter()
        self._thread = threading.get_ident()
        self.watching = True
        self.syncs.step_watched = self.syncs.sampling
        sys.setprofile(self._profile)

    def _stop(self, step: int) -> None:
        self.watching = False
        if sys.getprofile() is self._profile:
            sys.setprofile(None)
        self._pop_mode()
        self.watched_steps += 1
        self.step_copy_seconds.append(self.numpy_copy_seconds - self._copy_seconds_at_start)
        seconds = perf_counter() - self._started_at
        if step < EARLY_WATCHES[-1]:
            self.next_watch = step + 1
        else:
            self.next_watch = self._aligned(step + self._gap(seconds))
        self.syncs.step_watched = False

    def _aligned(self, step: int) -> int:
        """`step`, or the first step after it that the sync counter samples: torch.nonzero
        host reads are counted on steps both watched and sampled."""
        sampled = self.syncs.sample_after(step - 1) if self.syncs.on else -1
        return sampled if sampled > 0 else step

    def _gap(self, seconds: float) -> int:
        """Steps to the next watched one: its extra time over the usual step, spread over
        the gap, stays under WATCH_BUDGET of the training time."""
        if self._usual <= 0:
            return MIN_GAP
        extra = max(0.0, seconds - self._usual)
        return min(MAX_GAP, max(MIN_GAP, math.ceil(extra / (WATCH_BUDGET * self._usual))))

    # --- the profile function (watched steps only) --------------------------------------

    def _make_profile(self):
        watch = self
        timeline = self.timeline
        syncs = self.syncs
        # Code objects whose calls are noted: None for the clipping functions, else the sync kind.
        noted = {**dict.fromkeys(self._clip), **self._syncs}
        handler = self._handler_code
        mode = self._mode
        writers = self._writers  # refreshed in place at each watched step's start

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            # Never raise: an exception here would unset the profiler and surface in the job.
            try:
                if not watch.watching:  # closed from another thread (detach at exit): leave
                    if frame.f_code is not handler:  # (inside the handler the mode is off the stack)
                        sys.setprofile(None)
                        watch._pop_mode()
                elif event == "c_call":
                    if arg is _TENSOR:
                        if mode is not None and not watch._pushed and frame.f_code is not handler:
                            mode.__enter__()
                            watch._pushed = True
                    elif arg is _NONZERO and syncs.counting_reads and not (
                            timeline.in_loader or timeline.in_optimizer or timeline.in_tuneup or syncs._busy):
                        syncs.record("torch.nonzero", frame)
                elif event == "call":
                    # Every Python call of the watched step comes here: one lookup for the rest.
                    if frame.f_code in noted:
                        kind = noted[frame.f_code]
                        if kind is None:
                            watch.clip_calls += 1
                        elif syncs.sampling and not (timeline.in_loader or timeline.in_optimizer
                                                     or timeline.in_tuneup or syncs._busy):
                            syncs.record(kind, frame)  # attributed past torch's frames
                    elif frame.f_code in writers and watch._writing is None and not (
                            timeline.in_loader or timeline.in_tuneup):
                        watch._writing = (frame, perf_counter())
                elif event == "return":
                    if watch._writing is not None and frame is watch._writing[0]:
                        watch.wrote(frame, writers[frame.f_code])
                elif arg is _TENSOR and watch._pushed and frame.f_code is not handler:  # c_return, c_exception
                    watch._pop_mode()
                    if watch._failure is not None:
                        watch.fail(watch._failure)
            except Exception as exc:
                watch.fail(exc)

        return dynamo_skips(profile)

    def _pop_mode(self) -> None:
        """Pop the one-shot mode if it is on this thread's stack (not while its handler runs:
        torch takes a mode off the stack for its own handler and puts it back after)."""
        if self._pushed:
            stack = _get_current_function_mode_stack()
            if stack and stack[-1] is self._mode:
                self._mode.__exit__(None, None, None)
                self._pushed = False

    def copied(self, seconds: float, frame: FrameType | None) -> None:
        """A torch.tensor(ndarray) copy on the watched step. Runs inside the mode's handler,
        where torch has taken the mode off the stack for the call: a failure is only noted
        here, and acted on at the call's c_return, once the mode is back where it can be popped."""
        try:
            self.numpy_copies += 1
            self.numpy_copy_seconds += seconds
            if self.timeline.in_loader:
                self.numpy_copies_in_loader += 1
            frame = user_frame(frame)
            if frame is not None:
                where = format_location(frame.f_code.co_filename, frame.f_lineno)
                if where in self.numpy_sources or len(self.numpy_sources) < MAX_SOURCES:
                    self.numpy_sources[where] = self.numpy_sources.get(where, 0) + 1
        except Exception as exc:
            self._failure = exc

    def wrote(self, frame: FrameType, name: str) -> None:
        """A file or figure write on the watched step returned: its time, by source line."""
        seconds = perf_counter() - self._writing[1]
        self._writing = None
        self.writes += 1
        self.write_seconds += seconds
        caller = user_frame(frame.f_back)
        where = format_location(caller.f_code.co_filename, caller.f_lineno) if caller is not None else "?"
        key = f"{where} ({name})"
        if key in self.write_sources or len(self.write_sources) < WRITE_SOURCES:
            entry = self.write_sources.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    # --- results -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        watched = self.watched_steps
        per_step = (lambda n: n / watched) if watched else (lambda n: None)
        sources = sorted(self.numpy_sources.items(), key=lambda item: -item[1])[:5]
        return {
            "watched_steps": watched,
            "numpy_copies": self.numpy_copies,
            "numpy_copies_per_step": per_step(self.numpy_copies),
            "numpy_copies_in_loader": self.numpy_copies_in_loader,
            "numpy_copy_seconds": self.numpy_copy_seconds,
            "numpy_copy_seconds_per_step": statistics.median(self.step_copy_seconds) if self.step_copy_seconds else None,
            "numpy_copy_sources": [{"location": where, "calls": calls} for where, calls in sources],
            "clip_grad_calls": self.clip_calls,
            "clip_grad_calls_per_step": per_step(self.clip_calls),
            "file_writes": self.writes,
            "file_writes_per_step": per_step(self.writes),
            "file_write_seconds_per_step": per_step(self.write_seconds),
            "file_write_sources": [{"location": where, "calls": calls, "seconds": seconds} for where, (calls, seconds)
                                   in sorted(self.write_sources.items(), key=lambda item: -item[1][1])],
        }

    def close(self) -> None:
        self.on = False
        self.watching = False
        if threading.get_ident() == self._thread:
            if sys.getprofile() is self._profile:
                sys.setprofile(None)
            self._pop_mode()
        # From another thread (detach at exit): the profile function removes itself, and the
        # mode, at its next event on the watched thread.

    def fail(self, exc: BaseException) -> None:
        self.close()
        self.timeline.fail(self.name, exc)
