"""Where the live agents on this machine announce themselves (for `tuneup watch` without a
URL, `tuneup report` on a live job, and the node daemon).

One small JSON file per agent process in a per-user directory; an entry whose process has
exited is ignored (and removed) by readers, so a job killed with SIGKILL leaves no ghost.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import psutil


def directory() -> Path:
    configured = os.environ.get("TUNEUP_REGISTRY_DIR")
    if configured:
        return Path(configured)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "tuneup" if runtime else Path(tempfile.gettempdir()) / f"tuneup-{os.getuid()}"
    return base / "agents"


def announce(entry: dict[str, Any]) -> Path | None:
    """Write this process's entry; returns its path, or None when the directory is not
    writable (the agent then simply is not discoverable)."""
    folder = directory()
    path = folder / f"{os.getpid()}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entry, default=str))
        os.replace(temporary, path)
    except OSError:
        return None
    return path


def withdraw(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def _alive(pid: int, started: float | None) -> bool:
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # A reused pid belongs to a process started after the entry was written.
        return started is None or process.create_time() <= started + 1
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def live_agents() -> list[dict[str, Any]]:
    """Entries of the agents still running, oldest first."""
    entries = []
    folder = directory()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid, entry.get("started_at")):
            entries.append(entry)
        else:
            withdraw(path)
    return sorted(entries, key=lambda entry: entry.get("started_at") or 0)
