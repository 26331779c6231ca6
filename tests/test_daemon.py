"""The node daemon: two real training jobs (two processes) found through the registry, one
endpoint for both with distinct labels, report/watch for every job, a killed job leaving the
other's series and the daemon intact, hung agents, busy ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import PROGRAMS, child_env, start_daemon
from tuneup.export import discovery
from tuneup.export.daemon import NodeDaemon


def environment(registry_dir, **extra):
    return child_env(TUNEUP_REGISTRY_DIR=str(registry_dir), TUNEUP_PORT="0", TUNEUP_LOG="0",
                     TUNEUP_NVML_MODULE="tests.fake_nvml", TUNEUP_INTERVAL="0.2", **extra)


def start_job(registry_dir, *args):
    process = subprocess.Popen([sys.executable, str(PROGRAMS / "export_job.py"), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=environment(registry_dir))
    line = process.stdout.readline()
    assert line, "the job did not start"
    return process, json.loads(line)


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(text, name):
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def by_run(text, name):
    return {s.labels.get("run_id"): s.value for s in samples(text, name)}


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError("timed out")


def cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "tuneup", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture
def node(tmp_path):
    """`tuneup daemon` (a process, as deployed) and two training jobs on this 'node'."""
    folder = tmp_path / "agents"
    daemon, url = start_daemon(folder, environment(folder))
    jobs = [start_job(folder, "--seconds", "120", "--delay", "0.001", "--workers", "1"),
            start_job(folder, "--seconds", "120", "--skip-every", "5")]
    yield url, daemon, jobs, folder
    for process, _ in jobs:
        process.kill()
        process.wait(10)
    daemon.terminate()
    daemon.wait(10)


def test_two_jobs_through_one_daemon_with_distinct_labels_and_one_survives_the_other(node):
    url, daemon, jobs, _ = node
    (first, first_info), (second, second_info) = jobs
    runs = {first_info["run_id"], second_info["run_id"]}

    def both_stepping():
        text = get(url + "/metrics")
        counts = by_run(text, "tuneup_step_seconds_count")
        return text if set(counts) == runs and all(v > 20 for v in counts.values()) else None

    text = wait_for(both_stepping)
    assert {s.labels["run_id"] for s in samples(text, "tuneup_run_info")} == runs
    assert by_run(text, "tuneup_daemon_agent_up") == {first_info["run_id"]: 1.0, second_info["run_id"]: 1.0}
    assert samples(text, "tuneup_daemon_agents")[0].value == 2
    # Each job's own figures stay its own: only the second job's GradScaler skips.
    skipped = by_run(text, "tuneup_grad_scaler_skipped_steps_total")
    assert skipped[second_info["run_id"]] > 0 and skipped[first_info["run_id"]] == 0
    # The first job's DataLoader worker is a real process; its process metrics carry its run.
    assert by_run(text, "tuneup_dataloader_workers")[first_info["run_id"]] == 1
    assert set(by_run(text, "process_cpu_seconds_total")) == runs
    # The node's GPUs, once, without a run.
    assert {s.labels["gpu"] for s in samples(text, "tuneup_node_gpu_utilization_ratio")} == {"0", "1"}
    if shutil.which("promtool"):
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    # `tuneup report` and `watch` against the daemon cover both jobs.
    report = cli("report", url)
    assert report.returncode == 0, report.stderr
    assert "job 1 of 2" in report.stdout and "job 2 of 2" in report.stdout
    as_json = json.loads(cli("report", url, "--format", "json").stdout)
    assert sorted(doc["runs"][0]["snapshot"]["run"]["run_id"] for doc in as_json["jobs"]) == sorted(runs)
    one = cli("report", f"{url}/jobs/{first_info['run_id']}", "--format", "json")
    assert json.loads(one.stdout)["runs"][0]["snapshot"]["run"]["run_id"] == first_info["run_id"]
    watched = cli("watch", "--once", url, env=dict(os.environ, COLUMNS="200"))
    assert watched.returncode == 0 and str(first_info["pid"]) in watched.stdout and str(second_info["pid"]) in watched.stdout
    html = cli("report", url, "--format", "html")
    assert html.returncode == 2 and "pass one job's URL" in html.stderr and len(html.stderr.strip().splitlines()) == 1

    # Kill one job outright: the daemon and the other job's series go on.
    before = by_run(get(url + "/metrics"), "tuneup_step_seconds_count")[second_info["run_id"]]
    os.kill(first_info["pid"], signal.SIGKILL)
    first.wait(10)

    def first_gone():
        text = get(url + "/metrics")
        counts = by_run(text, "tuneup_step_seconds_count")
        return text if set(counts) == {second_info["run_id"]} and counts[second_info["run_id"]] > before else None

    text = wait_for(first_gone)
    assert samples(text, "tuneup_daemon_agents")[0].value == 1
    assert daemon.poll() is None
    assert json.loads(get(url + "/api/agents"))["agents"][0]["run_id"] == second_info["run_id"]
    report = cli("report", url)
    assert report.returncode == 0 and "job 1 of" not in report.stdout  # one job left: a plain report
    # A killed job's DataLoader worker exits with its parent (torch's watchdog), leaving no orphan.
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"])
                          if "export_job.py" in " ".join(p.info["cmdline"] or []) and p.ppid() == 1], 20)


def test_the_daemon_answers_with_no_jobs_and_reports_say_so(tmp_path):
    node = NodeDaemon(tmp_path / "agents", gpu=False)
    url = node.start("127.0.0.1", 0)
    try:
        text = get(url + "/metrics")
        assert samples(text, "tuneup_daemon_agents")[0].value == 0
        assert json.loads(get(url + "/api/health")) == {"ok": True, "daemon": True}
        report = cli("report", url)
        assert report.returncode == 2 and "sees no running tuneup job" in report.stderr
    finally:
        node.stop()


def test_a_hung_agent_costs_one_timeout_and_never_the_others(tmp_path):
    """An agent whose endpoint accepts connections but never answers (a process stuck in a
    driver call): up 0, read in parallel with the others, within the timeout."""
    folder = tmp_path / "agents"
    folder.mkdir()
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen()
        me = psutil.Process()
        (folder / "1.json").write_text(json.dumps({
            "pid": me.pid, "started_at": me.create_time(), "run_id": "stuck", "url": f"http://127.0.0.1:{stuck.getsockname()[1]}"}))
        node = NodeDaemon(folder, gpu=False, timeout=0.5)
        url = node.start("127.0.0.1", 0)
        try:
            began = time.monotonic()
            text = get(url + "/metrics")
            took = time.monotonic() - began
        finally:
            node.stop()
    assert by_run(text, "tuneup_daemon_agent_up") == {"stuck": 0.0}
    assert took < 3


def test_a_busy_daemon_port_is_a_one_line_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = cli("daemon", "--port", str(taken.getsockname()[1]), "--registry-dir", str(tmp_path), "--no-gpu",
                     timeout=30)
    assert result.returncode == 2
    assert "is in use" in result.stderr and "--port" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_entries_from_another_pid_namespace_live_by_their_heartbeat(tmp_path):
    """A daemon in its own container cannot see the job's pid: a fresh heartbeat keeps the
    entry, a stale one (the job was killed) drops it."""
    folder = tmp_path / "agents"
    folder.mkdir()
    entry = {"pid": 999_999_999, "started_at": time.time(), "run_id": "elsewhere", "url": "http://127.0.0.1:1",
             "pid_namespace": "pid:[4026531836-not-ours]"}
    path = folder / "999999999.json"
    path.write_text(json.dumps(entry))
    assert [e["run_id"] for e in discovery.live_agents(folder)] == ["elsewhere"]
    stale = time.time() - discovery.STALE - 1
    os.utime(path, (stale, stale))
    assert discovery.live_agents(folder) == [] and not path.exists()
    # Same namespace: the pid decides (this pid does not exist).
    path.write_text(json.dumps(dict(entry, pid_namespace=discovery.pid_namespace())))
    assert discovery.live_agents(folder) == []


def test_a_shared_registry_directory_is_created_open_to_every_user(tmp_path, monkeypatch):
    shared = tmp_path / "run" / "tuneup" / "agents"
    monkeypatch.setenv("TUNEUP_REGISTRY_DIR", str(shared))
    path = discovery.announce({"pid": os.getpid(), "run_id": "abc", "url": "http://127.0.0.1:1"})
    assert path == shared / f"{os.getpid()}-abc.json"
    assert (shared.stat().st_mode & 0o7777) == 0o1777
    discovery.withdraw(path)


def test_the_daemon_exports_every_gpu_whatever_its_own_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    node = NodeDaemon(tmp_path / "agents", nvml_module="tests.fake_nvml")
    url = node.start("127.0.0.1", 0)
    try:
        text = get(url + "/metrics")
    finally:
        node.stop()
    assert sorted(s.labels["gpu"] for s in samples(text, "tuneup_node_gpu_memory_total_bytes")) == ["0", "1"]
    assert {s.labels["uuid"] for s in samples(text, "tuneup_node_gpu_info")} == {"GPU-fake-0000", "GPU-fake-0001"}


def stepping(url):
    text = get(url + "/metrics")
    return text if samples(text, "tuneup_step_seconds_count") else None


def test_ranks_on_one_node_listen_on_a_port_each(tmp_path):
    """No TUNEUP_PORT: the port is 9477 + the local rank (another free one where that is busy).
    Local ranks 200 and 201 (ports 9677, 9678): every other job the suite starts without a
    TUNEUP_PORT listens on 9477 + a local rank below 4, and may hold it while this test runs
    beside it (pytest -n 2)."""
    folder = tmp_path / "agents"
    processes = []
    try:
        urls = []
        for local in (200, 201):
            env = environment(folder, RANK=str(local - 200), LOCAL_RANK=str(local), WORLD_SIZE="2",
                              MASTER_PORT="29600")
            del env["TUNEUP_PORT"]
            process = subprocess.Popen([sys.executable, str(PROGRAMS / "export_job.py"), "--seconds", "60"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            processes.append(process)
            urls.append(json.loads(process.stdout.readline())["url"])
        assert len(set(urls)) == 2
        for rank, url in enumerate(urls):
            with socket.socket() as probe:
                busy = probe.connect_ex(("127.0.0.1", 9677 + rank)) == 0
            assert url.endswith(f":{9677 + rank}") or busy
            text = wait_for(lambda: stepping(url))
            labels = samples(text, "tuneup_step_seconds_count")[0].labels
            assert labels == {"rank": str(rank), "local_rank": str(200 + rank), "training_job": "29600"}
        # The daemon groups the two ranks as one job (same rendezvous), as their series do.
        groups = {entry["group"] for entry in discovery.live_agents(folder)}
        assert groups == {"29600"}
    finally:
        for process in processes:
            process.kill()
            process.wait(10)
