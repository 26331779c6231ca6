"""`tuneup watch`: a live terminal view of a running job, refreshed from its endpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .. import records
from ..export import discovery
from ..format import percent, seconds
from . import summary
from .document import build
from .sources import ReportSourceError, answering, checked, daemon_base, fetch_run
from .text import findings_group


def choose_agent() -> str:
    """The URL of the one live agent on this machine; a clear error otherwise."""
    folder = discovery.directory()
    problem = discovery.folder_problem(folder)
    if problem:
        raise ReportSourceError(f"the agents' registry {folder} (TUNEUP_REGISTRY_DIR) {problem}: unset it, or "
                                "give the directory the jobs announce themselves in, or pass the agent's URL")
    agents = [entry for entry in discovery.live_agents(folder) if entry.get("url")]
    if not agents:
        raise ReportSourceError(
            "no tuneup agent is running on this machine: start a job with tuneup (e.g. `tuneup demo`) "
            "or pass the agent's URL")
    if len(agents) > 1:
        listed = "; ".join(f"{a['url']} (pid {a['pid']}: {' '.join(a.get('argv') or [])[:40]})" for a in agents)
        raise ReportSourceError(f"{len(agents)} tuneup agents are running; pass one URL: {listed}")
    return agents[0]["url"]


def frame(url: str) -> tuple[Group, bool]:
    """One screen of the view, and whether to keep refreshing (the job is still attached; for
    a node daemon, always)."""
    payload = fetch_run(url)
    if payload.get("daemon"):
        return node_frame(url, payload), True
    return job_frame(url, payload), bool(payload.get("attached"))


def job_frame(url: str, payload: dict[str, Any]) -> Group:
    document = build([checked(payload["events"], url)], source=url)
    snapshot = document["runs"][0]["snapshot"]
    state = "live" if payload.get("attached") else "detached"
    head = Text(f"tuneup watch {url}  ({state}, {time.strftime('%H:%M:%S')})", style="bold")
    notes = [Text(f"note: {note}", style="yellow") for note in document.get("notes", ())]  # events left out
    changes = [summary.changes_group(snapshot["actions"])] if snapshot.get("actions") else []
    return Group(head, *notes, findings_group(document), *changes, summary.render(snapshot))


def node_frame(url: str, payload: dict[str, Any]) -> Group:
    """A node daemon: its only job in full, or one line per job."""
    base = daemon_base(url)
    jobs = payload["jobs"]
    answered = answering(payload)
    if len(jobs) == 1 and answered:
        return job_frame(base + answered[0]["path"], answered[0]["payload"])
    head = Text(f"tuneup watch {base}  (node daemon on {payload.get('host')}: {len(jobs)} jobs, "
                f"{time.strftime('%H:%M:%S')})", style="bold")
    table = Table(show_edge=False, pad_edge=False)
    for column in ("job", "run id", "pid", "rank", "steps/s", "step (median)", "data stall", "top finding"):
        table.add_column(column, justify="right" if column in ("pid", "rank", "steps/s", "step (median)",
                                                                "data stall") else "left")
    for job in jobs:
        agent = job.get("agent") or {}
        argv = [str(part) for part in agent.get("argv") or []]
        script = " ".join([Path(argv[0]).name] + argv[1:])[:32] if argv else _cell(job.get("run_id"))
        rank = _cell(agent.get("rank"), "")
        run_id, pid = _cell(job.get("run_id")), _cell(agent.get("pid"))
        if job not in answered:
            why = job.get("error") or records.AGENT_RUN.problem(job.get("payload"), "payload")
            table.add_row(script, run_id, pid, rank, "–", "–", "–", Text(f"not answering: {why}", style="yellow"))
            continue
        history = checked(job["payload"]["events"], base + job["path"])
        window = history.window(1000) or {}
        findings = (job["payload"].get("findings") or {}).get("findings") or []
        top = findings[0]["rule"] if findings else "none"
        rate = window.get("steps_per_second")
        step = (window.get("step_seconds") or {}).get("median")
        table.add_row(script, run_id, pid, rank, "–" if rate is None else f"{rate:,.1f}",
                      seconds(step), percent(window.get("stall_ratio")), top)
    hint = Text(f"one job in full: tuneup watch {base}/jobs/<run_id>   every job's advice: tuneup report {base}",
                style="dim")
    return Group(head, table, hint)


def _cell(value: Any, missing: str = "–") -> str:
    """A table cell for a value a daemon's job entry may lack."""
    return missing if value is None else str(value)


def watch(url: str | None, console: Console, *, interval: float = 2.0, once: bool = False) -> None:
    url = url or choose_agent()
    view, attached = frame(url)
    if once:
        console.print(view)
        return
    with Live(view, console=console, refresh_per_second=4, screen=False) as live:
        try:
            while attached:
                time.sleep(interval)
                try:
                    view, attached = frame(url)
                except ReportSourceError:
                    live.update(Group(view, Text("the job has ended (its endpoint is gone)", style="yellow")))
                    return
                live.update(view)
        except KeyboardInterrupt:
            return
