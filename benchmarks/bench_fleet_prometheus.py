"""A real Prometheus on loopback scraping a fleet: one real agent's exposition served for 512
ranks (64 nodes of 8, one target a node, as the node daemons serve them), with tuneup's
recording and alert rules loaded.

    python benchmarks/bench_fleet_prometheus.py [--nodes 64] [--per-node 8] [--rounds 5]

A real training job (tests/programs/export_job.py: DDP over its own gloo group, a GradScaler,
DataLoader workers, the fake NVML with 8 GPUs of which the job holds memory on one) is
scraped once; tests/programs/fleet_exporter.py serves its series for every rank. Printed: the
series one rank exports against the budget (docs/metrics.md), the fleet's series in
Prometheus, the rule groups' evaluation time, and per ranks-dashboard query the median time
(of --rounds, interleaved) of the query as the dashboard sends it (over the recorded series)
beside the same figure computed from the raw per-rank series (what the dashboard did before):
medians and their ratio. tests/test_fleet_prometheus.py uses the same fleet to check that every
recording rule and panel returns data and that the injected straggler and slow node are named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import PROGRAMS, ROOT, child_env, get_json, serve_on_free_port  # noqa: E402

PROMETHEUS_RULES = ROOT / "agents" / "prometheus"
SERIES_BUDGET = 150  # per rank with its own GPU: docs/metrics.md "Series budget"
STRAGGLER, SLOW_NODE, DROP_AT = 77, 5, 45.0  # the injected straggler rank, slow node, throughput drop (s)
SCRAPE = "2s"
# The agents' own series (Prometheus adds its scrape series, the rules' and the alerts' beside).
RAW = 'count({job="tuneup", __name__=~"tuneup_.*|process_.*|python_.*"})'


def query(base: str, expr: str) -> list[dict]:
    payload = get_json(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert payload["status"] == "success", payload
    return payload["data"]["result"]


def start_prometheus(folder: Path) -> tuple[subprocess.Popen, str]:
    """Prometheus with folder/prometheus.yml on a free loopback port: (process, base URL)."""
    return serve_on_free_port(lambda port: ["prometheus", f"--config.file={folder / 'prometheus.yml'}",
                                            f"--storage.tsdb.path={folder / 'data'}",
                                            f"--web.listen-address=127.0.0.1:{port}"],
                              lambda base: get_json(f"{base}/api/v1/status/buildinfo")["data"]["version"], folder)


def capture_template(folder: Path, deadline: float = 90.0) -> str:
    """One real agent's /metrics, once it has DDP timings and a few findings."""
    job = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "export_job.py"), "--seconds", "120", "--ddp", "--fake-allocator",
         "--workers", "2", "--skip-every", "4", "--delay", "0.002"],
        env=child_env(TUNEUP_NVML_MODULE="tests.fake_nvml", FAKE_NVML_GPUS="8", FAKE_NVML_OWN_GPU="3",
                      TUNEUP_PORT="0", TUNEUP_LOG="0", TUNEUP_INTERVAL="0.5",
                      TUNEUP_REGISTRY_DIR=str(folder / "agents")),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = json.loads(job.stdout.readline())["url"]
        end = time.monotonic() + deadline
        while True:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                text = response.read().decode()
            if "tuneup_ddp_allreduce_wait_seconds{" in text and "tuneup_finding_active{" in text:
                return text
            if time.monotonic() > end:
                raise RuntimeError("the job exported no DDP timings or findings in time")
            time.sleep(1)
    finally:
        job.kill()
        job.wait(20)


class FleetPrometheus:
    """The fleet exporter and a Prometheus scraping it, in `folder`; `close()` stops both."""

    def __init__(self, folder: Path, template: str, nodes: int, per_node: int) -> None:
        (folder / "template.txt").write_text(template)
        self.processes: list[subprocess.Popen] = []
        exporter = self._start([sys.executable, str(PROGRAMS / "fleet_exporter.py"), "--template",
                                str(folder / "template.txt"), "--nodes", str(nodes), "--per-node", str(per_node),
                                "--straggler", str(STRAGGLER), "--slow-node", str(SLOW_NODE),
                                "--drop-at", str(DROP_AT)], stdout=subprocess.PIPE)
        served = json.loads(exporter.stdout.readline())
        self.started = time.monotonic()
        self.ports, self.series_per_rank = served["ports"], served["series_per_rank"]
        self.ranks = nodes * per_node
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "rule_files": [str(PROMETHEUS_RULES / "tuneup-recording.yml"), str(PROMETHEUS_RULES / "tuneup-alerts.yml")],
            "scrape_configs": [{"job_name": "tuneup",
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in self.ports]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.server, self.base = start_prometheus(folder)
        self.processes.append(self.server)

    def _start(self, command: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("stdout", subprocess.DEVNULL)
        process = subprocess.Popen(command, stderr=subprocess.DEVNULL, text=True, **kwargs)
        self.processes.append(process)
        return process

    def wait_until_scraped(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                targets = get_json(f"{self.base}/api/v1/targets")["data"]["activeTargets"]
                if len(targets) == len(self.ports) and all(t["health"] == "up" for t in targets):
                    return
            except OSError:
                pass
            if time.monotonic() > end or self.server.poll() is not None:
                raise RuntimeError("Prometheus did not scrape every node")
            time.sleep(0.5)

    def wait_past_drop(self, margin: float = 50.0) -> None:
        """Until the throughput drop is in the 1m rate windows (and the 5m ones have data)."""
        remaining = self.started + DROP_AT + margin - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait(20)


def ranks_dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of the ranks dashboard, with every variable at "All"."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tuneup_dashboards", ROOT / "dashboards" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    out = []
    for uid, title, expr in generate.expressions():
        if uid == "tuneup-ranks":
            for name in ("job", "training_job", "instance", "rank"):
                expr = expr.replace(f"${name}", ".*")
            out.append((title, expr.replace("$__rate_interval", "1m")))
    return out


# The ranks dashboard's straggler view from the raw per-rank series, as it was computed before
# the recording rules (own time outside the backward, over the median rank of the job).
RAW_OWN = ('sum by (job, instance, run_id, rank) (rate(tuneup_step_phase_seconds_total{phase!="backward"}[5m])) / '
           "(sum by (job, instance, run_id, rank) (rate(tuneup_detail_steps_total[5m])) > 0)")
RAW_RELATIVE = f"({RAW_OWN}) / on (job) group_left () (quantile by (job) (0.5, {RAW_OWN}) > 0)"


def timed(base: str, expr: str) -> float:
    began = time.perf_counter()
    query(base, expr)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        template = capture_template(folder)
        fleet = FleetPrometheus(folder, template, args.nodes, args.per_node)
        try:
            fleet.wait_until_scraped()
            fleet.wait_past_drop(margin=0)
            print(f"series one rank exports: {fleet.series_per_rank} (budget {SERIES_BUDGET})")
            total = float(query(fleet.base, RAW)[0]["value"][1])
            rules = float(query(fleet.base, 'count({__name__=~".+:.+"})')[0]["value"][1])
            print(f"series of {fleet.ranks} ranks in Prometheus: {total:,.0f} "
                  f"({total / fleet.ranks:.1f} per rank; scrape every {SCRAPE}); recorded series: {rules:,.0f}")
            groups = get_json(f"{fleet.base}/api/v1/rules")["data"]["groups"]
            for group in groups:
                print(f"rule group {group['name']}: {len(group['rules'])} rules, evaluated in "
                      f"{group['evaluationTime'] * 1e3:.1f} ms")
            queries = ranks_dashboard_queries() + [("raw: own time over the median (before)", RAW_RELATIVE)]
            times: dict[str, list[float]] = {title: [] for title, _ in queries}
            for _ in range(args.rounds):  # interleaved: every query once a round
                for title, expr in queries:
                    times[title].append(timed(fleet.base, expr))
            print(f"\nranks dashboard at {fleet.ranks} ranks, query time (median of {args.rounds}):")
            for title, _ in queries:
                print(f"  {statistics.median(times[title]) * 1e3:8.1f} ms  {title}")
            recorded = statistics.median(times["The 10 slowest ranks: own time over the job's median rank"])
            raw = statistics.median(times["raw: own time over the median (before)"])
            print(f"\nslowest ranks vs median: recorded {recorded * 1e3:.1f} ms, raw {raw * 1e3:.1f} ms "
                  f"(raw / recorded = {raw / recorded:.1f}x)")
            whole = sum(statistics.median(times[title]) for title, _ in queries[:-1])
            print(f"every panel of the ranks dashboard once: {whole * 1e3:.0f} ms")
        finally:
            fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
