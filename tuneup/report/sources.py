"""Where a report's runs come from: a run directory or log file, or a live agent's URL.
Every failure is a `ReportSourceError` whose message is one line naming the problem and
the fix."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..export.runlog import RunLogError, log_files, read_log, restore_nonfinite
from ..measure.history import RunHistory

TIMEOUT = 5.0


class ReportSourceError(Exception):
    """A run directory, log or URL that cannot be read; the message is one line."""


def is_url(target: str) -> bool:
    return urlparse(target).scheme in ("http", "https")


def load(target: str) -> tuple[list[RunHistory], str]:
    """The runs at `target` (one per rank) and a description of where they came from."""
    if is_url(target):
        return [RunHistory.of(fetch_run(target)["events"], source=target)], target
    try:
        files = log_files(Path(target))
        histories = []
        for path in files:
            record = read_log(path)
            histories.append(RunHistory.of(record.events, source=str(path)))
    except RunLogError as exc:
        raise ReportSourceError(str(exc)) from None
    histories.sort(key=lambda h: ((h.run or {}).get("rank") is None, (h.run or {}).get("rank") or 0))
    return histories, target


def fetch_run(url: str) -> dict[str, Any]:
    """GET <url>/api/run from a live agent."""
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/api/run"):
        endpoint += "/api/run"
    try:
        with urllib.request.urlopen(endpoint, timeout=TIMEOUT) as response:
            payload = restore_nonfinite(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        raise ReportSourceError(f"{endpoint} answered HTTP {exc.code}: is this a tuneup agent's URL?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ReportSourceError(
            f"nothing answered at {url} ({reason}): is the job running? `tuneup watch` with no URL "
            "lists the agents on this machine") from None
    except ValueError:
        raise ReportSourceError(f"{endpoint} did not answer JSON: is this a tuneup agent's URL?") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("events"), list):
        raise ReportSourceError(f"{endpoint} did not answer a tuneup run: is this a tuneup agent's URL?")
    return payload
