"""The Prometheus files under agents/prometheus: the alert and recording rules pass promtool's
checks and their unit tests, every alert says how long, how bad and what to do, and the example
scrape configurations are valid and load the rules."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_dashboards import documented_metrics, metrics_in

PROMETHEUS = Path(__file__).resolve().parent.parent / "agents" / "prometheus"
RULES = PROMETHEUS / "tuneup-alerts.yml"
RULE_TESTS = PROMETHEUS / "tuneup-alerts.test.yml"
RECORDING = PROMETHEUS / "tuneup-recording.yml"
RECORDING_TESTS = PROMETHEUS / "tuneup-recording.test.yml"
ALERTS = {"TuneupDataStallHigh", "TuneupGradScalerSkipRateHigh", "TuneupGpuIdle", "TuneupRankStraggler",
          "TuneupSlowNode", "TuneupJobThroughputDropped", "TuneupTrainingHung"}
PER_RANK = {"job", "instance", "run_id", "rank"}
# Across the ranks of one training job (recorded series carry no run_id).
RECORDED_RANK = {"job", "training_job", "instance", "rank"}
PER_JOB = {"job", "training_job"}

promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool (Debian package prometheus) not installed")


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120, check=False)


def alerts() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert [group["name"] for group in groups] == ["tuneup"]
    return {rule["alert"]: rule for rule in groups[0]["rules"]}


def recording_rules() -> dict[str, str]:
    groups = yaml.safe_load(RECORDING.read_text())["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


@promtool
def test_recording_rules_pass_promtool_and_their_unit_tests():
    checked = run_promtool("check", "rules", RECORDING.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_promtool("test", "rules", RECORDING_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_recording_rules_are_named_by_level_and_keep_their_level_labels():
    for name, expr in recording_rules().items():
        level = name.split(":")[0]
        assert level in ("rank", "training_job") and name.count(":") == 2, name
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            grouped = {label.strip() for label in labels.split(",")}
            assert grouped == (RECORDED_RANK if level == "rank" else PER_JOB), f"{name}: by ({labels})"


@promtool
def test_promtool_accepts_the_rules():
    checked = run_promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout


@promtool
def test_alert_unit_tests_pass():
    tested = run_promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr


@promtool
def test_scrape_config_is_valid_and_loads_the_rules():
    checked = run_promtool("check", "config", "scrape.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 2 rule files found" in checked.stdout


@promtool
def test_kubernetes_scrape_config_is_valid():
    checked = run_promtool("check", "config", "scrape-kubernetes.yml")
    if "kubernetes_sd_configs not found" in checked.stdout + checked.stderr:
        pytest.skip("this promtool is built without Kubernetes discovery (Debian's is)")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_scrape_configs_scrape_the_daemon_every_15s_and_load_the_alerts():
    for name in ("scrape.yml", "scrape-kubernetes.yml"):
        config = yaml.safe_load((PROMETHEUS / name).read_text())
        assert config["global"]["scrape_interval"] == "15s", name
        assert config["rule_files"] == [RECORDING.name, RULES.name], name
        jobs = [job["job_name"] for job in config["scrape_configs"]]
        assert "tuneup" in jobs and len(jobs) == len(set(jobs)), name
    static = yaml.safe_load((PROMETHEUS / "scrape.yml").read_text())["scrape_configs"]
    daemon_targets = next(job for job in static if job["job_name"] == "tuneup")["static_configs"][0]["targets"]
    assert daemon_targets and all(target.endswith(":9476") for target in daemon_targets)


def test_the_alerts_of_the_spec_are_there():
    assert set(alerts()) == ALERTS


def test_every_alert_says_how_long_how_bad_and_what_to_do():
    for name, rule in alerts().items():
        assert re.fullmatch(r"\d+m", rule["for"]), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
        assert "{{ $labels." in summary and "$value" in summary, name
        assert "tuneup report" in description, name


def test_alert_expressions_are_plain_promql_over_documented_metrics():
    documented = documented_metrics()
    for name, rule in alerts().items():
        expr = rule["expr"]
        assert "$" not in expr, f"{name}: Grafana variables do not exist in Prometheus"
        used = metrics_in(expr)
        assert used and used <= documented, (name, used - documented)
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            grouped = {label.strip() for label in labels.split(",")}
            assert grouped >= PER_RANK or grouped == RECORDED_RANK, f"{name}: by ({labels})"


def test_straggler_alert_uses_the_rule_factor():
    from tuneup.diagnose.rules.distributed import STRAGGLER_FACTOR

    assert f"> {STRAGGLER_FACTOR:g}\n" in alerts()["TuneupRankStraggler"]["expr"]


def test_every_alert_has_a_case_that_fires_and_one_that_must_not():
    fires, quiet = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fires == ALERTS and quiet == ALERTS
