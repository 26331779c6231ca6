"""The agent: the composition root and public face of one job's tuneup. It builds the rooms,
each with one job, and wires them:

    measure/recorder.py   the probes on the training thread → ring → drains, samplers, config
    measure/state.py      the read model: what snapshot(), /metrics, /api/run and reports read
    diagnose/live.py      the rules every few ticks, the rank exchange
    act/experimenter.py   apply mode's experiments, at step closes (training thread)
    export/outputs.py     history + run log, the loopback endpoint, Pushgateway, discovery
    ticker.py             the background thread that ticks all of them once per `interval`
"""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ._patching import PatchSet, interrupted_at_exit, keep_the_interrupted_exit
from .diagnose.live import LiveDiagnosis
from .export.outputs import Outputs
from .measure.objects import sort_objects
from .measure.recorder import Recorder
from .measure.state import RunState, run_info
from .options import Options
from .ticker import Ticker

if TYPE_CHECKING:
    from .act import Experimenter

# The probes apply mode judges and guards its changes through: without them, no change may stay.
GUARDING_PROBES = ("step_close", "steps", "optimizer", "dataloader", "model")


class Agent:
    """Handle on the running agent. Use as a context manager, or call detach()."""

    def __init__(self, options: Options, objects: tuple[Any, ...] = (), inert_reason: str | None = None,
                 on_detach: Callable[["Agent"], None] | None = None) -> None:
        self.options = options
        self.enabled = inert_reason is None
        self.inert_reason = inert_reason
        self.run_info = run_info(options.mode, options.training_job)
        self.state = RunState(self.run_info, options.window_steps)
        self._on_detach = on_detach
        self._pid = os.getpid()
        if self.enabled:
            self._build(sort_objects(objects))

    def _build(self, kinds: dict[str, list[Any]]) -> None:
        options, warn = self.options, self.state.warn
        self._patches = PatchSet()
        self.outputs = Outputs(options, self.state, warn)
        self.recorder = Recorder(options, kinds, warn, self._probe_failed, self.outputs.emit)
        self.state.recorder = self.recorder
        self.experimenter: Experimenter | None = None
        if options.mode == "apply":
            from .act import Experimenter

            self.experimenter = Experimenter.on_probes(self.recorder, options.actions, warn)
            self.recorder.experimenter = self.state.experimenter = self.experimenter
        self.diagnosis = LiveDiagnosis(self.state, options.silence, self.outputs.emit, warn, _print_ranks)
        self.ticker = Ticker(options.interval, self.state, self.recorder, self.outputs, self.diagnosis,
                             self.experimenter, lambda: self.attached)

    # --- public face ---------------------------------------------------------------------

    attached = property(lambda self: self.state.attached)
    patches = property(lambda self: self._patches, doc="What detach undoes (a PatchSet); for the integrations.")
    warnings = property(lambda self: self.state.warnings)

    server = property(lambda self: self.outputs.server if self.enabled else None, doc="The loopback endpoint, or None.")
    run_dir = property(lambda self: self.outputs.run_dir if self.enabled and self.outputs.run_log is not None else None,
                       doc="The run log's folder, or None when no run log is being written (it could not be).")

    def start(self) -> "Agent":
        """Install the probes and start sampling; on any failure undo all of it and raise."""
        if not self.enabled or self.attached:
            return self
        self.state.attached = True
        try:
            self.recorder.install(self._patches)
            self.diagnosis.guard_destroy(self._patches, self.ticker.final_exchange)
            self.outputs.start()
            self.ticker.start()
            atexit.register(self._at_exit)
        except BaseException:
            self.ticker.stopping.set()
            self._quiet()
            self.outputs.cancel()
            self.recorder.close()
            self.state.attached = False
            raise
        return self

    def focus(self, *, models: Iterable[Any] = (), loaders: Iterable[Any] = (), optimizers: Iterable[Any] = (),
              scalers: Iterable[Any] = ()) -> None:
        """Measure exactly these objects, kind by kind (a framework's training objects: its
        validation loaders are then left out); a kind given nothing stays as it was."""
        if self.enabled:
            self.recorder.focus({"models": models, "loaders": loaders, "optimizers": optimizers, "scalers": scalers})

    def add(self, objects: tuple[Any, ...]) -> None:
        """attach() again with more objects: measure those too."""
        if self.enabled and objects:
            self.recorder.add(sort_objects(objects))

    def note_framework(self, info: dict[str, Any]) -> None:
        """The training framework's own settings (Lightning, Transformers), for the run log
        and the configuration the rules and reports read."""
        if self.enabled:
            with self.state.lock:
                self.recorder.note_framework(info)

    def begin_step(self) -> None:
        """Mark the start of a training step (used by @tuneup.step_function)."""
        if self.enabled and self.attached:
            self.recorder.begin_step()

    def step(self) -> None:
        """Mark the end of a training step (loops without an optimizer)."""
        if self.enabled and self.attached:
            self.recorder.end_step()

    def snapshot(self) -> dict[str, Any]:
        """Everything measured so far, as plain data (measure/state.py says what; the run log
        holds the same). Never raises: a failure inside tuneup comes back as {"error": ...}
        with one warning."""
        if not self.enabled:
            return {"enabled": False, "reason": self.inert_reason, "run": self.run_info}
        return self.state.snapshot(refresh_config=not self.attached)

    def findings(self) -> list[dict[str, Any]]:
        """The current findings, ranked by estimated gain (the rules run every few seconds
        on the background thread; after detach, on the whole run)."""
        return self.state.findings()

    def actions(self) -> list[dict[str, Any]]:
        """Apply mode's changes, one record each: what changed (before/after settings), the
        baseline and trial windows' numbers, the decision and why. Empty in advise mode."""
        return self.state.actions()

    def probe_states(self) -> dict[str, str]:
        """Each probe: "on", "off" (turned off after an error; see warnings) or why it is idle."""
        return self.state.probe_states()

    def revert_all(self) -> int:
        """Undo every change apply mode made (newest first) and make no more; returns how many
        were undone. DataLoader settings switch back at the loop's next batch. Never raises."""
        try:
            return self.experimenter.revert_all() if self.enabled and self.experimenter is not None else 0
        except Exception as exc:
            self.state.warn("apply", f"revert_all could not finish: {type(exc).__name__}: {exc}")
            return 0

    def document(self) -> dict[str, Any]:
        """The report document (what every report format renders) of this run so far."""
        from .report.document import build

        if self.enabled and self.attached:
            # The steps closed so far into the history first, as snapshot() takes them: a report
            # asked for while attached covered only what the background thread had drained (a
            # short loop on a busy machine: no step at all, "no optimizer.step() seen").
            self.snapshot()
        with self.state.lock:
            return build([self.state.history], source=self.state.run_log or "memory",
                         silence=self.options.silence, window_steps=self.options.window_steps)

    def report(self, format: str = "text") -> str:
        """The advice report (text, markdown, json or html), as `tuneup report` prints it."""
        from .report.render import render_document

        return render_document(self.document(), format)

    def detach(self) -> None:
        """Stop measuring and put every patched object back exactly as it was. Never raises
        (it runs in `with` blocks and at exit, where it must not mask the job's own error)."""
        if not self.attached:
            return
        self.state.attached = False
        try:
            self._detach()
        except Exception as exc:
            self.state.warn("detach", f"detach could not finish cleanly: {type(exc).__name__}: {exc}")
        finally:
            if self._on_detach is not None:
                self._on_detach(self)

    def forked(self) -> None:
        """In a forked child (DataLoader worker): go quiet, touch nothing shared; the inherited
        event and lock may have been held at the fork, so they are replaced."""
        self.state.forked()
        if self.enabled:
            self.ticker.forked()
            self.outputs.forked()
            self.recorder.forked()
            if self.experimenter is not None:
                self.experimenter.on = False

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        if not self.enabled:
            return f"<tuneup.Agent inert: {self.inert_reason}>"
        state = "attached" if self.attached else "detached"
        return f"<tuneup.Agent {state} mode={self.options.mode} steps={self.recorder.timeline.ring.count}>"

    # --- wiring --------------------------------------------------------------------------

    def _probe_failed(self, name: str, exc: BaseException) -> None:
        self.recorder.probe_failed(name)
        if self.experimenter is not None and name in GUARDING_PROBES:
            self.experimenter.on = False
            self.experimenter.revert_all(f"the {name} probe failed", wait=0)
        self.state.warn(name, f"{name} probe turned off after an internal error: {type(exc).__name__}: {exc}")

    def _quiet(self) -> None:
        """Quiet every probe and undo every patch (detach, or a start that failed)."""
        self.recorder.quiet()
        self._patches.undo_all()

    def _at_exit(self) -> None:
        interrupted = interrupted_at_exit()
        try:
            self.detach()
        finally:
            if interrupted:
                keep_the_interrupted_exit()

    def _detach(self) -> None:
        atexit.unregister(self._at_exit)
        if os.getpid() != self._pid:
            return  # a forked child: the parent owns the log and the patches
        self.ticker.stop()
        self.recorder.flush()
        if self.experimenter is not None:  # before the probes go: the changes patch what they patched
            # The configuration read with the kept changes in effect (a trial cut short undone
            # first), for the final report: what the run ran with, not the job's own put back.
            self.experimenter.revert_all("detach", kept_reached=self.recorder.settle_config)
            self.experimenter.close()
            self.experimenter.on = False
        self._quiet()
        self.ticker.last(lambda: self.recorder.end_event(self.state.warnings), self._close)

    def _close(self) -> None:
        self.recorder.close()
        self.outputs.stop()


def _print_ranks(*args: Any) -> None:
    from .report.ranks import print_rank_summary  # imported at the run's end, not inside attach()

    print_rank_summary(*args)
