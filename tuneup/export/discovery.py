"""Where the live agents on this machine announce themselves (for `tuneup watch` without a
URL, `tuneup report` on a live job, and the node daemon).

One small JSON file per agent process in a per-user directory (TUNEUP_REGISTRY_DIR to
share one node-wide, as the node daemon's deployments do). An entry whose process has exited
is ignored (and removed) by readers, so a job killed with SIGKILL leaves no ghost. A reader in
another PID namespace (a container beside the job's) cannot see the process: there the
entry's heartbeat decides, which the agent refreshes every HEARTBEAT seconds.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import records

HEARTBEAT = 10.0  # seconds between the agent's refreshes of its entry
STALE = 3 * HEARTBEAT  # an entry from another PID namespace not refreshed for this long is dead


def pid_namespace() -> str | None:
    """This process's PID namespace (Linux), so readers know whether its pid means anything to them."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def directory() -> Path:
    configured = os.environ.get("TUNEUP_REGISTRY_DIR")
    if configured:
        return Path(configured)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "tuneup" if runtime else Path(tempfile.gettempdir()) / f"tuneup-{os.getuid()}"
    return base / "agents"


def announce(entry: dict[str, Any]) -> Path | None:
    """Write this process's entry; returns its path, or None when the directory is not
    writable (the agent then simply is not discoverable). Named by pid and run id: pids of
    processes in different containers sharing the directory can be equal."""
    folder = directory()
    path = folder / f"{os.getpid()}-{entry.get('run_id', 'run')}.json"
    entry = dict(entry, pid_namespace=pid_namespace())
    try:
        try:
            folder.mkdir(parents=True, mode=0o700)
        except FileExistsError:
            pass
        else:
            if os.environ.get("TUNEUP_REGISTRY_DIR"):
                # A shared node-wide directory (the daemon's deployments create it so already):
                # every user's jobs announce themselves there; the sticky bit keeps entries theirs.
                os.chmod(folder, 0o1777)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entry, default=str))
        os.replace(temporary, path)
    except OSError:
        return None
    return path


def heartbeat(path: Path | None) -> None:
    """Refresh the entry's modification time (readers in other PID namespaces go by it)."""
    if path is not None:
        try:
            os.utime(path)
        except OSError:
            pass


def withdraw(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def _alive(pid: int, started: float | None) -> bool:
    import psutil  # here, not at import: attach() never needs it

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # A reused pid belongs to a process started after the entry was written.
        return started is None or process.create_time() <= started + 1
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


MAX_ENTRY_BYTES = 64 * 1024  # an entry is a few hundred bytes


def _read_entry(path: Path) -> tuple[dict[str, Any], float] | None:
    """The entry at `path` and its modification time, or None when it is not
    an agent's entry: not a regular file (a FIFO would block the reader), too large, not JSON,
    or not of the entry's schema (the folder may be shared by every user on the node)."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_ENTRY_BYTES:
            return None
        with open(path, "rb") as handle:
            entry = json.loads(handle.read(MAX_ENTRY_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    if records.REGISTRY_ENTRY.problem(entry, "entry"):
        return None
    return entry, info.st_mtime


def folder_problem(folder: Path) -> str | None:
    """Why `folder` cannot serve as the registry (a path too long, a parent this user may not
    search, a file), or None: it is a directory, or does not exist yet (agents create it)."""
    try:
        if folder.is_dir() or not folder.exists():
            return None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    return "is not a directory"


def live_agents(folder: Path | None = None) -> list[dict[str, Any]]:
    """Entries of the agents still running, oldest first (none where the folder cannot be read:
    folder_problem says why)."""
    entries = []
    folder = directory() if folder is None else folder
    namespace = pid_namespace()
    try:
        paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
    except OSError:
        paths = []
    for path in paths:
        found = _read_entry(path)
        if found is None:
            continue
        entry, modified = found
        pid = int(entry["pid"])
        theirs = entry.get("pid_namespace")
        if theirs is None or theirs == namespace:
            alive = _alive(pid, entry.get("started_at"))
        else:
            alive = time.time() - modified < STALE
        if alive:
            entries.append(entry)
        else:
            withdraw(path)
    return sorted(entries, key=lambda entry: entry.get("started_at") or 0)
