"""The run log: JSONL flushed per line, bounded in size, readable after a crash."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest
import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tests.conftest import run_program
from tuneup.export.runlog import RunLog, RunLogError, log_files, read_log
from tuneup.report.sources import load


def small_job():
    model = mlp(hidden=16)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_events_are_on_disk_while_the_job_runs(run_dir):
    model, optimizer = small_job()
    loader = loader_for(SlowDataset(size=4096, latency=0.0005), batch_size=8)
    with tuneup.attach(run_dir=run_dir, interval=0.05) as agent:
        train(loader, model, optimizer, steps=40)
        time.sleep(0.2)
        live = read_log(run_dir / "events.jsonl")  # read while still attached
        kinds = {event["event"] for event in live.events}
        assert {"run", "config", "system", "steps"} <= kinds
        # The 40th step is still open: it closes when the next one starts, or at detach.
        assert sum(e["steps"] for e in live.of("steps")) == 39
    final = read_log(run_dir / "events.jsonl")
    assert final.events[0]["event"] == "run"
    assert final.events[-1]["event"] == "end"
    assert final.last("end")["totals"]["steps"] == 40
    assert final.events[0]["run_id"] == agent.run_info["run_id"]


def test_snapshot_and_log_tell_the_same_story(run_dir):
    model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir, interval=0.05) as agent:
        train(loader_for(SlowDataset(size=4096, latency=0.0003)), model, optimizer, steps=60, host_reads=1)
    snapshot = agent.snapshot()
    end = read_log(run_dir / "events.jsonl").last("end")
    assert end["totals"] == json.loads(json.dumps(snapshot["totals"]))
    assert end["syncs"]["per_step"] == snapshot["syncs"]["per_step"] == 1


def test_log_stays_within_its_size_budget(run_dir):
    budget = 64 * 1024
    model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir, interval=0.05, log_max_bytes=budget):
        train(loader_for(SlowDataset(size=1_000_000, latency=0.0002)), model, optimizer, steps=2500)
    live, rotated = run_dir / "events.jsonl", run_dir / "events.jsonl.1"
    assert rotated.exists(), "the budget was reached, so the log must have rotated"
    assert live.stat().st_size + rotated.stat().st_size <= budget
    record = read_log(live)
    assert record.events[0]["event"] == "run"  # a rotated log still starts with its header
    assert record.last("end")["totals"]["steps"] == 2500


@pytest.mark.damaged_log
def test_torn_last_line_is_ignored_and_corrupt_lines_are_counted(tmp_path):
    path = tmp_path / "events.jsonl"
    log = RunLog(path, 1 << 20, {"event": "run", "run_id": "x"})
    assert log.open()
    log.write({"event": "warning", "message": "3", "loss": float("nan")})
    log.close()
    with open(path, "a") as handle:
        handle.write("{not json}\n")
        handle.write('{"event": "warning", "message": "4"}\n')
        handle.write('{"event": "warning", "mes')  # the process died mid-write
    record = read_log(path)
    assert [e["event"] for e in record.events] == ["run", "warning", "warning"]
    assert math.isnan(record.events[1]["loss"])  # written as "nan", read back as a float
    assert record.torn_tail is True
    assert record.skipped_lines == 1


def test_log_is_readable_after_the_process_is_killed(tmp_path):
    result = run_program("killed_job.py", str(tmp_path / "run"))
    assert result.returncode == -signal.SIGKILL
    record = read_log(tmp_path / "run" / "events.jsonl")
    assert record.events[0]["event"] == "run"
    assert sum(e["steps"] for e in record.of("steps")) > 0
    assert record.last("end") is None  # it never got to say goodbye; everything else is there
    # And the report says so, rather than show the run as if it had ended.
    [history], _ = load(str(tmp_path / "run"))
    assert history.notes[-1].startswith("the run log ends without the agent's detach: the job stopped without it "
                                        "(killed"), history.notes


def test_the_report_of_a_job_still_running_says_it_is_its_log_so_far(run_dir):
    model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir, port=0) as agent:
        train(loader_for(SlowDataset(size=256)), model, optimizer, steps=5)
        agent.snapshot()
        [history], _ = load(str(run_dir))
        assert history.notes[-1].startswith(f"the job is still running (pid {os.getpid()}): this is its log so far; "
                                            f"tuneup report again, or its URL, {agent.server.url}, reads on"), \
            history.notes
    [history], _ = load(str(run_dir))
    assert history.notes == []  # ended: its detach wrote the end record


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no run directory or log at"),
        (lambda d: d.mkdir(), "holds no tuneup run log"),
        (lambda d: (d.mkdir(), (d / "events.jsonl").write_text("")), "holds no readable tuneup events"),
        (lambda d: (d.mkdir(), (d / "events.jsonl").write_text("garbage\n\x00\x01")), "holds no readable"),
        (lambda d: (d.mkdir(), (d / "events.jsonl").write_text('{"event":"steps"}\n')), "has no run header"),
    ],
    ids=["missing", "empty-dir", "empty-file", "corrupt", "headerless"],
)
def test_unreadable_logs_give_one_line_errors(tmp_path, setup, message):
    target = tmp_path / "run"
    setup(target)
    with pytest.raises(RunLogError, match=message) as error:
        for path in log_files(target):
            read_log(path)
    assert "\n" not in str(error.value)


def test_appending_runs_keeps_the_newest(run_dir):
    model, optimizer = small_job()
    for steps in (5, 7):
        with tuneup.attach(run_dir=run_dir):
            train(loader_for(SlowDataset(size=256)), model, optimizer, steps=steps)
    record = read_log(run_dir / "events.jsonl")
    assert record.last("end")["totals"]["steps"] == 7
    assert len(record.of("run")) == 1


@pytest.mark.damaged_log
def test_a_huge_line_and_deep_json_are_skipped_by_name_without_reading_them_whole(tmp_path, monkeypatch):
    import tuneup.export.runlog as runlog

    monkeypatch.setattr(runlog, "MAX_LINE", 4096)  # the cap, small: the same code path as 16 MiB
    path = tmp_path / "events.jsonl"
    log = RunLog(path, 1 << 20, {"event": "run", "run_id": "x"})
    assert log.open()
    log.close()
    with open(path, "a") as handle:
        handle.write('{"event": "steps", "pad": "' + "x" * 100_000 + '"}\n')  # line 2: over the cap
        handle.write("[" * 2000 + "]" * 2000 + "\n")  # line 3: under the cap, deeper than json can nest
        handle.write('{"event": "warning", "message": "4"}\n')
    record = read_log(path)
    assert [e["event"] for e in record.events] == ["run", "warning"] and record.events[1]["message"] == "4"
    assert record.skipped_lines == 2
    assert record.notes() == [f"2 unreadable line(s) of {path} skipped (events.jsonl line 2: over 4096 bytes; "
                              "events.jsonl line 3: nested too deep)"]


def test_a_fifo_named_like_a_log_is_refused_not_read(tmp_path):
    import os

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "events.jsonl")  # opening it for reading would wait for a writer for ever
    with pytest.raises(RunLogError, match=r"is not a regular file \(a FIFO"):
        read_log(log_files(run)[0])
    with pytest.raises(RunLogError, match=r"is not a regular file"):
        log_files(run / "events.jsonl")
