"""Host-device synchronizations per step, by kind, with the source lines that cause them.

Counted on sampled steps only (a few early steps, then one drawn at random from every N), so
unsampled steps pay nothing. Two backends, chosen per sampled step:

- CUDA initialized: torch's own sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`)
  reports every synchronizing CUDA call as a warning; we count and swallow those warnings
  while the step is sampled and switch the mode back afterwards. (torch's GPU-trace
  callbacks were the other candidate, but once activated they cannot be turned off and call
  into Python on every allocation and event for the rest of the process.)
- CPU only: the host reads that would block on an accelerator (`.item()`, `.tolist()`,
  `bool(t)`, `float(t)`, `int(t)`, `.cpu()`, `.numpy()`, `.nonzero()`) are counted on the
  sampled step and reported as "would sync on GPU". Reads inside the DataLoader, inside
  optimizer.step (CPU-side step counters) and inside tuneup don't count. The function
  `torch.nonzero` cannot be wrapped (TorchScript resolves it by identity: see calls.py): the
  call watch counts it on the steps it watches, so its figures have their own denominator
  (WATCHED_KINDS: sampled steps that were also watched).

The host-read wrappers (Tensor methods: TorchScript and dynamo resolve those by name, never
through the Python attribute) are built once, at attach, and put in place only while a
sampled step counts (SyncCounter.install: _patching.PatchSet.switch). In place on every step
they cost every read of every step (AdamW reads each parameter's step count with .item());
swapped in and out, a sampled step pays for setting and deleting 8 attributes of
torch.Tensor, and torch's code after it for the interpreter's attribute caches of every tensor
that this invalidates. That cost falls on sampled steps only, which are detail steps (see
sample_after), so the detail steps' measured cost (windows.detail_cost) holds it and their
pacing budgets for it. Each wrapper, after its flag, asks whether torch compiles
(_patching.COMPILING), so dynamo folds it away and never guards on our state.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import warnings
from types import FrameType
from typing import Any, Callable

import torch

from .._patching import PatchSet, Switch, call_site, compile_bindings, posing_as, quiet_dynamo_switch
from .copies import is_blocking_copy
from .hotpath import HOST_READ, StepTimeline
from .steps import sampled_after
from .terms import BLOCKING_COPY_KIND, DISTRIBUTION_CHECK_KIND, GRAD_SCALER_KIND, OPTIMIZER_KIND

HOST_READS: tuple[tuple[Any, str], ...] = (
    (torch.Tensor, "item"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "__bool__"),
    (torch.Tensor, "__float__"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "cpu"),
    (torch.Tensor, "numpy"),
    (torch.Tensor, "nonzero"),
)
# Explicit syncs: sync debug mode misses most of them (torch.cuda.synchronize goes to
# c10::cuda::device_synchronize, Event.synchronize to cudaEventSynchronize, neither of which
# calls warn_or_error_on_sync), but not all: Stream.synchronize reaches
# c10::cuda::stream_synchronize (c10/cuda/CUDAFunctions.h), which does warn where the torch build
# routes CUDAStream::synchronize through it (torch 2.11 on an H100 did: each counted twice). The
# three are Python functions (torch/cuda/__init__.py, torch/cuda/streams.py): the call watch notes
# calls of their code (calls.py), as it does torch.nonzero's, rather than replacing them: dynamo
# resolves torch.cuda.synchronize by identity (torch/_dynamo/variables/torch.py
# handle_synchronize); a debug-mode warning raised inside one of them is that same call, and
# is not counted again.
EXPLICIT_SYNC_KINDS = ("cuda.synchronize", "Event.synchronize", "Stream.synchronize")
WATCHED_KINDS = frozenset({"torch.nonzero", *EXPLICIT_SYNC_KINDS})  # seen by the call watch only (calls.py)
CUDA_SYNC_MESSAGE = "called a synchronizing CUDA operation"
MAX_SOURCES = 256
_DEBUG_MODE_QUIETED = False  # torch's one-time "prototype feature" warning: kept from the job's output
EARLY_SAMPLES = (3, 4, 5)  # step 1-2 carry one-off start-up work
SAMPLE_EVERY = 20  # sync_sample_every unset: one step drawn from every 20, or from each detail step's block where larger


def explicit_sync_codes() -> dict[Any, str]:
    """The code objects of the explicit syncs, each with its kind (EXPLICIT_SYNC_KINDS, in order)."""
    codes = {}
    functions = (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize)
    for function, kind in zip(functions, EXPLICIT_SYNC_KINDS, strict=True):
        code = getattr(inspect.unwrap(function), "__code__", None)
        if code is not None:
            codes[code] = kind
    return codes


# Frames of these modules are library code, not the line the user should change. The demo
# job ships inside tuneup but is user code as far as its advice is concerned. The warnings
# machinery is written in `_py_warnings` from Python 3.14 on (`warnings` re-exports it).
_WARNING_MODULES = ("warnings", "_py_warnings")
_LIBRARY_PREFIXES = ("torch.", "tuneup.", "contextlib", "functools") + _WARNING_MODULES
_USER_MODULES = frozenset({"tuneup.demo"})


def past_warnings(frame: FrameType | None) -> FrameType | None:
    """The first frame outside the warnings machinery, whatever module holds it: by module name
    and by file (that of the function that called showwarning: `warnings._showwarnmsg`, or
    `_py_warnings._showwarnmsg` on 3.14)."""
    machinery = _warnings_files()
    while frame is not None and (frame.f_globals.get("__name__", "") in _WARNING_MODULES
                                 or frame.f_code.co_filename in machinery):
        frame = frame.f_back
    return frame


@functools.lru_cache(maxsize=1)
def _warnings_files() -> frozenset[str]:
    files = {getattr(warnings, "__file__", None)}
    show = getattr(warnings, "_showwarnmsg", None)
    files.add(getattr(getattr(show, "__code__", None), "co_filename", None))
    return frozenset(name for name in files if name)


def user_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in _USER_MODULES or not (module == "torch" or module.startswith(_LIBRARY_PREFIXES)):
            return frame
        frame = frame.f_back
    return None


_GRAD_SCALER_MODULES = frozenset({"torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler"})


def _inherent_kind(frame: FrameType | None) -> str | None:
    """GRAD_SCALER_KIND or OPTIMIZER_KIND where the read happens inside GradScaler or an
    optimizer's own code before any user frame; else None."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in _GRAD_SCALER_MODULES:
            return GRAD_SCALER_KIND
        if module.startswith("torch.optim."):
            return OPTIMIZER_KIND
        if module in _USER_MODULES or not (module == "torch" or module.startswith(_LIBRARY_PREFIXES)):
            return None
        frame = frame.f_back
    return None


def _source(frame: FrameType | None, kind: str) -> tuple[str, int, str, str] | None:
    """A read's source line: (file, line, function, kind) of its user frame, if it has one."""
    inner = frame
    frame = user_frame(frame)
    while inner is not None and inner is not frame:
        if inner.f_globals.get("__name__", "").startswith("torch.distributions"):
            kind = DISTRIBUTION_CHECK_KIND
            break
        inner = inner.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, kind)


def _tally(counts: dict[tuple[str, int, str, str], int], key: tuple[str, int, str, str], amount: int = 1) -> bool:
    """Add `amount` to a source line's count; False (nothing added) when the table already
    holds MAX_SOURCES lines and this is a new one."""
    if key in counts or len(counts) < MAX_SOURCES:
        counts[key] = counts.get(key, 0) + amount
        return True
    return False


def format_location(filename: str, lineno: int) -> str:
    try:
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            filename = relative
    except ValueError:
        pass
    return f"{filename}:{lineno}"


class SyncCounter:
    name = "syncs"

    def __init__(self, timeline: StepTimeline, sample_every: int | None, thread_id: int) -> None:
        # None: SAMPLE_EVERY, or paced with the detail steps where those come further apart (sample_after).
        self.paced = sample_every is None
        if sample_every is None:
            sample_every = SAMPLE_EVERY
        self.on = sample_every > 0
        self.timeline = timeline
        self.sample_every = sample_every
        self.thread_id = thread_id
        self.sampling = False
        self.counting_reads = False  # the CPU wrappers count only while this is set
        self.next_sample = self.sample_after(0) if sample_every > 0 else -1
        self.backend = "cpu"  # "cpu": would sync on GPU; "cuda": real syncs
        self.calls = 0  # in the sampled step under way
        self.sampled_steps = 0
        self.watched_steps = 0  # sampled steps the call watch also watched: WATCHED_KINDS' denominator
        self.step_watched = False  # set by the call watch for the step it watches
        self.max_per_step = 0
        # Counted into the step under way, merged into the totals when it completes, so a
        # step cut short (detach, an exception) never skews the per-step figures.
        self.step_kinds: dict[str, int] = {}
        self.step_sources: dict[tuple[str, int, str, str], int] = {}
        self.step_unattributed = 0
        self.by_kind: dict[str, int] = {}
        self.sources: dict[tuple[str, int, str, str], int] = {}  # (file, line, function, kind)
        self.source_steps: dict[tuple[str, int, str, str], int] = {}  # sampled steps each source read on
        # Reads inside evaluation phases (hotpath.py evaluation_forward): not the steps', counted
        # per phase instead.
        self.evaluation_sources: dict[tuple[str, int, str, str], int] = {}
        self.evaluation_phases = 0  # phases with reads counted
        self._evaluation_seen = 0  # the id of the latest of them
        self.unattributed = 0
        self.off_reason: str | None = None
        self._busy = False
        self._reads: list[Switch] = []  # the host reads' wrappers (install), in place while counting_reads
        self._cuda_state: tuple[Any, ...] | None = None
        self._explicit = explicit_sync_codes()

    # --- step boundaries (a timeline listener) --------------------------------------

    def on_close(self, step: int) -> None:
        """A timeline listener: ends a sampled step and starts the next one when due."""
        if self.sampling:
            self._stop()
            self.timeline.ring.put("syncs", step, self.calls)
            self.sampled_steps += 1
            self.watched_steps += self.step_watched
            self.max_per_step = max(self.max_per_step, self.calls)
            for kind, count in self.step_kinds.items():
                self.by_kind[kind] = self.by_kind.get(kind, 0) + count
            for key, count in self.step_sources.items():
                if _tally(self.sources, key, count):
                    self.source_steps[key] = self.source_steps.get(key, 0) + 1
                else:
                    self.unattributed += count
            self.unattributed += self.step_unattributed
        if step + 1 == self.next_sample and self.on:
            self.next_sample = self.sample_after(step + 1)
            self._start()

    def sample_after(self, step: int) -> int:
        """The first sampled step after `step`: steps 3-5, then one drawn at random from each
        block of `sample_every` (steps.py sampled_after: no loop period aliases with it), moved
        on to the first detail step from there (also drawn at random): a sampled step is a
        detail step, so the two share their wake-ups (apart, they cost 3,000 instructions a
        step more on the 0.4 ms step: benchmarks/bench_instructions.py). With sync_sample_every
        unset (`paced`), where detail steps come further apart than that (hotpath.py
        StepTimeline.pace, on short steps), every detail step is sampled and no other: a loop
        running thousands of steps a second needs no more of them, and each sampled step costs
        a close of its own (the one that starts it), some 40 Python operations a step on the
        0.2 ms step at one in 20."""
        for early in EARLY_SAMPLES:
            if early > step:
                return early
        if self.sample_every <= 0:
            return -1
        drawn = sampled_after(step, self.sample_every)
        every = self.timeline.detail_every  # (sampling more often than detail steps come: as drawn, unless paced)
        return sampled_after(drawn - 1, every) if 1 < every and (every <= self.sample_every or self.paced) else drawn

    def turn_off(self, reason: str) -> None:
        """Stop sampling for a reason that is not a failure (e.g. torch.compile in use)."""
        self.on = False
        self.off_reason = reason
        self._stop()

    def install(self, patches: PatchSet) -> None:
        """Build the host reads' wrappers (CPU backend), in place only while a sampled step
        counts them (`_start`/`_stop`). In place on every step they cost each read some ten
        operations for nothing: AdamW's step reads every parameter's step count with .item()
        (torch/optim/optimizer.py _get_value; 64 operations a step for the 6 of
        bench_overhead.py's ~5 ms step, one a parameter in a transformer on a GPU, where these
        wrappers never count: the CUDA backend counts syncs through torch's sync debug mode).
        Swapping costs some 5 µs a sampled step (8 attributes of torch.Tensor, set and deleted)."""
        if not self.on:
            return
        self._reads = [patches.switch(owner, attribute, lambda original, kind=attribute.strip("_"):
                                      self._counting(kind, original))
                       for owner, attribute in HOST_READS]

    def _start(self) -> None:
        self.calls = 0
        self.step_kinds = {}
        self.step_sources = {}
        self.step_unattributed = 0
        # is_initialized() alone: is_available() would initialize the CUDA driver in a CPU job.
        if torch.cuda.is_initialized():
            if torch.cuda.get_sync_debug_mode() != 0:
                self.turn_off("the job set torch.cuda.set_sync_debug_mode itself")
                return
            self.backend = "cuda"
            self._start_cuda()
        else:
            self.backend = "cpu"
            for read in self._reads:
                read.on()
            self.counting_reads = True
        self.sampling = True

    def _stop(self) -> None:
        self.sampling = False
        self.counting_reads = False
        for read in self._reads:
            read.off()
        if self._cuda_state is not None:
            self._stop_cuda()

    # --- CPU: count the host reads on sampled steps ----------------------------------

    def _counting(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        # Posing as the Tensor method it wraps (see posing_as): after a graph break, dynamo
        # skips its frame as it skips torch's own instead of compiling it.
        return posing_as(original, HOST_READ, home=torch.Tensor, _tuneup_original=original, _tuneup_counter=self,
                         _tuneup_counts=functools.partial(self._counts, kind), _tuneup_quiet=quiet_dynamo_switch(),
                         _tuneup_call_site=call_site, _tuneup_getframe=sys._getframe, **compile_bindings())

    def _counts(self, kind: str) -> bool:
        """Whether the read under way (the caller's caller) is one of the job's host reads on
        the sampled step; if so it is recorded and reads inside it are not counted again."""
        timeline = self.timeline
        if (self._busy or timeline.in_loader or timeline.in_optimizer
                or timeline.in_tuneup or threading.get_ident() != self.thread_id):
            return False
        try:
            if timeline.evaluating:
                self.record_evaluation(kind, sys._getframe(2))
            else:
                self.record(kind, sys._getframe(2))  # _counts <- the wrapper <- the caller
        except Exception as exc:
            self.close()
            self.timeline.fail(self.name, exc)
            return False
        self._busy = True  # a read inside a counted read is the same sync
        return True

    # --- CUDA: torch's sync debug mode -------------------------------------------------

    def _start_cuda(self) -> None:
        global _DEBUG_MODE_QUIETED
        previous_mode = torch.cuda.get_sync_debug_mode()
        if _DEBUG_MODE_QUIETED:
            torch.cuda.set_sync_debug_mode(1)
        else:
            # The first switch in a process warns once that the mode is a prototype
            # (torch/csrc/cuda/Module.cpp, TORCH_WARN_ONCE): a line in the job's output that
            # tuneup put there (seen on an H100; the compiled-job tests compare warnings).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.cuda.set_sync_debug_mode(1)
            _DEBUG_MODE_QUIETED = True
        previous_show = warnings.showwarning
        warnings.filterwarnings("always", message=CUDA_SYNC_MESSAGE)
        added_filter = warnings.filters[0]
        counter = self
        explicit = self._explicit

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if CUDA_SYNC_MESSAGE in str(message):
                if threading.get_ident() == counter.thread_id and not counter.timeline.in_tuneup:
                    frame = past_warnings(sys._getframe(1))
                    if frame is None or frame.f_code not in explicit:  # those are the call watch's
                        kind = BLOCKING_COPY_KIND if is_blocking_copy(user_frame(frame)) else "cuda_sync"
                        counter.record(kind, frame)
                return None
            return previous_show(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        self._cuda_state = (previous_mode, previous_show, added_filter, showwarning)

    def _stop_cuda(self) -> None:
        previous_mode, previous_show, added_filter, ours = self._cuda_state  # type: ignore[misc]
        self._cuda_state = None
        torch.cuda.set_sync_debug_mode(previous_mode)
        if warnings.showwarning is ours:
            warnings.showwarning = previous_show
        try:
            warnings.filters.remove(added_filter)
            warnings._filters_mutated()  # type: ignore[attr-defined]
        except (ValueError, AttributeError):
            pass

    # --- recording -------------------------------------------------------------------

    def record(self, kind: str, frame: FrameType | None) -> None:
        """One host read (or CUDA sync) on the sampled step under way."""
        self.calls += 1
        kind = _inherent_kind(frame) or kind  # a read torch's own code needs: not the loop's to remove
        self.step_kinds[kind] = self.step_kinds.get(kind, 0) + 1
        key = _source(frame, kind)
        if key is None or not _tally(self.step_sources, key):
            self.step_unattributed += 1

    def record_evaluation(self, kind: str, frame: FrameType | None) -> None:
        """One host read inside an evaluation phase of the sampled step."""
        phase = self.timeline.evaluation_id
        if phase != self._evaluation_seen:
            self._evaluation_seen = phase
            self.evaluation_phases += 1
        key = _source(frame, kind)
        if key is not None:
            _tally(self.evaluation_sources, key)

    # --- results ---------------------------------------------------------------------

    def summary(self, top: int = 10) -> dict[str, Any]:
        sampled = self.sampled_steps

        def per_step(kind: str, count: int) -> float:
            steps = self.watched_steps if kind in WATCHED_KINDS else sampled
            return count / steps if steps else 0.0

        by_kind = {kind: per_step(kind, count) for kind, count in sorted(dict(self.by_kind).items())} if sampled else {}
        sources = [(key, per_step(key[3], count)) for key, count in dict(self.sources).items()] if sampled else []
        ranked = sorted(sources, key=lambda item: -item[1])[:top]
        source_steps = dict(self.source_steps)
        return {
            "measured": sampled > 0,
            "backend": self.backend,
            "meaning": "cuda synchronizations" if self.backend == "cuda" else "host reads that would sync on GPU",
            "sampled_steps": sampled,
            "per_step": sum(by_kind.values()) if sampled else None,
            "max_per_step": self.max_per_step if sampled else None,
            "by_kind": by_kind,
            "top_sources": [
                {
                    "location": format_location(filename, lineno),
                    "function": function,
                    "kind": kind,
                    "per_step": rate,
                    # On how many of the sampled steps it read, and how often when it did: a
                    # read of evaluation or logging every N steps shows as such.
                    "steps": source_steps.get((filename, lineno, function, kind), 0),
                    "out_of": self.watched_steps if kind in WATCHED_KINDS else sampled,
                }
                for (filename, lineno, function, kind), rate in ranked
            ],
            "unattributed_per_step": self.unattributed / sampled if sampled else None,
            "evaluation": self._evaluation_summary(top),
            "off_reason": self.off_reason,
        }

    def _evaluation_summary(self, top: int) -> dict[str, Any] | None:
        """Reads per evaluation phase (of the phases sampled), by source line."""
        phases = self.evaluation_phases
        if not phases:
            return None
        ranked = sorted(dict(self.evaluation_sources).items(), key=lambda item: -item[1])[:top]
        return {
            "phases": phases,
            "per_phase": sum(self.evaluation_sources.values()) / phases,
            "top_sources": [{"location": format_location(filename, lineno), "function": function, "kind": kind,
                             "per_phase": count / phases}
                            for (filename, lineno, function, kind), count in ranked],
        }

    def close(self) -> None:
        self.on = False
        self._stop()
