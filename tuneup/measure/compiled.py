"""torch.compile made visible: what dynamo compiled while the job trained, read off torch's own
records; nothing of tuneup's runs where dynamo traces.

- Each compilation is timed by dynamo's compile callbacks (torch/_dynamo/callback.py
  `callback_handler`: the start callbacks run before the first of nested compilations, the
  end callbacks after the last, on the thread that compiles). Its seconds go to the open
  step's `compile_seconds` (steps.py LATE): that step is a warm-up step, reported without its
  compile time, left out of the phase split (StepRing.columns) and of the step-time
  statistics (windows.py step_distribution).
- At each tick, off the training thread: graphs (`counters["stats"]["unique_graphs"]`),
  recompiles with the guard that failed (`torch._dynamo.utils.guard_failures`: code object →
  the failure reasons, one per recompile), graph breaks with dynamo's reason and the job's
  line (`graph_break_reasons`: each with the user stack at the break). torch keeps these for
  the whole process and `torch._dynamo.reset()` clears them: the sites are those since the
  latest reset (the recompile total keeps those before it: CompileProbe._wrap_clear).

torch._dynamo is never imported here: a job that never compiles never loads it. It is looked
for in sys.modules at attach and at every tick, and where the job loads it after attach
(torch.compile does, and what it returns compiles at its first call, later), as soon as it has
loaded (_patching.AfterImport); and again as a `torch._dynamo.reset()` clears them
(callback_handler.clear, wrapped on the instance). Every compilation is then seen before
dynamo traces it: its time, and the optimizer steps it may hide (OptimizerProbe.compile_begins;
should one be missed all the same, StepTimeline.unseen_fetch finds those steps later).
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from time import perf_counter
from typing import Any

import torch

from .._patching import AfterImport
from .hotpath import StepTimeline

TOP = 5  # recompile and graph-break sites named


class CompileProbe:
    name = "compile"

    def __init__(self, timeline: StepTimeline) -> None:
        self.timeline = timeline
        self.on = True
        self.compiles = 0
        self.seconds = 0.0
        self._started: float | None = None
        self._handler: Any = None
        self.frames: dict[int, int] = {}  # dynamo frame id -> its recompiles seen, since the latest reset
        self.recompiles_before = 0  # those of the frames before it (a reset numbers frames from 0 again)
        self.began = False  # a compilation began since attach
        self.on_begin: Any = None  # told when one begins, before dynamo traces (OptimizerProbe.compile_begins)
        self._patches: Any = None  # the agent's PatchSet (install): callback_handler.clear

    def install(self, patches: Any) -> None:
        self._patches = patches
        if "torch._dynamo" not in sys.modules:
            AfterImport(("torch._dynamo",), lambda dynamo: self._watch_quietly()).install(patches)
        self.watch()

    def _watch_quietly(self) -> None:
        """watch(), from inside the job's import of dynamo or torch's reset: never into them."""
        try:
            self.watch()
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.fail(self.name, exc)

    def quiet(self) -> bool:
        """Dynamo has converted no frame in this process (before attach, or since: one
        converted before the callbacks were registered counts too), and one that begins will
        be seen before dynamo traces it (the start callback is registered now, here if dynamo
        was loaded since it was last looked for). Asked at the closes that are due
        (OptimizerProbe.pre_hook_needed)."""
        if self._handler is None:
            self.watch()  # torch._dynamo loaded since the last tick (an optimizer's first step loads it)
        handler = self._handler
        if self.began or handler is None or self._begin not in getattr(handler, "start_callbacks", ()):
            return False
        counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
        return counters is not None and not (counters.get("frames") or {}).get("total", 0)

    def watch(self) -> None:
        """Register the compile callbacks once torch._dynamo is loaded (again after a reset)."""
        if not self.on:
            return
        dynamo = sys.modules.get("torch._dynamo")
        handler = getattr(dynamo, "callback_handler", None) if dynamo is not None else None
        if handler is None or self._begin in getattr(handler, "start_callbacks", ()):
            return
        handler.register_start_callback(self._begin)
        handler.register_end_callback(self._end)
        self._handler = handler
        if self._patches is not None and "clear" not in vars(handler):
            self._patches.replace(handler, "clear", self._wrap_clear)

    def _wrap_clear(self, original: Any) -> Any:
        """callback_handler.clear, which `torch._dynamo.reset()` calls (torch/_dynamo/__init__.py
        reset): the callbacks cleared, ours registered again at once, so a compilation right
        after a reset is seen too. A clear that raises (a compilation pending) raises as it would.

        reset() also numbers dynamo's frames from 0 again (`convert_frame.FRAME_COUNTER = 0`,
        before this clear): the frames counted so far are set apart, their recompiles kept in
        the total, none of them given to a new frame of the same number. (The new dict first:
        a summary in between counts them in neither, for one tick, never twice.)"""

        def clear() -> None:
            original()
            earlier, self.frames = self.frames, {}
            self.recompiles_before += sum(earlier.values())
            self._watch_quietly()

        return clear

    def close(self) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        for remove, callback in ((handler.remove_start_callback, self._begin), (handler.remove_end_callback, self._end)):
            try:
                remove(callback)
            except ValueError:  # cleared by a reset since
                pass

    def _begin(self, args: Any) -> None:
        self._started = perf_counter()
        self.began = True
        if self.on_begin is not None:
            try:
                self.on_begin()
            except Exception as exc:  # never into dynamo's compilation
                self._failed(exc)
        # "F/C": dynamo's frame F compiled for the (C+1)-th time (torch/_guards.py CompileId):
        # C recompiles of that frame so far.
        trigger = getattr(getattr(args, "callback_trigger", None), "name", None)
        frame, _, attempt = str(getattr(args, "compile_id", "")).partition("/")
        if trigger == "DYNAMO" and frame.isdigit() and attempt.split("_")[0].isdigit():
            self.frames[int(frame)] = max(self.frames.get(int(frame), 0), int(attempt.split("_")[0]))

    def _end(self, args: Any) -> None:
        started, self._started = self._started, None
        if started is None or not self.on:
            return
        try:
            seconds = perf_counter() - started
            self.compiles += 1
            self.seconds += seconds
            ring = self.timeline.ring
            ring.put("compile_seconds", ring.count + 1, seconds, add=True)  # the open step's
        except Exception as exc:  # never into dynamo's compilation
            self._failed(exc)

    def summary(self) -> dict[str, Any] | None:
        """Compilations, graphs, recompiles and graph breaks so far; None in a job that never
        loaded dynamo. Off the training thread: torch's structures are copied, never changed."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return None
        counters = getattr(utils, "counters", {})
        stats = counters.get("stats") or {}
        return {
            "compiles": self.compiles,
            "seconds": self.seconds,
            "graphs": int(stats.get("unique_graphs", 0)),
            **recompiles(dict(self.frames), getattr(utils, "guard_failures", {}), before=self.recompiles_before),
            **graph_breaks(list(getattr(utils, "graph_break_reasons", ()))),
        }


def _where(code: Any) -> str:
    name, line = getattr(code, "co_name", "?"), getattr(code, "co_firstlineno", 0)
    resumed = _RESUMED.match(name)
    if resumed:  # the code dynamo made for what follows a graph break inside `name`
        name = f"{resumed.group(1)} after its graph break at line {resumed.group(2)}"
    return f"{name} at {_short(getattr(code, 'co_filename', '?'))}:{line}"


_RESUMED = re.compile(r"torch_dynamo_resume_in_(.+)_at_(\d+)$")


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


_TORCH = os.path.dirname(torch.__file__) + os.sep


def _torch_file(path: str) -> bool:
    return path.startswith(_TORCH)


def _first_line(text: Any) -> str:
    return str(text).strip().splitlines()[0][:200] if str(text).strip() else "?"


def recompiles(frames: dict[int, int], failures: Any, before: int = 0) -> dict[str, Any]:
    """{"recompiles": n, "recompile_sites": [{"where", "count", "guard"}]}: per compiled frame
    since the latest `torch._dynamo.reset()`, how often it recompiled (from the compile ids
    dynamo's callbacks saw) and the latest guard that failed for it; `n` adds `before`, the
    recompiles of the frames before it. `guard_failures` is no count: it holds a reason for every cached graph
    whose guards failed at a lookup (a call that finds its graph third notes two), each
    prefixed with that graph's compile id "F/C"; the frame's code is its key."""
    reasons_by_frame: dict[int, tuple[Any, str]] = {}
    for code, reasons in list(dict(failures).items()):
        for reason in list(reasons):
            frame = str(reason).split("/", 1)[0]
            if frame.isdigit():
                reasons_by_frame[int(frame)] = (code, str(reason))
    sites = []
    for frame, count in frames.items():
        if count < 1:
            continue
        code, reason = reasons_by_frame.get(frame, (None, "?"))
        guard = _first_line(reason.split(": ", 1)[1] if ": " in reason else reason)
        sites.append({"where": _where(code) if code is not None else f"frame {frame}", "count": count,
                      "guard": guard})
    sites.sort(key=lambda site: -site["count"])
    return {"recompiles": before + sum(frames.values()), "recompile_sites": sites[:TOP]}


def graph_breaks(reasons: list[Any]) -> dict[str, Any]:
    """{"graph_breaks": n, "graph_break_sites": [{"where", "count", "reason"}]}: the job's line
    each break happened at (the innermost frame of its user stack) and dynamo's reason."""
    counted: Counter[tuple[str, str]] = Counter()
    for reason in reasons:
        if not getattr(reason, "graph_break", True):
            continue
        stack = getattr(reason, "user_stack", None) or []
        # The innermost frame of the job's own (a break inside torch's code is named where
        # the job called into it).
        frame = next((entry for entry in reversed(stack) if not _torch_file(entry.filename)), stack[-1] if stack else None)
        where = f"{_short(frame.filename)}:{frame.lineno}" if frame is not None else "?"
        counted[(where, _first_line(getattr(reason, "reason", "?")))] += 1
    return {"graph_breaks": sum(counted.values()),
            "graph_break_sites": [{"where": where, "count": count, "reason": text}
                                  for (where, text), count in counted.most_common(TOP)]}
