"""`tuneup watch`: a live terminal view of a running job, refreshed from its endpoint."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ..export import registry
from ..measure.history import RunHistory
from . import summary
from .document import build
from .sources import ReportSourceError, fetch_run
from .text import findings_group


def choose_agent() -> str:
    """The URL of the one live agent on this machine; a clear error otherwise."""
    agents = [entry for entry in registry.live_agents() if entry.get("url")]
    if not agents:
        raise ReportSourceError(
            "no tuneup agent is running on this machine: start a job with tuneup (e.g. `tuneup demo`) "
            "or pass the agent's URL")
    if len(agents) > 1:
        listed = "; ".join(f"{a['url']} (pid {a['pid']}: {' '.join(a.get('argv') or [])[:40]})" for a in agents)
        raise ReportSourceError(f"{len(agents)} tuneup agents are running; pass one URL: {listed}")
    return agents[0]["url"]


def frame(url: str) -> tuple[Group, bool]:
    """One screen of the view, and whether the job is still attached."""
    payload = fetch_run(url)
    history = RunHistory.of(payload["events"], source=url)
    document = build([history], source=url)
    snapshot = document["runs"][0]["snapshot"]
    state = "live" if payload.get("attached") else "detached"
    head = Text(f"tuneup watch {url}  ({state}, {time.strftime('%H:%M:%S')})", style="bold")
    changes = [summary.changes_group(snapshot["actions"])] if snapshot.get("actions") else []
    return Group(head, findings_group(document), *changes, summary.render(snapshot)), bool(payload.get("attached"))


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
