"""Where a loop's input time goes: the training thread's stack, sampled while it builds input.

The timeline measures, on detail steps, the loop's own time before the step's first forward
(`StepTimeline.in_input`, from the step's start or its optimizer's end to the first forward,
data wait and zero_grad left out): batches built in the loop (`get_batch()` from a memmap,
tokenizing, generator pipelines, `.to(device)`). That says how much; this says where. A
thread of tuneup's own wakes a few hundred times a second and, only while the training
thread is in that stretch, reads its current frame (`sys._current_frames()`, which takes
the GIL for a moment and walks no other thread) and counts the innermost frame of the job's
own code, with the loop line that led there. The training thread does nothing for it.

It runs only once the input is a real share of the step (the recorder starts it: see
`Recorder.sample`), and stops at detach.

A thread can only look when the training thread lets go of the GIL: at once when it calls
into C code that releases it, but in pure Python (a character-by-character tokenizer) only
after the interpreter's switch interval (5 ms by default: `sys.getswitchinterval()`), by
when an input stretch of a few ms is over. Measured on tests/programs/slow_tokenizer.py
(4 ms of pure-Python tokenizing per step, 500 steps): at 5 ms, 8 samples, most of them on
the loop line after the tokenizer; at 1 ms, 78 samples, on encode() and make_batch(). So
while it runs the sampler lowers the switch interval to SWITCH_INTERVAL and puts it back
when it stops (unless the job changed it meanwhile): the training thread then yields the
GIL at most every millisecond when the sampler asks, a few hundred times a second.

Input made of pure-Python stretches shorter than that stays nearly unseen: the sampler gets
the GIL when the forward's first torch call releases it, after the stretch. Measured on a
1.4 ms step with 1 ms of pure-Python input: 8 of 1,141 wake-ups found the thread in its
input, against 17% of the time spent there. The input figure is exact either way (the
timeline's clock reads); its lines are named only where the stretches are longer, as slow
tokenizers and batch builders worth moving are.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import FrameType
from typing import Any

from .syncs import format_location

MAX_LINES = 256
# Fewer samples name no lines: a sample lands where the training thread next lets go of the GIL,
# and a handful of them can all land on the loop's line after a long C call (a short run beside
# busy processes: 3 of 8 on `x, y = make_batch(...)`'s line, 1 in encode()).
MIN_SAMPLES = 20
RATE_HZ = 250
SWITCH_INTERVAL = 0.001  # seconds; see the module docstring
_LIBRARY_DIRS = tuple(sorted({os.path.normcase(os.path.realpath(path)) + os.sep for path in (
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"]) if path}))
_TUNEUP_DIR = os.path.normcase(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))) + os.sep
# A sample inside these is not input: a DataLoader's fetch (data wait, counted already), an
# optimizer's step, autograd, a module's call (the forward is about to begin).
_NOT_INPUT = ("torch.utils.data", "torch.optim", "torch.autograd", "torch.nn.modules.module")
_USER_MODULES = frozenset({"tuneup.demo"})  # ships inside tuneup, but is a job's code


_LIBRARY_FILES: dict[str, bool] = {}  # is_library's answers, by code file (at most 4,096)


def is_library(filename: str) -> bool:
    """Whether a code file is the standard library's, an installed package's or tuneup's."""
    known = _LIBRARY_FILES.get(filename)
    if known is None:
        path = os.path.normcase(os.path.realpath(filename)) if not filename.startswith("<") else filename
        known = path.startswith(_LIBRARY_DIRS) or path.startswith(_TUNEUP_DIR) or filename.startswith("<frozen")
        if len(_LIBRARY_FILES) < 4096:
            _LIBRARY_FILES[filename] = known
    return known


class InputSampler:
    """Samples the training thread's stack while the timeline says it is building input."""

    name = "input_lines"

    def __init__(self, timeline: Any, thread_id: int, rate_hz: float = RATE_HZ) -> None:
        self.timeline = timeline
        self.thread_id = thread_id
        self.period = 1.0 / rate_hz
        self.samples = 0  # counted while in input
        # (file, line, function, the loop's (file, line) or None) -> samples
        self.lines: dict[tuple[str, int, str, tuple[str, int] | None], int] = {}
        self.unattributed = 0  # samples in library code only
        self.failure: str | None = None  # why sampling stopped, if it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch_interval: float | None = None  # the job's, while ours is in force

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            if sys.getswitchinterval() > SWITCH_INTERVAL:
                self._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL)
            self._thread = threading.Thread(target=self._run, name="tuneup-stacks", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)
        if self._switch_interval is not None:
            if sys.getswitchinterval() == SWITCH_INTERVAL:  # the job left ours alone: put its own back
                sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def _run(self) -> None:
        timeline, stop, period = self.timeline, self._stop, self.period
        try:
            while not stop.wait(period):
                if timeline.in_input:
                    frame = sys._current_frames().get(self.thread_id)
                    if frame is not None and timeline.in_input:
                        self.record(frame)
        except Exception as exc:  # never the job's problem: the figures stop growing
            self.failure = f"{type(exc).__name__}: {exc}"

    def record(self, frame: FrameType | None) -> None:
        """One sample: the innermost frame of the job's own code, and the outermost one (the
        loop's line), unless the thread is in work that is not input (_NOT_INPUT)."""
        inner: FrameType | None = None
        outer: FrameType | None = None
        while frame is not None:
            module = frame.f_globals.get("__name__")
            if not isinstance(module, str):
                module = ""
            if module.startswith(_NOT_INPUT):
                return
            if module in _USER_MODULES or not is_library(frame.f_code.co_filename):
                if inner is None:
                    inner = frame
                outer = frame
            frame = frame.f_back
        self.samples += 1
        if inner is None:
            self.unattributed += 1
            return
        loop = (outer.f_code.co_filename, outer.f_lineno) if outer is not None and outer is not inner else None
        key = (inner.f_code.co_filename, inner.f_lineno, inner.f_code.co_name, loop)
        if key in self.lines or len(self.lines) < MAX_LINES:
            self.lines[key] = self.lines.get(key, 0) + 1
        else:
            self.unattributed += 1

    def summary(self, top: int = 5) -> dict[str, Any] | None:
        """The functions the samples fell in (with each one's most-sampled line), by share;
        none below MIN_SAMPLES samples."""
        samples = self.samples
        if not samples:
            return None
        functions: dict[tuple[str, str, tuple[str, int] | None], list] = {}  # -> [samples, best line, its samples]
        for (filename, line, function, loop), count in dict(self.lines).items():
            entry = functions.setdefault((filename, function, loop), [0, line, 0])
            entry[0] += count
            if count > entry[2]:
                entry[1], entry[2] = line, count
        ranked = sorted(functions.items(), key=lambda item: -item[1][0])[:top] if samples >= MIN_SAMPLES else []
        return {
            "samples": samples,
            "top_lines": [{"location": format_location(filename, line), "function": function,
                           "loop_line": format_location(*loop) if loop is not None else None,
                           "share": count / samples}
                          for (filename, function, loop), (count, line, _) in ranked],
            "unattributed_share": self.unattributed / samples,
        }
