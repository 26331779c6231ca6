"""Where a report's runs come from: a run directory or log file, or a live agent's URL.
Every failure is a `ReportSourceError` whose message is one line naming the problem and
the fix."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil

from .. import records
from ..export.runlog import RunLogError, log_files, read_log, restore_nonfinite
from ..fetch import FetchError, get
from ..measure.history import RunHistory

TIMEOUT = 5.0


class ReportSourceError(Exception):
    """A run directory, log or URL that cannot be read; the message is one line."""


def is_url(target: str) -> bool:
    """Whether `target` is an agent's or a daemon's URL (http or https); one that names either
    scheme but does not parse (`http://[::1`) is refused by name."""
    try:
        scheme = urlparse(target).scheme
        if "://" in target and scheme not in ("http", "https"):
            raise ReportSourceError(f"{target} is a {scheme or 'scheme-less'} URL: tuneup reads a run directory, a run "
                                    "log, or an agent's or daemon's http(s) URL")
        return scheme in ("http", "https")
    except ValueError as exc:
        raise ReportSourceError(f"{target} is not a URL tuneup can read ({exc}): give the one the job printed, "
                                "e.g. http://127.0.0.1:9477/") from None


JobRuns = tuple[list[RunHistory], str]  # a job's runs (one per rank) and where they came from


def load_jobs(target: str) -> list[JobRuns]:
    """The jobs at `target`: one for a run directory, a log or an agent's URL; every running
    job of the node for a node daemon's URL (the ranks of a torchrun job together)."""
    if not is_url(target):
        return [load(target)]
    payload = fetch_run(target)
    if not payload.get("daemon"):
        return [([checked(payload["events"], target)], target)]
    base = daemon_base(target)
    groups: dict[str, list[dict[str, Any]]] = {}
    for job in answering(payload):
        groups.setdefault(str(job.get("group")), []).append(job)
    if not groups:
        raise ReportSourceError(f"the node daemon at {base} sees no running tuneup job that answers "
                                f"({len(payload['jobs'])} registered): start one, or check TUNEUP_REGISTRY_DIR")
    jobs = []
    for members in groups.values():
        histories = [checked(m["payload"]["events"], base + m["path"]) for m in members]
        histories.sort(key=_rank_order)
        jobs.append((histories, ", ".join(base + m["path"] for m in members)))
    return jobs


def load_merged(targets: list[str]) -> list[JobRuns]:
    """One job from several targets: the run directories (or logs, or agents) of one job's
    nodes, merged into one job's ranks. A single target: its jobs (load_jobs)."""
    if len(targets) == 1:
        return load_jobs(targets[0])
    seen_targets: set[str] = set()
    for target in targets:
        key = target.rstrip("/") if is_url(target) else str(Path(target).resolve())
        if key in seen_targets:
            raise ReportSourceError(f"{target} is given twice: give each node's run directory once")
        seen_targets.add(key)
    histories: list[RunHistory] = []
    seen: dict[Any, str] = {}
    for target in targets:
        jobs = load_jobs(target)
        if len(jobs) != 1:
            raise ReportSourceError(f"{target} holds {len(jobs)} jobs: merge one job's run directories, one per node "
                                    "(or report that target alone)")
        for history in jobs[0][0]:
            rank = (history.run or {}).get("rank")
            if rank is not None and rank in seen:
                raise ReportSourceError(f"rank {rank} is in both {seen[rank]} and {target}: these are not one job's "
                                        "nodes (give each node's run directory once)")
            seen[rank] = target
            histories.append(history)
    histories.sort(key=_rank_order)
    return [(histories, " + ".join(targets))]


def daemon_base(url: str) -> str:
    """A node daemon's URL without the /api/run a user may have given."""
    return url.rstrip("/").removesuffix("/api/run")


def answering(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The jobs of a node daemon's /api/run whose agents answered with their run."""
    return [job for job in payload["jobs"] if records.AGENT_RUN.problem(job.get("payload"), "payload") is None]


def checked(events: list[Any], source: str) -> RunHistory:
    """A run from a live agent's events, each checked against its kind's schema (records.py):
    one that does not fit is left out and named in the report's notes."""
    kept, skipped = [], []
    for index, event in enumerate(events):
        wrong = records.problem(event)
        if wrong:
            skipped.append(f"event {index + 1}: {wrong}")
        else:
            kept.append(event)
    notes = records.notes("event(s)", source, len(skipped), skipped[:3], kept)
    if not any(event.get("event") == "run" for event in kept):
        raise ReportSourceError(f"{source} answered no run header among {len(events)} events"
                                + (f" ({notes[0]})" if notes else "") + ": is this a tuneup agent's URL?")
    return RunHistory.of(kept, source=source, notes=notes)


def _rank_order(history: RunHistory) -> tuple[bool, int]:
    rank = (history.run or {}).get("rank")
    return rank is None, rank or 0


def load(target: str) -> tuple[list[RunHistory], str]:
    """The runs in a run directory or log file (one per rank), and where they came from."""
    try:
        files = log_files(Path(target))
        histories = []
        for path in files:
            record = read_log(path)  # what it skips is said in the report's notes
            history = RunHistory.of(record.events, source=str(path), notes=record.notes())
            unfinished = _unfinished(history)
            if unfinished:
                history.notes.append(unfinished)
            histories.append(history)
    except RunLogError as exc:
        raise ReportSourceError(str(exc)) from None
    histories.sort(key=_rank_order)
    return histories, target


def _unfinished(history: RunHistory) -> str | None:
    """Why a run log has no end record (the agent writes one at detach): its job runs on, or
    stopped without detaching (killed, out of memory, the interpreter crashed); None: it ended."""
    run = history.run
    if history.end is not None or run is None:
        return None
    rank = f"rank {run['rank']}: " if run.get("rank") is not None else ""
    pid, started = run.get("pid"), run.get("started_at")
    if run.get("host") == socket.gethostname() and isinstance(pid, int) and isinstance(started, (int, float)):
        try:
            alive = psutil.Process(pid).create_time() <= started + 1  # (a later process given the pid: not it)
        except (psutil.Error, OSError, ValueError):
            alive = False
        if alive:
            live = f", or its URL, {run['url']}," if run.get("url") else ""
            return (f"{rank}the job is still running (pid {pid}): this is its log so far; tuneup report again"
                    f"{live} reads on")
        return (f"{rank}the run log ends without the agent's detach: the job stopped without it (killed, out of "
                "memory, or a crash of the interpreter); the figures end at its last interval")
    return (f"{rank}the run log ends without the agent's detach: the job still runs on {run.get('host')}, or "
            "stopped without detaching (killed, out of memory, a crash); the figures end at its last interval")


def fetch_run(url: str) -> dict[str, Any]:
    """GET <url>/api/run from a live agent (its run) or a node daemon (every job's)."""
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/api/run"):
        endpoint += "/api/run"
    try:
        body = get(endpoint, TIMEOUT)
    except FetchError as exc:
        if exc.status is not None:
            raise ReportSourceError(f"{endpoint} answered {exc.reason}: is this a tuneup agent's URL?") from None
        raise ReportSourceError(
            f"nothing answered at {url} ({exc.reason}): is the job running? `tuneup watch` with no URL "
            "lists the agents on this machine") from None
    try:
        payload = restore_nonfinite(json.loads(body))
    except (ValueError, RecursionError):
        raise ReportSourceError(f"{endpoint} did not answer JSON: is this a tuneup agent's URL?") from None
    if isinstance(payload, dict) and payload.get("daemon") is True:
        wrong = records.DAEMON_RUN.problem(payload, "the answer")
        if wrong:
            raise ReportSourceError(f"{endpoint} answered a node daemon's run list that does not fit ({wrong}): "
                                    "are the daemon and this tuneup the same version?")
        return payload  # a node daemon: every running job's
    wrong = records.AGENT_RUN.problem(payload, "the answer")
    if wrong:
        raise ReportSourceError(f"{endpoint} did not answer a tuneup run ({wrong}): is this a tuneup agent's URL?")
    return payload
