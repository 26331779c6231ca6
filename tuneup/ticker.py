"""The background thread: one tick per `interval`, off the training thread.

A tick, under the run state's lock: the recorder drains the step ring and samples the slow
probes (its events go to the outputs), the outputs log warnings and beat, the rules run when
due, and apply mode's findings go in and its records come out. In apply mode the first ticks
come EARLY_TICKS times as often, until the rules have looked at the steps they need
(WARMUP_STEPS + MIN_STEPS): a trial starts from a finding, and on a job of 5 ms steps the
first finding came at step ~196, a second in, where its steps were there at step 41. The last tick runs at detach
(final=True), and once more before the job destroys its process group (`final_exchange`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable

from .diagnose.rule import MIN_STEPS
from .measure.history import WARMUP_STEPS
from .measure.state import LOCK_TIMEOUT, RunState

EARLY_TICKS = 4  # apply mode's first ticks: this many an interval

if TYPE_CHECKING:
    from .act import Experimenter
    from .diagnose.live import LiveDiagnosis
    from .export.outputs import Outputs
    from .measure.recorder import Recorder


class Ticker:
    """Runs `tick` every `interval` seconds on a daemon thread until stopped."""

    def __init__(self, interval: float, state: RunState, recorder: "Recorder", outputs: "Outputs",
                 diagnosis: "LiveDiagnosis", experimenter: "Experimenter | None",
                 is_live: Callable[[], bool]) -> None:
        self.interval = interval
        self.state, self.recorder, self.outputs = state, recorder, outputs
        self.diagnosis, self.experimenter = diagnosis, experimenter
        self._is_live = is_live  # False once detached: the exchange at destroy is then skipped
        self.ticks = 0
        self.early = experimenter is not None  # until the rules first saw enough steps (apply mode)
        self._pid = os.getpid()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tuneup-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for its tick in flight (bounded: it may be stuck in NVML)."""
        self.stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2.0, 2 * self.interval))

    def forked(self) -> None:
        """In a forked child: the inherited event may have been held at the fork."""
        self.stopping = threading.Event()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval / EARLY_TICKS if self.early else self.interval):
            if os.getpid() != self._pid:
                return
            try:
                self.tick()
            except Exception as exc:  # the tick itself must never die silently
                self.state.warn("background", f"background sampling stopped after an internal error: {exc!r}")
                return

    def tick(self, final: bool = False) -> None:
        """One tick (the caller need not hold the lock; it is re-entrant)."""
        with self.state.lock:
            self.ticks += 1
            cost = self.recorder.cost  # each part's time: the snapshot's "agent_cost"
            self.recorder.sample(self.ticks, final)
            with cost.part("outputs"):
                self.outputs.tick()
            experimenter = self.experimenter
            if self.diagnosis.due(self.ticks, final, experimenter is not None and experimenter.accepting):
                # (The steps drained into the history: what the rules read. A drain holds back
                # steps whose loss or GPU time is still in flight.)
                looked = self.recorder.totals.sums["steps"] >= WARMUP_STEPS + MIN_STEPS
                with cost.part("rules"):
                    self.diagnosis.run()
                self.early = self.early and not looked
            if experimenter is not None:
                with cost.part("apply"):
                    experimenter.publish(self.state.findings(), self.recorder.system, self.recorder.config)
                    for record in experimenter.drain():
                        self.outputs.emit({"event": "action", **record})

    def final_exchange(self) -> None:
        """Before the job destroys its process group: the steps so far into the history, then
        the final cross-rank summaries (diagnose/live.py guards destroy_process_group)."""
        if self._is_live() and self.state.lock.acquire(timeout=LOCK_TIMEOUT):
            try:
                self.tick()
                self.diagnosis.finish()
            finally:
                self.state.lock.release()

    def last(self, end_event: Callable[[], dict[str, Any]], close: Callable[[], None]) -> None:
        """At detach, after the probes are quiet: the final tick, the rules on the whole run, the
        run log's end event, then `close` (whatever happened before it). Skipped, with a warning,
        when the sampler is stuck (in NVML, say): what it holds is then left to it."""
        if not self.state.lock.acquire(timeout=LOCK_TIMEOUT):
            self.state.warn("background", "the background sampler did not stop; the run log has no end event")
            return
        try:
            self.tick(final=True)
            self.diagnosis.finish()
            self.outputs.emit(end_event())
        finally:
            self.state.lock.release()
            close()
