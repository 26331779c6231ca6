"""torch.compile made visible: what dynamo compiled while the job trained, read off torch's own
records; nothing of tuneup's runs where dynamo traces.

- Each compilation is timed by dynamo's compile callbacks (torch/_dynamo/callback.py
  `callback_handler`: the start callbacks run before the first of nested compilations, the
  end callbacks after the last, on the thread that compiles). Its seconds go to the open
  step's `compile_seconds` (steps.py LATE): that step is a warm-up step, reported without its
  compile time and left out of the phase split (StepRing.columns).
- At each tick, off the training thread: graphs (`counters["stats"]["unique_graphs"]`),
  recompiles with the guard that failed (`torch._dynamo.utils.guard_failures`: code object →
  the failure reasons, one per recompile), graph breaks with dynamo's reason and the job's
  line (`graph_break_reasons`: each with the user stack at the break). torch keeps these for
  the whole process and `torch._dynamo.reset()` clears them: the figures are the process's.

torch._dynamo is never imported here: a job that never compiles never loads it. It is looked
for in sys.modules at attach and at every tick, and the callbacks registered again after a
`torch._dynamo.reset()` (which clears them).
"""

from __future__ import annotations

import sys
from collections import Counter
from time import perf_counter
from typing import Any

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
            self.on = False
            self.timeline.fail(self.name, exc)

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
            **recompiles(getattr(utils, "guard_failures", {})),
            **graph_breaks(list(getattr(utils, "graph_break_reasons", ()))),
        }


def _where(code: Any) -> str:
    return f"{getattr(code, 'co_name', '?')} at {_short(getattr(code, 'co_filename', '?'))}:{getattr(code, 'co_firstlineno', 0)}"


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _first_line(text: Any) -> str:
    return str(text).strip().splitlines()[0][:200] if str(text).strip() else "?"


def recompiles(failures: Any) -> dict[str, Any]:
    """{"recompiles": n, "recompile_sites": [{"where", "count", "guard"}]}: per compiled code,
    how often it recompiled and the latest guard that failed."""
    sites = []
    total = 0
    for code, reasons in list(dict(failures).items()):
        reasons = list(reasons)
        if not reasons:
            continue
        total += len(reasons)
        sites.append({"where": _where(code), "count": len(reasons), "guard": _first_line(reasons[-1])})
    sites.sort(key=lambda site: -site["count"])
    return {"recompiles": total, "recompile_sites": sites[:TOP]}


def graph_breaks(reasons: list[Any]) -> dict[str, Any]:
    """{"graph_breaks": n, "graph_break_sites": [{"where", "count", "reason"}]}: the job's line
    each break happened at (the innermost frame of its user stack) and dynamo's reason."""
    counted: Counter[tuple[str, str]] = Counter()
    for reason in reasons:
        if not getattr(reason, "graph_break", True):
            continue
        stack = getattr(reason, "user_stack", None) or []
        frame = stack[-1] if stack else None
        where = f"{_short(frame.filename)}:{frame.lineno}" if frame is not None else "?"
        counted[(where, _first_line(getattr(reason, "reason", "?")))] += 1
    return {"graph_breaks": sum(counted.values()),
            "graph_break_sites": [{"where": where, "count": count, "reason": text}
                                  for (where, text), count in counted.most_common(TOP)]}
