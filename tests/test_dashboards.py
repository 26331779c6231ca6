"""The Grafana dashboards (dashboards/generate.py): the committed JSON is what the script
builds, every query goes through the datasource variable, filters by the job/training job/
instance/rank variables and uses only documented metrics, and the key queries compute what
their panels say (checked with promtool's PromQL engine on made-up series, where promtool is
installed; the ranks dashboard's over the recording rules it reads)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
ALLOWED_VARIABLES = {"job", "training_job", "instance", "rank", "__rate_interval"}
SELECTORS = ("job", "training_job", "instance", "rank")
PER_PROCESS = {"job", "instance", "run_id", "rank"}
RECORDING = ROOT / "agents" / "prometheus" / "tuneup-recording.yml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def load_generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARDS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_generator()
BOARDS = generate.build()


# A metric name: the agents' (tuneup_...) or a recorded series of tuneup-recording.yml
# (level:tuneup_...:operations).
METRIC = r"(?<![\w:])(?:[a-z_]+:)?tuneup_[a-z_]+(?::[a-z0-9_]+)?"


def documented_metrics() -> set[str]:
    """Metric names of docs/metrics.md's tables, with _bucket/_sum/_count for histograms."""
    names = set()
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        match = re.match(rf"\|\s*`({METRIC})`\s*\|\s*([a-z]+)", line)
        if match:
            name, kind = match.groups()
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return names


def metrics_in(expr: str) -> set[str]:
    return set(re.findall(METRIC, expr))


def substituted(expr: str, interval: str = "1m") -> str:
    """The expression as Grafana sends it with every variable at All."""
    for name in SELECTORS:
        expr = expr.replace(f"${name}", ".*")
    return expr.replace("$__rate_interval", interval)


def board(uid: str) -> dict:
    return next(b for b in BOARDS.values() if b["uid"] == uid)


def panels(uid: str) -> list[dict]:
    return [p for p in board(uid)["panels"] if p["type"] != "row"]


def test_committed_json_is_what_generate_builds():
    for name, built in BOARDS.items():
        committed = DASHBOARDS / name
        assert committed.exists(), f"{name} missing: run python dashboards/generate.py"
        assert committed.read_text(encoding="utf-8") == generate.render(built), \
            f"{name} drifted from generate.py: run python dashboards/generate.py"


def test_generate_is_deterministic():
    assert {name: generate.render(b) for name, b in generate.build().items()} == \
           {name: generate.render(b) for name, b in BOARDS.items()}


def test_dashboards_identify_themselves():
    assert {b["uid"]: b["title"] for b in BOARDS.values()} == {
        "tuneup-overview": "tuneup — training overview", "tuneup-ranks": "tuneup — ranks"}
    for b in BOARDS.values():
        assert b["schemaVersion"] == 39
        assert "tuneup" in b["tags"]


def test_datasource_is_a_variable_not_an_import_input():
    for name, b in BOARDS.items():
        text = (DASHBOARDS / name).read_text(encoding="utf-8")
        assert "__inputs" not in text and "${DS_" not in text, name
        datasource = [v for v in b["templating"]["list"] if v["name"] == "datasource"]
        assert datasource and datasource[0]["type"] == "datasource" and datasource[0]["query"] == "prometheus"


def test_every_panel_and_target_queries_through_the_datasource_variable():
    for b in BOARDS.values():
        for panel in b["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == DATASOURCE, panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == DATASOURCE, panel["title"]
        for variable in b["templating"]["list"]:
            if variable["type"] == "query":
                assert variable["datasource"] == DATASOURCE, variable["name"]


def test_job_instance_rank_variables_are_multi_select_and_chained():
    for b in BOARDS.values():
        variables = {v["name"]: v for v in b["templating"]["list"]}
        assert list(variables) == ["datasource", *SELECTORS]
        for name in SELECTORS:
            v = variables[name]
            assert (v["type"], v["multi"], v["includeAll"], v["allValue"]) == ("query", True, True, ".*"), name
            assert v["definition"] == v["query"]["query"]
        for later, earlier in (("training_job", "job"), ("instance", "training_job"), ("rank", "instance")):
            assert f"${earlier}" in variables[later]["definition"], later


def test_expressions_lists_every_target_of_both_dashboards():
    listed = generate.expressions()
    targets = [t["expr"] for b in BOARDS.values() for p in b["panels"] for t in p.get("targets", [])]
    assert [expr for _, _, expr in listed] == targets
    assert {uid for uid, _, _ in listed} == {"tuneup-overview", "tuneup-ranks"}
    assert len(generate.variable_queries()) == 8


def test_expressions_use_only_the_allowed_variables():
    queries = [expr for _, _, expr in generate.expressions()] + [q for _, _, q in generate.variable_queries()]
    for expr in queries:
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= ALLOWED_VARIABLES, (used - ALLOWED_VARIABLES, expr)


def test_every_selector_filters_by_job_training_job_instance_and_rank():
    for _, title, expr in generate.expressions():
        for metric, labels in re.findall(rf"({METRIC})(\{{[^}}]*\}})?", expr):
            for name in SELECTORS:
                assert f'{name}=~"${name}"' in labels, f"{title}: {metric} lacks {name}"


def test_group_bys_keep_every_process_apart():
    for _, title, expr in generate.expressions():
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            grouped = {label.strip() for label in labels.split(",")} - {"le", "phase", "gpu", "rule", "action",
                                                                         "decision"}
            assert grouped >= PER_PROCESS, f"{title}: by ({labels})"


def test_the_ranks_dashboard_reads_recorded_series_and_draws_no_line_per_rank():
    # At 4,096 ranks a panel may draw the TOP ranks that matter, a heatmap, or job-level series.
    recorded = {rule["record"] for group in yaml.safe_load(RECORDING.read_text())["groups"] for rule in group["rules"]}
    for p in panels("tuneup-ranks"):
        for t in p["targets"]:
            used = metrics_in(t["expr"])
            raw = {m for m in used if ":" not in m} - {"tuneup_ddp_allreduce_wait_seconds"}
            assert not raw, f"{p['title']}: raw series {raw}"
            assert used <= recorded | {"tuneup_ddp_allreduce_wait_seconds"}, p["title"]
            per_rank = any(m.startswith("rank:") or m == "tuneup_ddp_allreduce_wait_seconds" for m in used)
            if per_rank and p["type"] == "timeseries":
                assert re.match(rf"(topk|bottomk)\({generate.TOP}, ", t["expr"]), p["title"]


def test_rates_use_the_rate_interval():
    for _, title, expr in generate.expressions():
        for window in re.findall(r"\b(?:rate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", title


def test_every_metric_queried_is_documented():
    documented = documented_metrics()
    assert {"tuneup_step_seconds_bucket", "tuneup_finding_active"} <= documented  # the parser works
    queries = [expr for _, _, expr in generate.expressions()] + [q for _, _, q in generate.variable_queries()]
    for expr in queries:
        assert metrics_in(expr) <= documented, (metrics_in(expr) - documented, expr)


def test_overview_covers_the_spec():
    queried = set().union(*(metrics_in(e) for uid, _, e in generate.expressions() if uid == "tuneup-overview"))
    covered = {
        "phase breakdown": "tuneup_step_phase_seconds_total",
        "stall": "tuneup_data_wait_seconds_total",
        "syncs per step": "tuneup_syncs_total",
        "scaler scale": "tuneup_grad_scaler_scale",
        "scaler skips": "tuneup_grad_scaler_skipped_steps_total",
        "GPU utilization": "tuneup_gpu_utilization_ratio",
        "GPU memory": "tuneup_gpu_memory_used_bytes",
        "GPU power": "tuneup_gpu_power_watts",
        "throughput": "tuneup_samples_total",
        "findings": "tuneup_finding_active",
    }
    missing = {topic for topic, metric in covered.items() if metric not in queried}
    assert not missing


def test_ranks_view_has_the_job_the_slowest_ranks_and_stragglers():
    expressions = {title: expr for uid, title, expr in generate.expressions() if uid == "tuneup-ranks"}
    assert "training_job:tuneup_own_seconds_per_step:skew5m" in expressions["Step-time skew"]
    stragglers = next(expr for title, expr in expressions.items() if title.startswith("Stragglers"))
    assert "rank:tuneup_own_seconds_per_step:ratio_to_median5m" in stragglers and "> 1.15" in stragglers
    kinds = {p["type"] for p in panels("tuneup-ranks")}
    assert {"heatmap", "stat", "table", "timeseries"} <= kinds


def test_straggler_factor_is_the_rules():
    from tuneup.diagnose.rules.distributed import STRAGGLER_FACTOR

    assert generate.STRAGGLER_FACTOR == STRAGGLER_FACTOR


def test_panels_have_units_and_do_not_overlap():
    for b in BOARDS.values():
        ids = [p["id"] for p in b["panels"]]
        assert len(ids) == len(set(ids)), b["uid"]
        cells = set()
        for p in b["panels"]:
            grid = p["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
            mine = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
            assert not cells & mine, f"{p['title']} overlaps another panel"
            cells |= mine
            if p["type"] in ("timeseries", "stat", "bargauge"):
                assert p["fieldConfig"]["defaults"]["unit"] in {"s", "percentunit", "short", "bytes", "watt",
                                                                "hertz", "celsius"}, p["title"]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels("tuneup-overview")}
    assert (units["Data stall"], units["GPU memory"], units["GPU power"], units["SM clock"]) == \
           ("percentunit", "bytes", "watt", "hertz")


def test_tables_are_instant_table_queries():
    for b in BOARDS.values():
        for p in b["panels"]:
            if p["type"] == "table":
                assert all(t["format"] == "table" and t["instant"] for t in p["targets"]), p["title"]


# --- the queries, computed -------------------------------------------------------------------

promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool (Debian package prometheus) not installed")


def run_promtool(tmp_path: Path, rules: list[dict], tests: list[dict] | None = None,
                 recorded: bool = False) -> subprocess.CompletedProcess:
    """promtool on the expressions as recording rules (JSON is YAML); `recorded`: with
    tuneup's own recording rules loaded first (what the ranks dashboard reads)."""
    (tmp_path / "rules.yml").write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))
    if tests is None:
        return subprocess.run(["promtool", "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True,
                              text=True, check=False)
    (tmp_path / "test.yml").write_text(json.dumps({"rule_files": [str(RECORDING)] * recorded + ["rules.yml"],
                                                   "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                          check=False)


@promtool
def test_every_query_parses(tmp_path):
    queries = [expr for _, _, expr in generate.expressions()]
    queries += [re.sub(r"label_values\((.*), \w+\)$", r"\1", q) for _, _, q in generate.variable_queries()]
    rules = [{"record": f"dashboard:query_{i}", "expr": substituted(q)} for i, q in enumerate(queries)]
    checked = run_promtool(tmp_path, rules)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def series(metric: str, values: str, **labels: str) -> dict:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{inner}}}", "values": values}


def ddp_rank(rank: int, instance: str, forward: float, backward: float) -> list[dict]:
    """A rank of training job ddp-1 stepping once a second, every 4th step a detail step (15 a
    minute) with 0.125 s data wait and the given forward and backward seconds (binary
    fractions: promtool compares exactly)."""
    labels = {"job": "ddp", "training_job": "ddp-1", "instance": instance, "run_id": f"r{rank}", "rank": str(rank),
              "local_rank": "0"}
    return [series("tuneup_detail_steps_total", "0+15x30", **labels),
            series("tuneup_step_seconds_sum", "0+60x30", **labels),
            series("tuneup_step_seconds_count", "0+60x30", **labels),
            series("tuneup_samples_total", "0+1920x30", **labels),
            series("tuneup_data_wait_seconds_total", "0+7.5x30", **labels),
            series("tuneup_step_phase_seconds_total", "0+1.875x30", phase="data_wait", **labels),
            series("tuneup_step_phase_seconds_total", f"0+{forward * 15:g}x30", phase="forward", **labels),
            series("tuneup_step_phase_seconds_total", f"0+{backward * 15:g}x30", phase="backward", **labels)]


def sample(value: float, **labels: str) -> dict:
    return {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "value": value}


@promtool
def test_rank_queries_find_the_straggler(tmp_path):
    # Ranks 0-2 need 0.5 s of their own per step, rank 3 0.75 s (1.5x); every whole step is 1 s,
    # the fast ranks waiting for rank 3 in the backward. The panels read the recorded series.
    inputs = (ddp_rank(0, "node1:9476", 0.375, 0.5) + ddp_rank(1, "node1:9476", 0.375, 0.5)
              + ddp_rank(2, "node2:9476", 0.375, 0.5) + ddp_rank(3, "node2:9476", 0.625, 0.25))
    titles = {"Ranks stepping": "ranks", "Step-time skew": "skew",
              "The 10 slowest ranks: own time over the job's median rank": "slowest",
              "Stragglers (own time > 1.15 x the job's median rank)": "stragglers",
              "Data stall: the 10 worst ranks": "stall"}
    queries = {titles[title]: expr for uid, title, expr in generate.expressions()
               if uid == "tuneup-ranks" and title in titles}
    assert set(queries) == set(titles.values())
    rules = [{"record": f"ranks:{name}", "expr": substituted(expr, "5m")} for name, expr in queries.items()]

    def process(rank: int, instance: str) -> dict:
        return {"job": "ddp", "training_job": "ddp-1", "instance": instance, "rank": str(rank)}

    job = {"job": "ddp", "training_job": "ddp-1"}
    ranks = [process(0, "node1:9476"), process(1, "node1:9476"), process(2, "node2:9476"), process(3, "node2:9476")]
    expected = {
        "ranks": [sample(4, **job)],
        "skew": [sample(1.5, **job)],
        "slowest": [sample(1, **p) for p in ranks[:3]] + [sample(1.5, **ranks[3])],
        "stragglers": [sample(1.5, **ranks[3])],
        "stall": [sample(0.125, **p) for p in ranks],
    }
    checked = run_promtool(tmp_path, rules, [{
        "interval": "1m", "input_series": inputs,
        "promql_expr_test": [{"expr": f"ranks:{name}", "eval_time": "20m",
                              "exp_samples": [dict(s, labels=f"ranks:{name}" + s["labels"]) for s in samples]}
                             for name, samples in expected.items()],
    }], recorded=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@promtool
def test_overview_breakdown_stall_and_gpu_queries(tmp_path):
    process = {"job": "tuneup", "instance": "node1:9476", "run_id": "a1", "rank": "0", "local_rank": "0"}
    other = dict(process, run_id="b2", rank="1", local_rank="1")
    starting = dict(process, instance="node2:9476", run_id="c3")
    inputs = [
        # a1 waits 15 s of every 60 s of steps; c3 waits but has not finished a step yet.
        series("tuneup_data_wait_seconds_total", "0+15x30", **process),
        series("tuneup_step_seconds_sum", "0+60x30", **process),
        series("tuneup_data_wait_seconds_total", "0+30x30", **starting),
        series("tuneup_step_seconds_sum", "0x30", **starting),
        series("tuneup_detail_steps_total", "0+15x30", **process),
        series("tuneup_step_phase_seconds_total", "0+3x30", phase="forward", **process),
        series("tuneup_step_phase_seconds_total", "0+6x30", phase="backward", **process),
        # a1 holds memory on GPU 0 only; it sees GPU 1 too, where b2 trains.
        series("tuneup_gpu_utilization_ratio", "0.25x30", gpu="0", **process),
        series("tuneup_gpu_process_memory_bytes", "1e9x30", gpu="0", **process),
        series("tuneup_gpu_utilization_ratio", "0.75x30", gpu="1", **process),
        series("tuneup_gpu_process_memory_bytes", "0x30", gpu="1", **process),
        # b2 runs where NVML cannot tell processes apart: all its GPUs count.
        series("tuneup_gpu_utilization_ratio", "0.25x30", gpu="0", **other),
        series("tuneup_gpu_utilization_ratio", "0.75x30", gpu="1", **other),
    ]
    queries = {title: expr for uid, title, expr in generate.expressions() if uid == "tuneup-overview"}
    rules = [{"record": "overview:breakdown", "expr": substituted(queries["Step time breakdown by phase"], "5m")},
             {"record": "overview:gpu_utilization", "expr": substituted(queries["GPU utilization"])},
             {"record": "overview:stall", "expr": substituted(queries["Data stall"], "5m")}]
    a1 = {k: v for k, v in process.items() if k != "local_rank"}
    checked = run_promtool(tmp_path, rules, [{
        "interval": "1m", "input_series": inputs,
        "promql_expr_test": [
            {"expr": 'overview:breakdown{run_id="a1"}', "eval_time": "20m",
             "exp_samples": [sample(0.2, __name__="overview:breakdown", phase="forward", **a1),
                             sample(0.4, __name__="overview:breakdown", phase="backward", **a1)]},
            {"expr": "overview:gpu_utilization", "eval_time": "20m",
             "exp_samples": [sample(0.25, __name__="overview:gpu_utilization", gpu="0", **process),
                             sample(0.25, __name__="overview:gpu_utilization", gpu="0", **other),
                             sample(0.75, __name__="overview:gpu_utilization", gpu="1", **other)]},
            {"expr": "overview:stall", "eval_time": "20m",  # c3: no ratio, rather than +Inf
             "exp_samples": [sample(0.25, __name__="overview:stall", **a1)]},
        ],
    }])
    assert checked.returncode == 0, checked.stdout + checked.stderr
