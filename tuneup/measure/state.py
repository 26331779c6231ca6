"""The public read model: one object holding what is known of the run so far, read by
everything that shows it: `Agent.snapshot()`, the Prometheus collector (export/metrics.py),
the loopback endpoint's `/api/run`, and the reports (through `history`).

    run_info      who the job is (run id, argv, rank, versions, mode)
    history       the run's events (RunHistory): what rules and reports read
    recorder      the live numbers: running totals, the latest system sample, configuration
    evaluation    the latest findings (diagnose/live.py writes it)
    experimenter  apply mode's records (act/experimenter.py), or None
    warnings      every warning tuneup gave (one per key), and the probes turned off

`snapshot()` is the one definition of "the snapshot": the history's (the same shape a run
log gives `tuneup report`, GPU history included, so `evaluate(agent.snapshot())` checks every
rule) with the live values over it: the exact last `window_steps` steps from the ring, the
running totals, each probe's state, apply mode's records.

`lock` guards the history and the recorder's drains: the background thread holds it for a
tick, readers for a read.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Mapping

import torch

from .._version import __version__
from .. import redact
from .._warning import warn
from .history import RunHistory
from .utilization import utilization

MAX_WARNINGS = 50
LOCK_TIMEOUT = 5.0  # a reader never waits longer on a background thread stuck in a driver call


def env_rank(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def training_job(run_id: str, environ: Mapping[str, str] = os.environ) -> str:
    """What every rank of one distributed job shares, across its nodes: torchrun's rendezvous
    (its run id and the master's address, the same on every node), else the address a
    plain init_process_group meets at; a job of one process is its own run id. It labels
    every series (`training_job`), so Prometheus' rules aggregate a job's ranks, and groups
    a node's ranks in the daemon."""
    if environ.get("WORLD_SIZE") and environ.get("MASTER_PORT"):
        return ":".join(environ[name] for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
                        if environ.get(name))
    return run_id


def run_info(mode: str, job: str | None = None) -> dict[str, Any]:
    """Who this job is: what the run log's header, the endpoint and the metrics name it by.
    `job`: the training job's name where the user gave one (option training_job)."""
    run_id = uuid.uuid4().hex[:12]
    return {
        "run_id": run_id,
        # From the environment (or the option): what TUNEUP_REDACT lists is hidden here too.
        "training_job": redact.text(job or training_job(run_id), redact.listed()[1]),
        "tuneup": __version__,
        "started_at": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "rank": env_rank("RANK"),
        "local_rank": env_rank("LOCAL_RANK"),
        "world_size": env_rank("WORLD_SIZE"),
        # Attached at interpreter start-up (`tuneup run -m pkg`), sys.argv[0] is still "-m".
        # Credentials hidden here, before anything stores or serves it (redact.py).
        "argv": redact.argv(sys.orig_argv[1:] if sys.argv[:1] == ["-m"] and hasattr(sys, "orig_argv") else sys.argv),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "mode": mode,
    }


class RunState:
    """What is known of the run so far (see the module docstring)."""

    def __init__(self, info: dict[str, Any], window_steps: int) -> None:
        self.run_info = info
        self.window_steps = window_steps
        self.history = RunHistory()  # the events, in memory: what rules and reports read
        self.recorder: Any = None  # measure/recorder.py's Recorder, once built
        self.evaluation: Any = None  # diagnose's Evaluation: .findings, .to_dict()
        self.experimenter: Any = None  # act's Experimenter in apply mode: .records
        self.attached = False
        self.run_dir: str | None = None
        self.run_log: str | None = None
        self.warnings: list[dict[str, Any]] = []
        self.warned: set[str] = set()  # every key warned about: a probe among them is off
        self.lock = threading.RLock()

    @property
    def rank(self) -> int | None:
        return self.run_info["rank"]

    @property
    def local_rank(self) -> int | None:
        return self.run_info["local_rank"]

    # --- writing ----------------------------------------------------------------------

    def warn(self, key: str, message: str) -> None:
        """One warning per key, for the job's stderr and for every reader."""
        if key in self.warned:
            return
        self.warned.add(key)
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append({"probe": key, "message": message, "time": time.time()})
        warn(f"tuneup: {message}")

    def forked(self) -> None:
        """In a forked child: the lock may have been held by the sampler thread at the fork."""
        self.lock = threading.RLock()
        self.attached = False

    # --- reading ----------------------------------------------------------------------

    @property
    def totals(self) -> Any:
        return self.recorder.totals

    @property
    def system(self) -> dict[str, Any] | None:
        return self.recorder.system

    @property
    def findings_now(self) -> list[Any]:
        return list(self.evaluation.findings) if self.evaluation is not None else []

    def findings(self) -> list[dict[str, Any]]:
        return [finding.to_dict() for finding in self.findings_now]

    def actions(self) -> list[dict[str, Any]]:
        experimenter = self.experimenter
        return [dict(record) for record in list(experimenter.records)] if experimenter is not None else []

    def probe_states(self) -> dict[str, str]:
        return self.recorder.probe_states(self.warned)

    def snapshot(self, refresh_config: bool = False) -> dict[str, Any]:
        """Everything measured so far, as plain data (see the module docstring), the closed
        steps drained into the history first. Never raises: a failure inside tuneup comes
        back as {"error": ...} with one warning."""
        if not self.lock.acquire(timeout=LOCK_TIMEOUT):
            return {"enabled": True, "run": self.run_info, "error": "the background sampler is busy"}
        try:
            self.recorder.catch_up(refresh_config)
            return self._snapshot()
        except Exception as exc:
            self.warn("snapshot", f"snapshot failed: {type(exc).__name__}: {exc}")
            return {"enabled": True, "run": self.run_info, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.lock.release()

    def _snapshot(self) -> dict[str, Any]:
        recorder = self.recorder
        window = recorder.window(self.window_steps)
        out = self.history.snapshot(self.window_steps, window=window)
        out.update({
            "attached": self.attached,
            "state": "attached" if self.attached else "detached",
            "run": self.run_info,
            "run_dir": self.run_dir,
            "run_log": self.run_log,
            "totals": recorder.totals_summary(),
            "syncs": recorder.syncs.summary(),
            "scaler": recorder.scaler.summary(),
            "habits": recorder.habits_summary(),
            "compile": recorder.compile.summary(),
            "system": out["system"] or recorder.system,
            "config": recorder.config,
            "probes": self.probe_states(),
            "agent_cost": recorder.cost.summary(),
            "warnings": list(self.warnings),
            "actions": self.actions(),
        })
        out["flops"] = utilization(out["habits"].get("flops"), window)
        return out

    def payload(self) -> dict[str, Any]:
        """What /api/run answers: the run's events and the current findings."""
        if not self.lock.acquire(timeout=LOCK_TIMEOUT):
            raise RuntimeError("the background sampler is busy")
        try:
            evaluation = self.evaluation.to_dict() if self.evaluation is not None else {"findings": []}
            return {"events": self.history.events(), "findings": evaluation, "attached": self.attached}
        finally:
            self.lock.release()
