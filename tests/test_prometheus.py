"""A real Prometheus (the Debian package) on loopback scrapes real training jobs, directly and
through the node daemon; then every expression of every dashboard panel and variable, and
every alert rule, is evaluated through Prometheus' HTTP API and must return data.

The jobs are made to show what each panel and alert is for: rank 0 and rank 1 of one job
(rank 1 straggles and stalls on its loader; rank 0 skips GradScaler steps, has an idle GPU, runs
apply mode and has its FLOPs counted as a bf16 step on an H100's peak), and a second job that stops stepping (hung). NVML is the fake one (no GPU
here); the CUDA allocator figures come from the same function the agent reads, answering as
a CUDA job's would.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from urllib.parse import urlsplit

from benchmarks.bench_fleet_prometheus import get_json, query, start_prometheus
from tests.conftest import PROGRAMS, ROOT, child_env, free_port, start_daemon

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus (Debian package) not installed; .ci/run installs it")

RATE_INTERVAL = "20s"
ALERTS = ROOT / "agents" / "prometheus" / "tuneup-alerts.yml"
RECORDING = ROOT / "agents" / "prometheus" / "tuneup-recording.yml"
# Alerts over a whole fleet's job, which two ranks on one machine cannot meet: a slow node (rank
# 0 of a job of several nodes) and a job whose throughput halved in 30 minutes. They are met in
# tests/test_fleet_prometheus.py.
FLEET_ALERTS = {"TuneupSlowNode", "TuneupJobThroughputDropped"}
# An alert whose condition takes real time to become true is evaluated with that time shortened:
# (alert, pattern, replacement).
SHORTENED = {"TuneupTrainingHung": (r">\s*600\b", "> 5")}


def load_generator():
    spec = importlib.util.spec_from_file_location("tuneup_dashboards", ROOT / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def substitute(expr):
    """Grafana's variables as the dashboards' "All": every job, training job, instance and rank."""
    for name in ("job", "training_job", "instance", "rank"):
        expr = expr.replace(f"${name}", ".*")
    return expr.replace("$__rate_interval", RATE_INTERVAL)


def first_line(process, name):
    line = process.stdout.readline()
    assert line, f"{name} did not start"
    return line


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    registry_dir = folder / "agents"
    base_env = child_env(TUNEUP_NVML_MODULE="tests.fake_nvml", TUNEUP_REGISTRY_DIR=str(registry_dir),
                         TUNEUP_LOG="0", TUNEUP_INTERVAL="0.5")
    # Every listener takes any free port and says which (TUNEUP_PORT=0, daemon --port 0): a port
    # picked here and given to a process could be taken in between by the suite's other tests.
    # torch's rendezvous store has no such option; its port is picked here.
    ddp = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCHELASTIC_RUN_ID": "it"}
    jobs = {
        "rank0": ({**ddp, "RANK": "0", "LOCAL_RANK": "0", "TUNEUP_MODE": "apply",
                   "TUNEUP_ACTIONS": "dataloader", "FAKE_NVML_UTILIZATION": "3"},
                  ["--delay", "0.0005", "--skip-every", "4", "--fake-allocator", "--ddp",
                   "--fake-device", "NVIDIA H100 80GB HBM3"]),
        # Stalls by sleeping: 30 ms a sample, 16 a batch, 2 workers: a batch every 240 ms against
        # a step of 20 ms (sleep) plus a small convolution, and rank 0's step (they meet in each
        # allreduce): over TuneupDataStallHigh's 20%, and the slow rank, unless rank 0's step
        # takes 190 ms. With 12 ms a sample (96 ms a batch), two busy processes beside the
        # suite slowed rank 0's CPU work enough that rank 1 was neither stalled nor slow.
        "rank1": ({**ddp, "RANK": "1", "LOCAL_RANK": "1"},
                  ["--delay", "0.03", "--workers", "2", "--compute", "0.02", "--ddp"]),
        "hung": ({}, ["--steps", "40", "--hang"]),
    }
    processes, targets = [], {}
    server = None
    try:
        for name, (env, args) in jobs.items():
            process = subprocess.Popen([sys.executable, str(PROGRAMS / "export_job.py"), "--seconds", "600", *args],
                                       env={**base_env, "TUNEUP_PORT": "0", **env}, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True)
            processes.append(process)
            targets[name] = urlsplit(json.loads(first_line(process, name))["url"]).netloc
        daemon, daemon_url = start_daemon(registry_dir, base_env)
        processes.append(daemon)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RECORDING), str(ALERTS)],
            "scrape_configs": [
                {"job_name": "tuneup", "static_configs": [{"targets": [targets["rank0"], targets["rank1"]]}]},
                {"job_name": "tuneup-hung", "static_configs": [{"targets": [targets["hung"]]}]},
                {"job_name": "tuneup-node", "static_configs": [{"targets": [urlsplit(daemon_url).netloc]}]},
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        server, base = start_prometheus(folder)
        deadline = time.monotonic() + 60
        while True:
            active = get_json(f"{base}/api/v1/targets")["data"]["activeTargets"]
            if len(active) == 4 and all(t["health"] == "up" for t in active):
                break
            assert time.monotonic() < deadline, f"Prometheus did not scrape every target: {active}"
            assert server.poll() is None, "Prometheus exited"
            time.sleep(0.5)
        # Every job stepping before the clock starts (on a busy machine, importing torch and the
        # ranks' rendezvous can take most of a fixed wait): then enough samples for every 20 s
        # rate window, and past the hung job's last step.
        deadline = time.monotonic() + 120
        while len([s for s in query(base, 'tuneup_step_seconds_count{job=~"tuneup|tuneup-hung"} >= 5')]) < 3:
            assert time.monotonic() < deadline, query(base, "tuneup_step_seconds_count")
            time.sleep(0.5)
        time.sleep(25)
        yield base
    finally:
        for process in processes + ([server] if server else []):
            process.kill()
        for process in processes + ([server] if server else []):
            process.wait(20)


def test_prometheus_scraped_every_job_directly_and_through_the_daemon(prometheus):
    direct = query(prometheus, 'tuneup_step_seconds_count{job=~"tuneup|tuneup-hung"}')
    assert sorted(s["metric"]["rank"] for s in direct) == ["0", "0", "1"]
    through = query(prometheus, 'tuneup_step_seconds_count{job="tuneup-node"}')
    assert len(through) == 3 and len({s["metric"]["run_id"] for s in through}) == 3
    assert query(prometheus, 'tuneup_daemon_agents{job="tuneup-node"}')[0]["value"][1] == "3"


def dashboard_expressions():
    generator = load_generator()
    return [pytest.param(expr, id=f"{uid}: {title}") for uid, title, expr in generator.expressions()]


def rank_figures(prometheus) -> str:
    """Each rank's step time, data wait and own time per step over the last 20 s, and its
    steps so far: what a failed stall or straggler assertion shows."""
    figures = {
        "steps": "tuneup_step_seconds_count",
        "step_s": "rate(tuneup_step_seconds_sum[20s]) / rate(tuneup_step_seconds_count[20s])",
        "stall": "rate(tuneup_data_wait_seconds_total[20s]) / rate(tuneup_step_seconds_sum[20s])",
        "own_s": "rank:tuneup_own_seconds_per_step:mean5m",
        "own_ratio": "rank:tuneup_own_seconds_per_step:ratio_to_median5m",
    }
    lines = []
    for label, expr in figures.items():
        values = {(s["metric"].get("job"), s["metric"].get("rank")): round(float(s["value"][1]), 4)
                  for s in query(prometheus, expr)}
        lines.append(f"{label}: {values}")
    return "\n".join(lines)


@pytest.mark.parametrize("expr", dashboard_expressions())
def test_every_dashboard_panel_returns_data(prometheus, expr):
    assert query(prometheus, substitute(expr)), f"no data for:\n{substitute(expr)}\n{rank_figures(prometheus)}"


def variable_queries():
    generator = load_generator()
    return [pytest.param(q, id=f"{uid}: ${name}") for uid, name, q in generator.variable_queries()]


@pytest.mark.parametrize("variable", variable_queries())
def test_every_dashboard_variable_has_values(prometheus, variable):
    """Grafana's label_values(selector, label): the series' values of that label."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", variable, re.S)
    if match:
        selector, label = match.groups()
        result = query(prometheus, f"count by ({label}) ({substitute(selector)})")
        assert [s for s in result if s["metric"].get(label)], f"no values of {label} in {selector}"
    else:
        assert query(prometheus, substitute(variable))


def alert_rules():
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [pytest.param(rule["alert"], rule["expr"], id=rule["alert"]) for group in groups for rule in group["rules"]
            if "alert" in rule]


@pytest.mark.parametrize("name, expr", alert_rules())
def test_every_alert_condition_is_met_by_the_job_made_to_meet_it(prometheus, name, expr):
    if name in FLEET_ALERTS:
        pytest.skip("met by a simulated fleet: tests/test_fleet_prometheus.py")
    if name in SHORTENED:
        pattern, replacement = SHORTENED[name]
        assert re.search(pattern, expr), f"{name}'s threshold changed: update SHORTENED"
        expr = re.sub(pattern, replacement, expr)
    firing = query(prometheus, expr)
    assert firing, f"{name}: no series meets\n{expr}\nwhat the ranks show:\n{rank_figures(prometheus)}"
    # The rank made to meet it (rank 0's own loader stalls too until apply mode has fixed it).
    expected = {"TuneupDataStallHigh": {"1"}, "TuneupGradScalerSkipRateHigh": {"0"}, "TuneupGpuIdle": {"0"},
                "TuneupRankStraggler": {"1"}}
    if name in expected:
        ranks = {s["metric"]["rank"] for s in firing if s["metric"].get("job") == "tuneup"}
        assert ranks == expected[name] or (name == "TuneupDataStallHigh" and ranks == {"0", "1"}), ranks
    if name == "TuneupTrainingHung":
        assert {s["metric"]["job"] for s in firing if s["metric"]["job"] != "tuneup-node"} == {"tuneup-hung"}


def test_prometheus_loads_the_alert_rules(prometheus):
    rules = get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"]: rule for group in rules for rule in group["rules"]}
    recorded = {rule["record"] for group in yaml.safe_load(RECORDING.read_text())["groups"] for rule in group["rules"]}
    assert set(loaded) == {name for name, _ in (p.values for p in alert_rules())} | recorded
    assert all(rule["health"] == "ok" for rule in loaded.values())
