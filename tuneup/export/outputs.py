"""Where a live agent's measurements go: every event into the in-memory history and the run
log; the loopback endpoint (/metrics, /api/run); the Pushgateway; the discovery entry that
lets `tuneup watch`, `tuneup report` and the node daemon find the job.

Each output that fails is one warning and the job goes on; the others are unaffected.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from .. import records, redact
from ..options import Options, agent_port, default_run_dir
from . import discovery
from .runlog import RunLog, log_name
from .server import AgentServer

Warn = Callable[[str, str], None]


class Outputs:
    """The outputs of one agent; `state` is the read model (measure/state.py) they export."""

    def __init__(self, options: Options, state: Any, warn: Warn) -> None:
        self.options = options
        self.state = state
        self.warn = warn
        self.run_log: RunLog | None = None
        self.run_dir: Path | None = None
        self.server: AgentServer | None = None
        self.pusher: Any = None  # push.Pusher
        self._announced: Path | None = None
        self._next_heartbeat = 0.0
        self._warnings_logged = 0
        self._metrics: Any = None

    @property
    def metrics(self) -> Any:
        """The Prometheus registry (export/metrics.py), built at the first scrape or push:
        prometheus-client is not imported inside attach() when nobody asks."""
        if self._metrics is None:
            from .metrics import agent_registry

            self._metrics = agent_registry(self.state, self.state.experimenter, self.warn)
        return self._metrics

    def start(self) -> None:
        """Serve, push, open the run log (its header is the history's first event), announce."""
        self._serve()
        if self.options.push_gateway:
            from .push import Pusher

            self.pusher = Pusher(self.options.push_gateway, self.options.push_job, self.metrics, self.state.rank,
                                 self.options.push_interval, self.warn)
            self.pusher.start()
        self._open_run_log()
        self._announce()

    def _serve(self) -> None:
        """Start the loopback endpoint (a failure is one warning: the job goes on)."""
        options = self.options
        if not options.serve:
            return
        port = agent_port(options, self.state.local_rank)
        # Scrapes closer together than the sampling interval would read the same totals: they
        # get the same rendering (at most 1 s old, so the process metrics stay current).
        server = AgentServer(self.state.payload, lambda: self.metrics, fresh_for=min(options.interval, 1.0))
        try:
            note = server.start(options.host, port)
        except Exception as exc:
            self.warn("http", f"no HTTP endpoint: cannot listen on {options.host}:{port} ({exc}); "
                              "measuring continues (set TUNEUP_PORT or TUNEUP_SERVE=0)")
            return
        if note:
            self.warn("http_port", note)
        self.server = server
        self.state.run_info["url"] = server.url

    def _open_run_log(self) -> None:
        options, state = self.options, self.state
        self.run_dir = (options.run_dir or default_run_dir(state.rank)) if options.log else None
        state.run_dir = str(self.run_dir) if self.run_dir else None
        header = dict(state.run_info, event="run", schema=records.VERSION, time=time.time(),
                      options=options_dict(options), run_dir=state.run_dir)
        state.history.add(header)
        if not options.log:
            return
        log = RunLog(self.run_dir / log_name(state.rank), options.log_max_bytes, header, shared=options.log_shared)
        if log.open():
            self.run_log = log
            state.run_log = state.history.source = str(log.path)
        else:
            self._run_log_failed(log)

    def _announce(self) -> None:
        if self.server is None:
            return
        info = self.state.run_info
        self._announced = discovery.announce({
            "pid": info["pid"], "url": self.server.url, "run_id": info["run_id"], "run_dir": self.state.run_dir,
            "rank": info["rank"], "local_rank": info["local_rank"], "argv": info["argv"],
            "started_at": info["started_at"], "host": info["host"], "group": info["training_job"],
            "mode": self.options.mode,
        })
        if self._announced is None:
            self.warn("registry", f"cannot announce this job in {discovery.directory()} (not writable): "
                                  "the node daemon and `tuneup watch` without a URL won't find it; "
                                  f"measuring and {self.server.url} go on (set TUNEUP_REGISTRY_DIR)")

    # --- while running -------------------------------------------------------------------

    def emit(self, event: dict[str, Any]) -> None:
        """One event into the history and the run log."""
        self.state.history.add(event)
        log = self.run_log
        if log is not None and not log.write(event) and log.error is not None:  # (closed at detach: the history has it)
            self.run_log = None
            self._run_log_failed(log)

    def _run_log_failed(self, log: RunLog) -> None:
        self.warn("run_log", f"run log turned off: cannot write {log.error}; measuring continues in memory")

    def tick(self) -> None:
        """Each background tick: new warnings into the run log, the discovery heartbeat."""
        warnings = self.state.warnings
        while self._warnings_logged < len(warnings):
            self.emit(dict(warnings[self._warnings_logged], event="warning"))
            self._warnings_logged += 1
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + discovery.HEARTBEAT
            discovery.heartbeat(self._announced)

    # --- ending ---------------------------------------------------------------------------

    def cancel(self) -> None:
        """A start that failed: nothing stays behind."""
        if self.pusher is not None:
            self.pusher.cancel()
        if self.run_log is not None:
            self.run_log.close()
        if self.server is not None:
            self.server.stop()
        discovery.withdraw(self._announced)

    def stop(self) -> None:
        if self.run_log is not None:
            self.run_log.close()
        discovery.withdraw(self._announced)
        if self.server is not None:
            self.server.stop()
        if self.pusher is not None:
            self.pusher.stop()  # the final values, after the last drain

    def forked(self) -> None:
        """In a forked child: touch nothing shared (the parent owns the log, port and entry)."""
        if self.server is not None:
            self.server.forget_in_child()
            self.server = None
        self.pusher = None  # its thread stayed in the parent
        self._announced = None
        self.run_log = None


def options_dict(options: Options) -> dict[str, Any]:
    """The options as the run log records them: URLs' credentials hidden (redact.py)."""
    _, literals = redact.listed()
    return {name: redact.text(str(value), literals) if isinstance(value, (str, Path)) else value
            for name, value in vars(options).items()}
