"""torchrun: two real processes (gloo on CPU) under `-m tuneup run`: rank labels on both
endpoints, the straggler found live on rank 0 and named in its end-of-run summary, the ranks
sharing one run directory, and a rank dying without anything hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import PROGRAMS, ROOT, child_env, free_port, wait_for
from tuneup.diagnose.rules.distributed import CPU_STARVED_SHARE
from tuneup.measure.host import RunQueue

SCHEDSTAT = RunQueue().available  # Linux's run-queue figures (not under gVisor, say)
from tuneup.export import discovery

JOB = str(ROOT / "examples" / "torchrun_ddp.py")


def torchrun(tmp_path, *args, pinned=False, **env):
    """The example under `torchrun -m tuneup run` on two ranks; `pinned`: each rank on a CPU of
    its own (tests/programs/pinned_rank.py), local rank R on the R-th usable CPU."""
    full = child_env(TUNEUP_REGISTRY_DIR=str(tmp_path / "agents"), TUNEUP_INTERVAL="0.2",
                     TUNEUP_RUN_DIR=str(tmp_path / "run"), **env)
    launch = [str(PROGRAMS / "pinned_rank.py"), sys.executable, "-m"] if pinned else ["-m"]
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *launch, "tuneup", "run", JOB, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full, cwd=tmp_path)


def rank_events(tmp_path, rank=0):
    return [json.loads(line) for line in (tmp_path / "run" / f"events-rank{rank}.jsonl").read_text().splitlines()
            if line.strip()]


def samples(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def both_ranks(folder):
    found = discovery.live_agents(folder)
    return found if len(found) == 2 else None


def test_a_straggling_rank_is_found_live_and_named_at_the_end(tmp_path):
    job = torchrun(tmp_path, "--steps", "1500", "--slow-rank", "1", "--delay", "0.01")
    try:
        agents = wait_for(lambda: both_ranks(tmp_path / "agents"))
        urls = {entry["rank"]: entry["url"] for entry in agents}
        assert set(urls) == {0, 1} and len(set(urls.values())) == 2  # a port per local rank
        for rank, url in urls.items():
            counted = wait_for(lambda url=url: samples(url, "tuneup_step_seconds_count"))
            assert counted[0].labels["rank"] == str(rank) and counted[0].labels["local_rank"] == str(rank)
        # Rank 0 reads the other ranks' summaries from the job's store (no collective) and
        # finds the straggler while the job runs.
        live = wait_for(lambda: [s for s in samples(urls[0], "tuneup_finding_active")
                                 if s.labels["rule"] == "rank-straggler"])
        assert live[0].labels["rank"] == "0"
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err[-2000:]
    assert "tuneup: summary across 2 ranks" in err and "straggler: rank 1 (node 0, " in err
    assert err.count("tuneup: summary across") == 1  # rank 0 only
    # One run directory for the node's ranks: each rank's log, and rank 0's summary of all.
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("events-rank*.jsonl")) == ["events-rank0.jsonl", "events-rank1.jsonl"]
    events = [json.loads(line) for line in (run / "events-rank0.jsonl").read_text().splitlines()]
    ranks = [e for e in events if e["event"] == "ranks"]
    assert len(ranks) == 1 and sorted(r["run"]["rank"] for r in ranks[0]["ranks"]) == [0, 1]
    assert ranks[0]["findings"][0]["evidence"]["rank"] == 1
    # Its 10 ms are a sleep, not a wait for a CPU: the rank's own time, and the fix says so.
    if SCHEDSTAT:
        assert ranks[0]["findings"][0]["evidence"]["cpu_wait_share"] < CPU_STARVED_SHARE
    assert "for a CPU" not in err
    report = subprocess.run([sys.executable, "-m", "tuneup", "report", str(run), "--format", "json"],
                            capture_output=True, text=True, timeout=60)
    straggler = next(f for f in json.loads(report.stdout)["findings"] if f["rule"] == "rank-straggler")
    assert straggler["evidence"]["rank"] == 1


def test_a_rank_slow_in_its_backward_is_named_by_the_wait_ddp_measures(tmp_path):
    # Ground truth: rank 1 sleeps 15 ms inside its backward, before any gradient is ready. The
    # all-reduce evens the ranks out: both ranks' steps and backwards last the same, and rank 0
    # waits the 15 ms in the all-reduce. Only that wait tells the ranks apart.
    # DDP times iterations 1-10, then every 100th: 500 steps give the steady median 3 or more.
    job = torchrun(tmp_path, "--steps", "500", "--slow-rank", "1", "--slow-in", "backward", "--delay", "0.015")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-2000:]
    assert "straggler: rank 1 (node 0, " in err and "in DDP's all-reduce it waits" in err
    ranks = next(e for e in rank_events(tmp_path) if e["event"] == "ranks")
    waits = {r["run"]["rank"]: r["ddp"]["allreduce_wait_seconds"] for r in ranks["ranks"]}
    assert waits[0] - waits[1] >= 0.015 / 2  # the sleep, less scheduling noise on a shared machine
    evidence = ranks["findings"][0]["evidence"]
    assert evidence["rank"] == 1 and evidence["basis"] == "allreduce_wait"


def test_ranks_at_the_same_pace_have_no_straggler(tmp_path):
    # Ground truth: both ranks run the same work, and each waits 10 ms per step (--step-wait) as
    # a host waits for its GPU: the steps people scale out are mostly the device's. (Steps of
    # CPU work alone are not at one pace on a shared machine: with another job on the 2 cores
    # here, rank 0 spent 4.2 ms per step outside the all-reduce and rank 1 1.8 ms, waiting
    # 2.7 ms in it for rank 0 by DDP's timers, rank 0's threads 0.9 ms longer for a CPU: a true
    # straggler. With the wait, that much uneven CPU moves a rank's own time by under a tenth.)
    # 500 steps: past DDP's start-up, its timers' steady samples (iterations 100-500) give the wait.
    job = torchrun(tmp_path, "--steps", "500", "--step-wait", "0.01")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-2000:]
    assert "tuneup: summary across 2 ranks" in err and "no straggler" in err, err[-2000:]
    ranks = next(e for e in rank_events(tmp_path) if e["event"] == "ranks")
    assert all(r["ddp"]["allreduce_wait_seconds"] is not None for r in ranks["ranks"])  # by DDP's waits


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not SCHEDSTAT,
                    reason="needs two usable CPUs (a rank on each) and Linux's schedstat")
def test_a_rank_starved_of_cpu_is_named_with_its_wait_for_a_core(tmp_path):
    # Ground truth: both ranks run the same work; each rank has a CPU of its own, and twelve busy
    # processes share rank 1's: its threads get about a thirteenth of that CPU and are runnable
    # and waiting for it most of each step; rank 0's wait less (they sleep in the all-reduce),
    # even with two other busy processes on the machine, which the scheduler moves to rank 0's
    # CPU (a third of it left; with six on rank 1's, that was too little a difference to hold).
    # Rank 1's forward and backward take longer (alone: 3.4 ms outside the all-reduce against
    # 2.2, rank 0 waiting 3.0 ms in it): the straggler is rank 1, and its host, not its work,
    # is the cause (its extra CPU wait, 6.3 against 2.1 ms, is more than its excess).
    cpu = sorted(os.sched_getaffinity(0))[1]
    crowd = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
             for _ in range(12)]
    try:
        job = torchrun(tmp_path, "--steps", "600", pinned=True)
        out, err = job.communicate(timeout=180)
    finally:
        for process in crowd:
            process.kill()
            process.wait()
    assert job.returncode == 0, err[-2000:]
    table = err[err.index("tuneup: summary across 2 ranks"):].splitlines()
    assert "cpu wait" in table[1]
    ranks = next(e for e in rank_events(tmp_path) if e["event"] == "ranks")
    waits = {r["run"]["rank"]: r["host"]["step_cpu_wait_seconds"] for r in ranks["ranks"]}
    assert waits[1] > waits[0], waits  # the kernel's figures: rank 1's CPU is the crowded one
    if not ranks["findings"]:
        # Other load on the machine can even the ranks out: beside two more busy processes both
        # ran at the scheduler's 4 ms tick, neither waiting for the other in the all-reduce.
        # Then no rank is named, and rank 1's longer CPU wait alone names none.
        assert "no straggler" in err, err[-2000:]
        return
    assert "straggler: rank 1 (node 0, " in err and "per step for a CPU (runnable, not running)" in err, err[-2000:]
    evidence = ranks["findings"][0]["evidence"]
    assert evidence["rank"] == 1 and evidence["cpu_wait_share"] >= CPU_STARVED_SHARE
    assert evidence["cpu_wait_seconds"] == waits[1]
    assert "give each rank cores of its own" in ranks["findings"][0]["fix"]


def test_a_rank_that_dies_ends_the_job_without_a_hang(tmp_path):
    began = time.monotonic()
    job = torchrun(tmp_path, "--steps", "100000")
    try:
        agents = wait_for(lambda: both_ranks(tmp_path / "agents"))
        rank0, rank1 = sorted(agents, key=lambda entry: entry["rank"])
        wait_for(lambda: [s for s in samples(rank0["url"], "tuneup_step_seconds_count") if s.value > 20])
        os.kill(rank1["pid"], signal.SIGKILL)
        out, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job hung after a rank died")
    assert job.returncode != 0
    assert time.monotonic() - began < 120
    # Rank 0's agent was measuring up to the end: its log has steps.
    events = [json.loads(line) for line in (tmp_path / "run" / "events-rank0.jsonl").read_text().splitlines()
              if line.strip()]
    assert any(e["event"] == "steps" for e in events)


def two_nodes(tmp_path, *args):
    """Two torchrun launchers on this machine, as two nodes of 2 ranks each (static rendezvous on
    loopback): node 1 holds ranks 2 and 3. Each node has its own run directory and registry."""
    port = free_port()
    launchers = []
    for node in (0, 1):
        env = child_env(TUNEUP_REGISTRY_DIR=str(tmp_path / f"agents{node}"), TUNEUP_INTERVAL="0.2",
                        TUNEUP_RUN_DIR=str(tmp_path / f"run{node}"), TUNEUP_PORT="0")
        launchers.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "tuneup", "run", JOB, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path))
    return launchers


def test_two_nodes_name_the_slow_rank_on_the_other_node_and_their_run_dirs_merge(tmp_path):
    # Ground truth: 4 ranks, 2 per node; rank 3 (node 1) sleeps 10 ms a step outside the backward.
    launchers = two_nodes(tmp_path, "--steps", "800", "--slow-rank", "3", "--delay", "0.01")
    try:
        results = [launcher.communicate(timeout=240) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    err0 = results[0][1]
    assert "tuneup: summary across 4 ranks" in err0 and "straggler: rank 3 (node 1, " in err0
    assert "tuneup: summary across" not in results[1][1]  # rank 0 only, on node 0
    ranks = [json.loads(line) for line in (tmp_path / "run0" / "events-rank0.jsonl").read_text().splitlines()
             if '"event": "ranks"' in line or '"event":"ranks"' in line]
    assert len(ranks) == 1 and ranks[0]["topology"]["nodes"] == 2 and ranks[0]["topology"]["assumed"] is False
    assert sorted((r["run"]["rank"], r["run"]["node"]) for r in ranks[0]["ranks"]) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert sorted(p.name for p in (tmp_path / "run1").glob("events-rank*.jsonl")) == ["events-rank2.jsonl",
                                                                                      "events-rank3.jsonl"]
    report = subprocess.run([sys.executable, "-m", "tuneup", "report", str(tmp_path / "run0"), str(tmp_path / "run1"),
                             "--format", "json"], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    assert sorted(run["rank"] for run in document["runs"]) == [0, 1, 2, 3]
    straggler = next(f for f in document["findings"] if f["rule"] == "rank-straggler")
    assert straggler["evidence"]["rank"] == 3


def test_a_killed_node_tears_down_without_hanging_anyone(tmp_path):
    began = time.monotonic()
    launchers = two_nodes(tmp_path, "--steps", "100000")

    def training(node):
        """Node's two ranks, once both have stepped: killed before then, node 0 would be waiting
        in gloo's connect to ranks that never arrive (init_process_group's 30-minute timeout),
        which is torch's own wait and not what this test is about."""
        agents = discovery.live_agents(tmp_path / f"agents{node}")
        stepping = [a for a in agents if any(s.value > 5 for s in samples(a["url"], "tuneup_step_seconds_count"))]
        return agents if len(stepping) == 2 else None

    try:
        wait_for(lambda: training(0) and training(1), timeout=120)
        launchers[1].send_signal(signal.SIGKILL)  # the whole node 1 launcher, then its workers
        for entry in discovery.live_agents(tmp_path / "agents1"):
            try:
                os.kill(entry["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        launchers[0].communicate(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("node 0 hung after node 1 was killed")
    finally:
        for launcher in launchers:
            launcher.kill()
        for node in (0, 1):  # no orphaned worker outlives the test, whatever happened
            for entry in discovery.live_agents(tmp_path / f"agents{node}"):
                try:
                    os.kill(entry["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert launchers[0].returncode != 0
    assert time.monotonic() - began < 240
