"""Records from outside the reading process — run-log lines, a live agent's /api/run, a node
daemon's job list, registry entries — are checked against their kind's schema where they
enter (tuneup/records.py): a damaged record is skipped, counted and named in one line of the
report, and nothing past the check fails on a record's content (issue 20).

The records damaged here are real: the run log of tests/programs/scaled_regression.py run
under `tuneup run --apply` (a run header, config, system samples, step intervals with the
scaler, syncs and habits sections, apply-mode decisions, the end record). Hypothesis picks a
field of one record and a wrong value for it (another type, null, a huge or non-finite or
negative number, a missing key); the report is then built and rendered in every format."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from tuneup import records
from tuneup.export import discovery
from tuneup.export.runlog import RunLogError, json_safe, read_log, restore_nonfinite
from tuneup.report.document import build
from tuneup.report.render import render_document
from tuneup.report.sources import ReportSourceError, load, load_jobs
from tuneup.report.text import render_text

from .conftest import PROGRAMS, child_env

FORMATS = ("json", "markdown", "html")


class Events(list):
    def __repr__(self) -> str:  # Hypothesis prints its arguments: the draws say what was damaged
        return f"<{len(self)} events of a real run>"


@pytest.fixture(scope="module")
def real_events(tmp_path_factory):
    """The events of a real run, as its run log holds them."""
    run_dir = tmp_path_factory.mktemp("source") / "run"
    done = subprocess.run([sys.executable, "-m", "tuneup", "run", "--apply", str(PROGRAMS / "scaled_regression.py")],
                          env=child_env(TUNEUP_RUN_DIR=str(run_dir), TUNEUP_INTERVAL="0.2",
                                        TUNEUP_CPU_BF16="0"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    events = [restore_nonfinite(json.loads(line)) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = {event["event"] for event in events}
    assert {"run", "config", "system", "steps", "action", "end"} <= kinds, kinds
    return Events(events)


def positions(events):
    """(event index, path) of every field and container of the records, one per distinct
    (kind, path) so that each field of each record kind is as likely as any other."""
    seen, out = set(), []

    def walk(index, value, path):
        shape = (events[index]["event"],) + tuple("[]" if isinstance(p, int) else p for p in path)
        if path and path != ("event",) and shape not in seen:
            seen.add(shape)
            out.append((index, path))
        if isinstance(value, dict):
            for key, item in value.items():
                walk(index, item, path + (key,))
        elif isinstance(value, list):
            for number, item in enumerate(value[:2]):
                walk(index, item, path + (number,))

    for index, event in enumerate(events):
        walk(index, event, ())
    return out


MISSING = object()
WRONG = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4), st.just(MISSING),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-1, 0, -1e-9, 1e308, 2 ** 1100, 1e-320]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def damaged(events, index, path, value):
    out = copy.deepcopy(events)
    parent = out[index]
    for part in path[:-1]:
        parent = parent[part]
    if value is MISSING:
        if isinstance(parent, list):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return out


def write_log(folder: Path, events) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "events.jsonl"
    path.write_text("".join(json.dumps(json_safe(event)) + "\n" for event in events))
    return path


def render_everything(histories, source):
    """The report in every format, as `tuneup report` builds it; the rules that failed."""
    document = build(histories, source=source)
    for format in FORMATS:
        render_document(document, format)
    render_text(document, Console(file=io.StringIO(), width=100))
    return document, {rule: error for run in document["runs"] for rule, error in run["evaluation"]["errors"].items()}


def test_the_real_records_fit_their_schemas(real_events, tmp_path):
    # No false alarm: what tuneup itself writes is never skipped.
    assert [records.problem(event) for event in real_events] == [None] * len(real_events)
    histories, source = load(str(write_log(tmp_path / "run", real_events).parent))
    document, failed = render_everything(histories, source)
    assert document["notes"] == [] and failed == {}
    assert document["runs"][0]["snapshot"]["actions"], "the apply-mode decisions are read back"


@pytest.mark.damaged_log
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_field_is_skipped_and_named_or_harmless(real_events, tmp_path, data):
    index, path = data.draw(st.sampled_from(positions(real_events)), label="field")
    value = data.draw(WRONG, label="value")
    events = damaged(real_events, index, path, value)
    wrong = records.problem(events[index])
    log = write_log(tmp_path / "run", events)
    if wrong is not None and events[index]["event"] == "run":
        with pytest.raises(RunLogError, match="it has no run header"):
            read_log(log)  # `tuneup report` says so in one line and exits 2
        return
    record = read_log(log)
    if wrong is not None:
        # Skipped, counted, and named with its line in one note.
        assert record.skipped_lines == 1
        note, = [n for n in record.notes() if "skipped" in n]
        assert f"line {index + 1}: {wrong}" in note and "\n" not in note
    else:
        assert record.skipped_lines == 0
    try:
        histories, source = load(str(log.parent))
    except ReportSourceError:
        return  # one line for the user; the CLI exits 2
    _, failed = render_everything(histories, source)
    assert failed == {}, (events[index]["event"], path, value)


@pytest.mark.damaged_log
def test_a_log_from_a_newer_tuneup_says_so(real_events, tmp_path):
    events = copy.deepcopy(real_events)
    events[0]["schema"] = records.VERSION + 1
    events[0]["future_field"] = {"anything": [1, 2]}
    histories, _ = load(str(write_log(tmp_path / "run", events).parent))
    document, failed = render_everything(histories, "x")
    assert failed == {}
    newer, = document["notes"]
    assert f"log schema {records.VERSION + 1}, newer than this tuneup's {records.VERSION}" in newer


@pytest.mark.damaged_log
def test_the_report_command_names_a_damaged_line_and_goes_on(real_events, tmp_path):
    events = copy.deepcopy(real_events)
    steps = [i for i, event in enumerate(events) if event["event"] == "steps"]
    events[steps[1]]["sums"]["seconds"] = "12.5"
    events[steps[2]]["step_seconds"] = [0.1]
    run = write_log(tmp_path / "run", events).parent
    done = subprocess.run([sys.executable, "-m", "tuneup", "report", str(run)], env=child_env(COLUMNS="1000"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "internal error" not in done.stdout + done.stderr
    note = next(line for line in done.stdout.splitlines() if line.startswith("note:"))
    assert ("2 unreadable line(s)" in note and f"line {steps[1] + 1}: steps.sums.seconds is a string, not a number"
            in note and f"line {steps[2] + 1}: steps.step_seconds is a list, not an object" in note)


class Answer(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A loopback server answering whatever body a test sets (an agent or a daemon that
    is not what it claims)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Answer,), {}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_an_agents_damaged_events_are_skipped_and_named(server, real_events):
    events = copy.deepcopy(real_events)
    events[1] = {"event": "config", "loaders": "everything"}
    server.RequestHandlerClass.body = json.dumps({"events": json_safe(events)}).encode()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    (histories, _), = load_jobs(url)
    document, failed = render_everything(histories, url)
    assert failed == {}
    assert document["notes"] == [f"1 unreadable event(s) of {url} skipped (event 2: config.loaders is a string, "
                                 "not a list)"]


@pytest.mark.parametrize("payload, named", [
    ({"daemon": True, "jobs": "none"}, "the answer.jobs is a string, not a list"),
    ({"daemon": True, "jobs": [{"group": "g", "path": 7, "payload": {"events": []}}]},
     "the answer.jobs[0].path is 7, not a string"),
    ({"daemon": True, "jobs": [{"path": "/jobs/x"}, 5]}, "the answer.jobs[1] is 5, not an object"),
])
def test_a_daemons_job_list_that_does_not_fit_is_one_line(server, payload, named):
    server.RequestHandlerClass.body = json.dumps(payload).encode()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with pytest.raises(ReportSourceError) as raised:
        load_jobs(url)
    assert named in str(raised.value) and "\n" not in str(raised.value)


def test_registry_entries_that_are_not_an_agents_are_passed_over(tmp_path):
    """The registry folder may be shared node-wide: a FIFO (it would block the reader), a
    huge file, JSON of the wrong shape or a pid that is not one never reach the daemon."""
    folder = tmp_path / "agents"
    folder.mkdir()
    me = {"pid": os.getpid(), "url": "http://127.0.0.1:1", "run_id": "mine", "started_at": None}
    (folder / "1-mine.json").write_text(json.dumps(me))
    os.mkfifo(folder / "2-fifo.json")
    (folder / "3-huge.json").write_text(json.dumps(dict(me, run_id="huge", argv=["x" * 100_000])))
    for number, wrong in enumerate([{"pid": -1}, {"pid": "12"}, {"pid": os.getpid(), "started_at": "yesterday"},
                                    {"pid": os.getpid(), "rank": [0]}, [os.getpid()], {"pid": 2 ** 80}], start=4):
        (folder / f"{number}-wrong.json").write_text(json.dumps(wrong))
    found: list = []
    reader = threading.Thread(target=lambda: found.extend(discovery.live_agents(folder)), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the FIFO blocked the reader"
    assert [entry["run_id"] for entry in found] == ["mine"]


def test_numbers_are_bounded_and_losses_may_diverge():
    assert records.problem({"event": "warning", "message": "x"}) is None
    assert records.SECONDS.problem(float("inf"), "x") == "x is inf, out of range"
    assert records.SECONDS.problem(2 ** 80, "x") == f"x is {2 ** 80}, out of range"
    assert records.SECONDS.problem(True, "x") == "x is true/false, not a number >= 0"
    assert records.COUNT.problem(1.5, "x") == "x is 1.5, not a whole number >= 0"
    assert records.LOSS.problem(math.nan, "x") is None and records.LOSS.problem(math.inf, "x") is None
    assert records.problem({"event": ["steps"]}) == "its event kind is a list, not a string"
    assert records.problem({"event": "from-a-newer-version", "x": object()}) is None


def test_syncs_measured_with_a_null_rate_read_as_not_measured():
    """Found by the damage test on a busy machine: the schema lets `per_step` be null while
    `measured` is true; the report said TypeError instead of a line."""
    from tuneup.report.summary import sync_lines

    lines = sync_lines({"measured": True, "per_step": None, "meaning": "x", "sampled_steps": 3, "top_sources": []})
    assert lines[0].startswith("Host-device syncs: not measured")
