"""The run log: one JSON event per line in the run directory, flushed per line.

Bounded in size: when the live file passes half the budget it becomes `<name>.1` (the
previous `.1` is dropped) and a fresh file starts with the run header again, so the log
never holds more than `max_bytes` and always holds the newest data. A crash leaves at most
a torn last line, which the reader ignores.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .. import records

LOG_NAME = "events.jsonl"


def log_name(rank: int | None) -> str:
    return LOG_NAME if rank is None else f"events-rank{rank}.jsonl"


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as strings, everything else as is
    (`restore_nonfinite` reads them back)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def restore_nonfinite(value: Any) -> Any:
    """The inverse of json_safe: "nan", "inf" and "-inf" strings become floats again."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: restore_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_nonfinite(v) for v in value]
    return value


def _encode(event: dict[str, Any]) -> bytes:
    return (json.dumps(json_safe(event), separators=(",", ":"), default=str) + "\n").encode("utf-8")


class RunLog:
    """Single writer (the agent's background thread, then detach). The run directory is made
    0700 and the log 0600 (the job's command line and figures are its owner's business on a
    machine several users share); `shared` makes them 0750/0640 for a group that analyses runs
    together (the `log_shared` option). The umask may narrow these further, never widen them."""

    def __init__(self, path: Path, max_bytes: int, header: dict[str, Any], shared: bool = False) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.header = header
        self.modes = (0o750, 0o640) if shared else (0o700, 0o600)  # (directory, file)
        self.error: str | None = None
        self._file: Any = None
        self._size = 0

    def _open_file(self) -> Any:
        return os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, self.modes[1]), "ab")

    def open(self) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=self.modes[0])
            self._file = self._open_file()
            self._size = self._file.tell()
        except OSError as exc:
            self._failed(exc)
            return False
        return self.write(self.header)

    def write(self, event: dict[str, Any]) -> bool:
        if self._file is None:
            return False
        line = _encode(event)
        try:
            if self._size + len(line) > self.max_bytes // 2 and self._size > 0:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self._size += len(line)
        except OSError as exc:
            self._failed(exc)
            return False
        return True

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = self._open_file()
        line = _encode(dict(self.header, continued=True))
        self._file.write(line)
        self._size = len(line)

    def _failed(self, exc: OSError) -> None:
        """What went wrong, as the end of "cannot write ...": the path first, then why."""
        where = exc.filename or self.path
        if isinstance(exc, (FileExistsError, NotADirectoryError)):  # the run directory (or a parent) is a file
            self.error = (f"{where}: it or a folder above it is a file, not a directory (TUNEUP_RUN_DIR / run_dir "
                          "names the directory to log to)")
        else:
            self.error = f"{where}: {exc.strerror or exc}"
        self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


# --- reading ---------------------------------------------------------------------------


class RunLogError(Exception):
    """A run log that cannot be read; the message is one line, ready for the user."""


@dataclass
class RunRecord:
    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0  # corrupt lines in the middle (a torn last line is not counted)
    skipped_examples: list[str] = field(default_factory=list)  # the first few, named
    torn_tail: bool = False

    def skip(self, segment: Path, index: int, why: str) -> None:
        self.skipped_lines += 1
        if len(self.skipped_examples) < 3:
            self.skipped_examples.append(f"{segment.name} line {index + 1}: {why}")

    def notes(self) -> list[str]:
        """One line each for what the report leaves out of this log: the lines skipped (the
        first few named) and a header from a newer tuneup."""
        return records.notes("line(s)", str(self.path), self.skipped_lines, self.skipped_examples, self.events)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event.get("event") == kind]

    def last(self, kind: str) -> dict[str, Any] | None:
        for event in reversed(self.events):
            if event.get("event") == kind:
                return event
        return None


MAX_LINE = 16 * 1024 * 1024  # an event is a few KB; a longer line is not one of ours


def _lines(path: Path) -> Iterator[tuple[str | None, bool]]:
    """(line, complete) for each line, streamed: complete is False for a last line with no
    newline; a line over MAX_LINE is skipped unread past its first MAX_LINE bytes (None)."""
    with open(path, "rb") as handle:
        while True:
            line = handle.readline(MAX_LINE + 1)
            if not line:
                return
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):
                    line = handle.readline(MAX_LINE)
                yield None, True
                continue
            yield line.decode("utf-8", errors="replace"), line.endswith(b"\n")


def _regular(path: Path) -> Path:
    """`path`, if it is a regular file: a FIFO or a device named like a log would block the
    reader or never end."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise RunLogError(f"{path} is not a regular file (a FIFO or a device?): a run log is a file tuneup wrote")
    return path


def log_files(target: Path) -> list[Path]:
    """The live log files of a run directory (or the file itself)."""
    try:
        return _log_files(target)
    except OSError as exc:  # a name too long, a parent this user may not search
        raise RunLogError(f"cannot read {target}: {exc.strerror or exc}") from None


def _log_files(target: Path) -> list[Path]:
    if target.exists() and not target.is_dir():
        return [_regular(target)]
    if not target.exists():
        raise RunLogError(f"no run directory or log at {target}: pass the run directory tuneup printed")
    if not os.access(target, os.R_OK | os.X_OK):
        raise RunLogError(f"cannot read {target}: permission denied (run tuneup report as the job's user)")
    files = sorted(target.glob("events*.jsonl"))
    if not files:
        raise RunLogError(f"{target} holds no tuneup run log (events*.jsonl): is it a tuneup run directory?")
    return [_regular(path) for path in files]


def read_log(path: Path) -> RunRecord:
    """Read one log file, with its rotated predecessor, keeping only the newest run in it."""
    record = RunRecord(path=path)
    unfit = 0  # JSON objects that are not tuneup events of their kind
    try:
        segments = [_regular(p) for p in (path.with_name(path.name + ".1"), path) if p.exists()]
        for segment in segments:
            pending = list(_lines(segment))  # lines of at most MAX_LINE bytes each
            for number, (line, complete) in enumerate(pending):
                if line is None:
                    record.skip(segment, number, f"over {MAX_LINE} bytes")
                    continue
                text = line.strip()
                if not text:
                    continue
                try:
                    event = json.loads(text)
                    if not isinstance(event, dict):
                        raise ValueError("not an object")
                except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
                    if number == len(pending) - 1 and not complete:
                        record.torn_tail = True
                    else:
                        record.skip(segment, number, "nested too deep" if isinstance(exc, RecursionError)
                                    else "not a JSON object")
                    continue
                event = restore_nonfinite(event)
                wrong = records.problem(event)
                if wrong:
                    record.skip(segment, number, wrong)
                    unfit += 1
                    continue
                record.events.append(event)
    except OSError as exc:
        raise RunLogError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not record.events and unfit:
        raise RunLogError(f"{path} is not a tuneup run log: it has no run header ({record.skipped_examples[0]})")
    if not record.events:
        raise RunLogError(f"{path} holds no readable tuneup events (empty or corrupt)")
    # A log appended to by several runs: keep the newest (a rotated file repeats its header).
    starts = [i for i, e in enumerate(record.events) if e.get("event") == "run" and not e.get("continued")]
    if starts and starts[-1] > 0:
        record.events = record.events[starts[-1] :]
    if record.events[0].get("event") != "run":
        if not any(e.get("event") == "run" for e in record.events):
            raise RunLogError(f"{path} is not a tuneup run log: it has no run header")
    return record
