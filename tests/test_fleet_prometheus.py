"""A real Prometheus (the Debian package) on loopback scraping 512 ranks: one real agent's
exposition served for every rank of 64 nodes of 8 (tests/programs/fleet_exporter.py, through
benchmarks/bench_fleet_prometheus.py's set-up), tuneup's recording and alert rules loaded.

Ground truth (fleet_exporter.py): every rank steps at the same pace (the template's); in DDP's
all-reduce ranks wait 0.3 of a step, rank 77 (node 9) 0.01 (the straggler the others wait for:
own time 0.99 of a step against 0.7, 1.41x the median), the 8 ranks of node 5 0.15 (own time
0.85, 1.21x); rank 0 carries the cross-rank findings its agent raises; after 45 s every rank
trains 5% of its samples per second. Query times are benchmarks/bench_fleet_prometheus.py's to
print, not this test's to assert.
"""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from benchmarks.bench_fleet_prometheus import (PROMETHEUS_RULES, RAW, SERIES_BUDGET, SLOW_NODE, STRAGGLER,
                                               FleetPrometheus, capture_template, query, ranks_dashboard_queries)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus (Debian package) not installed; .ci/run installs it")

NODES, PER_NODE = 64, 8
SLOW_NODE_RANKS = {str(r) for r in range(SLOW_NODE * PER_NODE, (SLOW_NODE + 1) * PER_NODE)}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return capture_template(tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, template):
    fleet = FleetPrometheus(tmp_path_factory.mktemp("fleet"), template, NODES, PER_NODE)
    try:
        fleet.wait_until_scraped()
        fleet.wait_past_drop()
        yield fleet
    finally:
        fleet.close()


def test_one_rank_keeps_to_the_series_budget(template):
    # Ground truth: a rank of an 8-GPU node (fake NVML) that holds memory on GPU 3 only.
    samples = [s for f in text_string_to_metric_families(template) for s in f.samples
               if not s.name.endswith("_created")]
    assert len(samples) <= SERIES_BUDGET
    gpus = {s.labels["gpu"] for s in samples if s.name.startswith("tuneup_gpu_")}
    assert gpus == {"3"}  # its own GPU, not the node's eight
    assert {s.labels["training_job"] for s in samples if s.name.startswith("tuneup_")} != {""}


def test_prometheus_holds_every_ranks_series(fleet):
    total = float(query(fleet.base, RAW)[0]["value"][1])
    # Each rank's series, and rank 0's two cross-rank findings (two series each).
    assert total == NODES * PER_NODE * fleet.series_per_rank + 4
    assert total <= NODES * PER_NODE * SERIES_BUDGET


def recorded():
    groups = yaml.safe_load((PROMETHEUS_RULES / "tuneup-recording.yml").read_text())["groups"]
    return [rule["record"] for group in groups for rule in group["rules"]]


@pytest.mark.parametrize("record", recorded())
def test_every_recording_rule_returns_data(fleet, record):
    result = query(fleet.base, record)
    assert result, record
    if record.startswith("rank:"):
        assert len(result) == NODES * PER_NODE, record  # one series per rank, none merged
    else:
        assert len(result) == 1 and result[0]["metric"]["training_job"] == "fleet:10.0.0.1:29500", record


def test_the_job_level_series_name_the_straggler(fleet):
    slowest = query(fleet.base, "training_job:tuneup_slowest_rank:own_seconds_per_step5m")
    assert [s["metric"]["rank"] for s in slowest] == [str(STRAGGLER)]
    skew = float(query(fleet.base, "training_job:tuneup_own_seconds_per_step:skew5m")[0]["value"][1])
    assert skew == pytest.approx(0.99 / 0.7, rel=0.01)
    assert query(fleet.base, "training_job:tuneup_ranks:count")[0]["value"][1] == str(NODES * PER_NODE)


@pytest.mark.parametrize("title, expr", ranks_dashboard_queries())
def test_every_ranks_dashboard_panel_returns_data(fleet, title, expr):
    result = query(fleet.base, expr)
    assert result, title
    if expr.startswith(("topk(10, ", "bottomk(10, ")):
        assert len(result) == 10, title  # ten lines, not 512
    if title.startswith(("The 10 slowest", "All-reduce wait")) and expr.startswith(("topk", "bottomk")):
        assert str(STRAGGLER) in [s["metric"]["rank"] for s in result], title


def alert(name: str) -> str:
    groups = yaml.safe_load((PROMETHEUS_RULES / "tuneup-alerts.yml").read_text())["groups"]
    return next(rule["expr"] for group in groups for rule in group["rules"] if rule.get("alert") == name)


def test_the_straggler_and_the_slow_node_ranks_meet_the_straggler_alert(fleet):
    firing = query(fleet.base, alert("TuneupRankStraggler"))
    assert {s["metric"]["rank"] for s in firing} == {str(STRAGGLER)} | SLOW_NODE_RANKS


def test_the_slow_node_alert_fires_from_rank_0s_finding(fleet):
    firing = query(fleet.base, alert("TuneupSlowNode"))
    assert [(s["metric"]["rank"], float(s["value"][1])) for s in firing] == [("0", 0.15)]


def test_the_throughput_drop_meets_its_alert(fleet):
    # 30 minutes of history shortened to 50 s: the drop came 45 s after the fleet started, 50 s
    # ago (wait_past_drop), so the 1m rates 50 s back are from before it, today's mostly after.
    expr = alert("TuneupJobThroughputDropped")
    assert expr.count("offset 30m") == 2
    firing = query(fleet.base, re.sub(r"offset 30m", "offset 50s", expr))
    assert [s["metric"]["training_job"] for s in firing] == ["fleet:10.0.0.1:29500"]
    assert float(firing[0]["value"][1]) < 0.5
