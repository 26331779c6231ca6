"""Builds tuneup's Grafana dashboards (schema 39: Grafana 10 and 11) and writes them beside
this file: `python dashboards/generate.py`.

The queries use only the metrics of docs/metrics.md and only the variables $job,
$training_job, $instance, $rank and $__rate_interval, so tests can run every one of them
against a real Prometheus (`expressions()`, `variable_queries()`).

The overview reads the agents' series; the ranks dashboard reads the recorded series of
agents/prometheus/tuneup-recording.yml (load it in Prometheus), so at 512 or 4,096 ranks it
draws the ten ranks that matter and heatmaps of all of them, never a line per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Every process of every job is its own series: run_id tells two jobs on one node apart when
# they are scraped through the node daemon (and is simply absent when agents are scraped
# directly, which these group-bys do not mind).
SERIES = "job, instance, run_id, rank"
LEGEND = "{{instance}} {{run_id}} rank {{rank}}"
GPU_LEGEND = LEGEND + " gpu {{gpu}}"

# The rank-straggler rule's factor (tuneup/diagnose/rules/distributed.py).
STRAGGLER_FACTOR = 1.15


# --- PromQL ---------------------------------------------------------------------------------

TOP = 10  # ranks a "the N worst ranks" panel draws


def sel(metric: str, *matchers: str) -> str:
    """`metric{...}` narrowed to the dashboard's job, training job, instance and rank variables
    (a series without one of those labels, as a job-level recorded series, matches "All")."""
    labels = ['job=~"$job"', 'training_job=~"$training_job"', 'instance=~"$instance"', 'rank=~"$rank"', *matchers]
    return f"{metric}{{{', '.join(labels)}}}"


def rate(metric: str, *matchers: str, by: str = SERIES) -> str:
    return f"sum by ({by}) (rate({sel(metric, *matchers)}[$__rate_interval]))"


def per(numerator: str, denominator: str, matching: str = "") -> str:
    """numerator / denominator, left out where the denominator is zero (no NaN, no +Inf).
    `matching` as in "ignoring (phase) group_left ()": the empty label list keeps PromQL from
    reading the denominator's parenthesis as group_left's labels."""
    operator = f"/ {matching} " if matching else "/ "
    return f"{numerator}\n{operator}({denominator} > 0)"


def mean_step_seconds() -> str:
    return per(rate("tuneup_step_seconds_sum"), rate("tuneup_step_seconds_count"))


def step_quantile(q: float) -> str:
    return f"histogram_quantile({q:g}, {rate('tuneup_step_seconds_bucket', by=SERIES + ', le')})"


def stall_ratio() -> str:
    return per(rate("tuneup_data_wait_seconds_total"), rate("tuneup_step_seconds_sum"))


def on_used_gpus(metric: str) -> str:
    """A per-GPU metric for the GPUs each process holds memory on. An agent reports every GPU
    it can see, so without this a rank that sees the whole node shows the other ranks' GPUs
    too; where NVML cannot tell which GPU the process uses (no per-process memory, as in many
    containers), all of its GPUs are kept."""
    series = sel(metric)
    used = f"{sel('tuneup_gpu_process_memory_bytes')} > 0"
    return f"(\n  ({series} and on ({SERIES}, gpu) ({used}))\nor\n  ({series} unless on ({SERIES}) ({used}))\n)"


# --- Panels ---------------------------------------------------------------------------------

def target(expr: str, legend: str = LEGEND, ref: str = "A", table: bool = False) -> dict[str, Any]:
    result = {"datasource": DATASOURCE, "editorMode": "code", "expr": expr, "refId": ref}
    if table:
        result.update(format="table", instant=True, range=False)
    else:
        result.update(legendFormat=legend, range=True)
    return result


def targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    """(expr, legend) pairs as targets A, B, C..."""
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def thresholds(*steps: tuple[float, str], base: str = "green") -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": base, "value": None},
                                          *({"color": color, "value": value} for value, color in steps)]}


def on_right_axis(ref: str, unit: str) -> dict[str, Any]:
    """Override: target `ref` drawn against a right-hand axis of its own unit."""
    return {"matcher": {"id": "byFrameRefID", "options": ref},
            "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": unit}]}


def dashed(ref: str) -> dict[str, Any]:
    """Override: target `ref` drawn as a dashed, unfilled line (limits, maxima, totals)."""
    return {"matcher": {"id": "byFrameRefID", "options": ref},
            "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                           {"id": "custom.fillOpacity", "value": 0}]}


def timeseries(title: str, description: str, queries: list[dict[str, Any]], unit: str, *,
               w: int = 12, h: int = 8, stacked: bool = False, minimum: float | None = 0,
               maximum: float | None = None, limits: dict[str, Any] | None = None,
               overrides: list[dict[str, Any]] | None = None, log2: bool = False) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line", "lineWidth": 1, "fillOpacity": 40 if stacked else 10, "showPoints": "never",
        "spanNulls": False, "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
        "thresholdsStyle": {"mode": "dashed" if limits else "off"},
    }
    if log2:
        custom["scaleDistribution"] = {"log": 2, "type": "log"}
    defaults: dict[str, Any] = {"color": {"mode": "palette-classic"}, "custom": custom, "unit": unit,
                                "thresholds": limits or thresholds()}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {"legend": {"calcs": ["lastNotNull", "mean"], "displayMode": "table", "placement": "bottom",
                               "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": queries,
    }


def stat(title: str, description: str, expr: str, unit: str, limits: dict[str, Any], *,
         legend: str = LEGEND, w: int = 6, h: int = 4) -> dict[str, Any]:
    return {
        "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": {"color": {"mode": "thresholds"}, "unit": unit, "thresholds": limits},
                        "overrides": []},
        "options": {"colorMode": "value", "graphMode": "none", "justifyMode": "auto", "orientation": "auto",
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "textMode": "auto"},
        "targets": [target(expr, legend)],
    }


def bargauge(title: str, description: str, expr: str, legend: str, unit: str, limits: dict[str, Any], *,
             maximum: float | None = None, w: int = 12, h: int = 8) -> dict[str, Any]:
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "min": 0, "unit": unit, "thresholds": limits}
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "bargauge", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [target(expr, legend)],
    }


def table(title: str, description: str, expr: str, columns: list[str], *, w: int = 24, h: int = 8,
          overrides: list[dict[str, Any]] | None = None, unit: str = "short") -> dict[str, Any]:
    """An instant query shown as a table of `columns` (label names, then "Value")."""
    return {
        "type": "table", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"align": "auto", "cellOptions": {"type": "auto"}}},
                        "overrides": overrides or []},
        "options": {"cellHeight": "sm", "showHeader": True, "footer": {"show": False, "reducer": ["sum"]}},
        "targets": [target(expr, table=True)],
        # Only the columns named, in that order: instant queries also return Time, __name__, ...
        "transformations": [{"id": "filterFieldsByName", "options": {"include": {"names": columns}}},
                            {"id": "organize", "options": {"indexByName": {name: i for i, name in enumerate(columns)}}}],
    }


def severity_colors() -> dict[str, Any]:
    colors = {"high": "red", "medium": "orange", "low": "blue"}
    return {"matcher": {"id": "byName", "options": "severity"},
            "properties": [{"id": "custom.cellOptions", "value": {"type": "color-text"}},
                           {"id": "mappings", "value": [{"type": "value", "options": {
                               name: {"color": color, "index": i} for i, (name, color) in enumerate(colors.items())}}]}]}


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"h": 1, "w": 24}}


def lay_out(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Places the panels left to right, wrapping at Grafana's 24 columns; a row panel takes a
    line of its own. Numbers the panels in that order."""
    x = y = line_height = 0
    for number, panel in enumerate(panels, start=1):
        panel["id"] = number
        grid = panel["gridPos"]
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, line_height = 0, y + line_height, 0
        grid.update(x=x, y=y)
        if panel["type"] == "row":
            y += grid["h"]
            continue
        x += grid["w"]
        line_height = max(line_height, grid["h"])
    return panels


# --- Dashboards -----------------------------------------------------------------------------

def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query", "name": name, "label": label, "datasource": DATASOURCE,
        "definition": query, "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [], "refresh": 2, "regex": "", "sort": 3 if name == "rank" else 1, "hide": 0,
        "skipUrlSync": False,
    }


def variables() -> list[dict[str, Any]]:
    return [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0, "multi": False,
         "includeAll": False, "skipUrlSync": False},
        query_variable("job", "Job", "label_values(tuneup_run_info, job)"),
        query_variable("training_job", "Training job", 'label_values(tuneup_run_info{job=~"$job"}, training_job)'),
        query_variable("instance", "Instance",
                       'label_values(tuneup_run_info{job=~"$job", training_job=~"$training_job"}, instance)'),
        query_variable("rank", "Rank", 'label_values(tuneup_step_seconds_count{job=~"$job", '
                                       'training_job=~"$training_job", instance=~"$instance"}, rank)'),
    ]


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": None, "uid": uid, "title": title, "description": description,
        "tags": ["tuneup", "pytorch", "training"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "", "timepicker": {},
        "fiscalYearStartMonth": 0, "weekStart": "", "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        # The other tuneup dashboard, with the same variables and time range.
        "links": [{"title": "tuneup", "type": "dashboards", "tags": ["tuneup"], "asDropdown": False,
                   "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False,
                   "tooltip": "", "url": ""}],
        "templating": {"list": variables()},
        "panels": lay_out(panels),
    }


def overview() -> dict[str, Any]:
    return dashboard("tuneup-overview", "tuneup — training overview",
                     "Where each training step's time goes, and what tuneup found (docs/metrics.md).", [
        row("Jobs"),
        table("Runs", "Every job with tuneup attached (tuneup_run_info).", sel("tuneup_run_info"),
              ["job", "instance", "run_id", "rank", "script", "mode", "world_size", "tuneup_version",
               "torch_version"], w=24, h=6),
        stat("Time since the last step", "A hung job stops moving it (alert TuneupTrainingHung at 10 min). "
             "Only jobs that made a step.",
             f"time() - {sel('tuneup_last_step_time_seconds')}\n"
             f"and on ({SERIES}) ({sel('tuneup_step_seconds_count')} > 0)",
             "s", thresholds((60, "yellow"), (600, "red")), w=12),
        stat("Agent probes off", "Probes that turned themselves off after a failure (tuneup_probe_up == 0); "
             "the agent's warning says why.",
             f"count({sel('tuneup_probe_up')} == 0) or vector(0)", "short",
             thresholds((1, "orange")), legend="probes off", w=6),
        stat("Findings now", "Findings active now, all severities; the table below lists them.",
             f"count({sel('tuneup_finding_active')}) or vector(0)", "short",
             thresholds((1, "orange")), legend="findings", w=6),
        table("Active findings", "tuneup's findings active now; `tuneup report` on the instance gives the "
              "evidence and the fix.", sel("tuneup_finding_active"),
              ["job", "instance", "run_id", "rank", "rule", "severity"], w=14, overrides=[severity_colors()]),
        bargauge("Estimated gain of the findings", "Share of step time each finding's fix would save.",
                 f"max by ({SERIES}, rule) ({sel('tuneup_finding_gain_ratio')})", "{{rule}} " + LEGEND,
                 "percentunit", thresholds((0.05, "yellow"), (0.2, "orange"), base="blue"), maximum=1, w=10),

        row("Step time"),
        timeseries("Step time breakdown by phase",
                   "Seconds per step in each phase (stacked), from the detail steps: data_wait, forward, "
                   "backward, optimizer, other (your loop's own code). Stacks every series shown: pick one "
                   "instance and rank to read one job's step.",
                   targets((per(rate("tuneup_step_phase_seconds_total", by=SERIES + ", phase"),
                                rate("tuneup_detail_steps_total"), "ignoring (phase) group_left ()"),
                            "{{phase}} " + LEGEND)),
                   "s", stacked=True),
        timeseries("Step time", "Mean step time (histogram sum / count) and the p50 / p90 step "
                   "(histogram_quantile over tuneup_step_seconds_bucket).",
                   targets((mean_step_seconds(), "mean " + LEGEND),
                           (step_quantile(0.5), "p50 " + LEGEND),
                           (step_quantile(0.9), "p90 " + LEGEND)), "s"),
        timeseries("Data stall", "Share of step time the loop waited on the DataLoader. tuneup's data-stall "
                   "rule flags 10%, the TuneupDataStallHigh alert 20%.",
                   targets((stall_ratio(), LEGEND)), "percentunit",
                   limits=thresholds((0.1, "yellow"), (0.2, "red"))),
        timeseries("Host-device syncs per step", "Syncs on the sampled steps (on CPU jobs: host reads that "
                   "would sync on a GPU). One per step already drains the GPU's queue every step.",
                   targets((per(rate("tuneup_syncs_total"), rate("tuneup_sync_sampled_steps_total")), LEGEND)),
                   "short", limits=thresholds((1, "yellow"))),

        row("Mixed precision (GradScaler)"),
        timeseries("GradScaler loss scale", "The current loss scale (log2 axis). A collapsing scale means "
                   "gradients overflow in fp16; below 1 they overflow even unscaled.",
                   targets((sel("tuneup_grad_scaler_scale"), LEGEND)), "short", minimum=None, log2=True),
        timeseries("GradScaler skipped steps", "Share of scaler steps skipped for inf/NaN gradients (left "
                   "axis) and skipped steps per second (right axis). A healthy scaler skips about 1 step "
                   "in 2000; tuneup flags 2%, the TuneupGradScalerSkipRateHigh alert 5%.",
                   targets((per(rate("tuneup_grad_scaler_skipped_steps_total"),
                                rate("tuneup_grad_scaler_steps_total")), "skip rate " + LEGEND),
                           (rate("tuneup_grad_scaler_skipped_steps_total"), "skipped/s " + LEGEND)),
                   "percentunit", limits=thresholds((0.02, "yellow"), (0.05, "red")),
                   overrides=[on_right_axis("B", "short")]),

        row("GPU"),
        timeseries("Model FLOPs utilization", "Achieved FLOP/s (the step's FLOPs, counted on the model's "
                   "shapes, over the measured step time, data waits included) over the device's dense peak "
                   "for the step's precision (left axis), and the achieved FLOP/s (right axis). NVML's "
                   "utilization above says a kernel ran; this says how much of the chip the work used. "
                   "No MFU where tuneup has no peak for the device (CPU included).",
                   targets((sel("tuneup_model_flops_utilization"), "MFU {{precision}} " + LEGEND),
                           (sel("tuneup_achieved_flops_per_second"), "FLOP/s " + LEGEND)),
                   "percentunit", maximum=1, overrides=[on_right_axis("B", "flops")]),
        timeseries("GPU utilization", "Share of the sample period a kernel ran, on the GPUs each process "
                   "holds memory on (all its visible GPUs where NVML cannot tell).",
                   targets((on_used_gpus("tuneup_gpu_utilization_ratio"), GPU_LEGEND)),
                   "percentunit", maximum=1),
        timeseries("GPU memory", "Device memory in use (all processes), held by this job's process, and the "
                   "device's size (dashed).",
                   targets((on_used_gpus("tuneup_gpu_memory_used_bytes"), "used " + GPU_LEGEND),
                           (f"{sel('tuneup_gpu_process_memory_bytes')} > 0", "this process " + GPU_LEGEND),
                           (on_used_gpus("tuneup_gpu_memory_total_bytes"), "total " + GPU_LEGEND)),
                   "bytes", overrides=[dashed("C")]),
        timeseries("GPU power", "Power draw and the enforced power limit (dashed).",
                   targets((on_used_gpus("tuneup_gpu_power_watts"), "draw " + GPU_LEGEND),
                           (on_used_gpus("tuneup_gpu_power_limit_watts"), "limit " + GPU_LEGEND)),
                   "watt", w=8, overrides=[dashed("B")]),
        timeseries("SM clock", "SM clock and its maximum (dashed); held below the maximum while the GPU "
                   "throttles.",
                   targets((on_used_gpus("tuneup_gpu_sm_clock_hertz"), "clock " + GPU_LEGEND),
                           (on_used_gpus("tuneup_gpu_sm_clock_max_hertz"), "max " + GPU_LEGEND)),
                   "hertz", w=8, overrides=[dashed("B")]),
        timeseries("GPU temperature and throttling", "Temperature (left axis), and how many reasons hold "
                   "the clocks down now (right axis; 0 = none). The reasons: tuneup_gpu_throttled == 1 in "
                   "Explore, or `tuneup report`.",
                   targets((on_used_gpus("tuneup_gpu_temperature_celsius"), GPU_LEGEND),
                           (f"sum by ({SERIES}, gpu) {on_used_gpus('tuneup_gpu_throttled')}",
                            "throttle reasons " + GPU_LEGEND)),
                   "celsius", w=8, overrides=[on_right_axis("B", "short")]),

        row("Throughput and loss"),
        timeseries("Throughput", "Samples per second (left axis) and steps per second (right axis).",
                   targets((rate("tuneup_samples_total"), "samples/s " + LEGEND),
                           (rate("tuneup_step_seconds_count"), "steps/s " + LEGEND)),
                   "short", overrides=[on_right_axis("B", "short")]),
        timeseries("Loss", "The last loss read (NaN when it was not finite), and the non-finite losses "
                   "read per rate interval (right axis).",
                   targets((sel("tuneup_loss"), "loss " + LEGEND),
                           (f"sum by ({SERIES}) (increase({sel('tuneup_nonfinite_losses_total')}[$__rate_interval]))",
                            "non-finite " + LEGEND)),
                   "short", minimum=None, overrides=[on_right_axis("B", "short")]),

        row("Memory and input pipeline"),
        timeseries("CUDA caching allocator", "Memory held by tensors (allocated) and by the allocator "
                   "(reserved: tensors + cache), per CUDA device.",
                   targets((sel("tuneup_cuda_memory_allocated_bytes"), "allocated " + GPU_LEGEND),
                           (sel("tuneup_cuda_memory_reserved_bytes"), "reserved " + GPU_LEGEND)), "bytes"),
        timeseries("DataLoader workers", "Live worker processes, the CPU they use together (cores), and the "
                   "cores the job may use (dashed).",
                   targets((sel("tuneup_dataloader_workers"), "workers " + LEGEND),
                           (sel("tuneup_dataloader_workers_cpu_ratio"), "worker CPU (cores) " + LEGEND),
                           (sel("tuneup_usable_cores"), "usable cores " + LEGEND)),
                   "short", overrides=[dashed("C")]),

        row("Apply mode"),
        timeseries("Apply mode: changes in effect", "Changes apply mode made that are in effect now (on "
                   "trial or kept), by action.",
                   targets((f"sum by ({SERIES}, action) ({sel('tuneup_apply_changes_in_effect')})",
                            "{{action}} " + LEGEND)), "short", w=8),
        timeseries("Apply mode: measured speed-up", "Mean step time before / after the kept changes in "
                   "effect, by action (1 = no change).",
                   targets((sel("tuneup_apply_speedup_ratio"), "{{action}} " + LEGEND)), "short",
                   minimum=None, w=8),
        table("Apply mode: decisions", "Changes apply mode tried, by action and how it decided "
              "(kept, reverted, rolled_back, failed, not_applicable, stopped), since the job started.",
              f"sum by ({SERIES}, action, decision) ({sel('tuneup_apply_decisions_total')})",
              ["instance", "run_id", "rank", "action", "decision", "Value"], w=8),
    ])


def top(k: str, expr: str) -> str:
    """The TOP series of `expr` by value (k: "topk" for the highest, "bottomk" the lowest)."""
    return f"{k}({TOP}, {expr})"


def heatmap(title: str, description: str, expr: str, unit: str, *, w: int = 12, h: int = 8) -> dict[str, Any]:
    """Every rank's value as a heatmap over time (Grafana buckets the series itself): 4,096
    ranks in one panel, outliers standing out as the cells far from the band."""
    return {
        "type": "heatmap", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"hideFrom": {"legend": False, "tooltip": False,
                                                                          "viz": False},
                                                             "scaleDistribution": {"type": "linear"}}},
                        "overrides": []},
        "options": {"calculate": True, "calculation": {"yBuckets": {"mode": "count", "value": "20"}},
                    "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential",
                                            "exponent": 0.5, "steps": 64, "fill": "dark-orange", "reverse": False},
                    "yAxis": {"axisPlacement": "left", "unit": unit}, "legend": {"show": True},
                    "tooltip": {"mode": "single", "yHistogram": True}, "cellValues": {"unit": "short"},
                    "rowsFrame": {"layout": "auto"}, "exemplars": {"color": "rgba(255,0,255,0.7)"},
                    "filterValues": {"le": 1e-9}, "showValue": "never"},
        "targets": [target(expr, RANK_LEGEND)],
    }


RANK_LEGEND = "{{training_job}} rank {{rank}} ({{instance}})"
JOB_LEGEND = "{{training_job}}"


def ranks() -> dict[str, Any]:
    factor = f"{STRAGGLER_FACTOR:g}"
    ratio = sel("rank:tuneup_own_seconds_per_step:ratio_to_median5m")
    two_ranks_or_more = f"{sel('training_job:tuneup_ranks:count')} >= 2"
    return dashboard("tuneup-ranks", "tuneup — ranks",
                     "Distributed jobs, from 2 ranks to thousands: the job's pace, who is slow, and why. "
                     "Reads the recorded series of agents/prometheus/tuneup-recording.yml.", [
        row("The job"),
        stat("Ranks stepping", "Ranks of the training job that made steps in the last minute.",
             sel("training_job:tuneup_ranks:count"), "short", thresholds(), legend=JOB_LEGEND, w=6),
        stat("Steps per second", "The job's pace (its ranks' mean: DDP ranks step together).",
             sel("training_job:tuneup_steps:rate1m"), "short", thresholds(), legend=JOB_LEGEND, w=6),
        stat("Samples per second", "The job's throughput: every rank's samples together.",
             sel("training_job:tuneup_samples:rate1m"), "short", thresholds(), legend=JOB_LEGEND, w=6),
        stat("Step-time skew", f"The slowest rank's time outside the all-reduce over the median rank's. "
             f"Above {factor} the job runs at a straggler's pace.",
             sel("training_job:tuneup_own_seconds_per_step:skew5m"), "short",
             thresholds((STRAGGLER_FACTOR, "red")), legend=JOB_LEGEND, w=6),
        timeseries("Pace and skew", "Steps per second of each job (left) and its step-time skew (right).",
                   targets((sel("training_job:tuneup_steps:rate1m"), JOB_LEGEND + " steps/s"),
                           (sel("training_job:tuneup_own_seconds_per_step:skew5m"), JOB_LEGEND + " skew")),
                   "short", w=12, overrides=[on_right_axis("B", "short")]),
        timeseries("Data stall", "Share of the job's step time spent waiting on DataLoaders: the job's "
                   "(solid) and its worst rank's (dashed).",
                   targets((sel("training_job:tuneup_data_stall:ratio1m"), JOB_LEGEND),
                           (sel("training_job:tuneup_data_stall:max_rank_ratio1m"), JOB_LEGEND + " worst rank")),
                   "percentunit", limits=thresholds((0.1, "yellow"), (0.2, "red")), w=12, overrides=[dashed("B")]),

        row("Who is slow"),
        timeseries(f"The {TOP} slowest ranks: own time over the job's median rank",
                   f"Step time outside the all-reduce wait (less the wait DDP's timers measured, else "
                   f"less the backward), over the median rank of the job. Above {factor} the rank is a "
                   f"straggler (tuneup's rank-straggler rule, alert TuneupRankStraggler).",
                   targets((top("topk", ratio), RANK_LEGEND)), "short", minimum=None,
                   limits=thresholds((STRAGGLER_FACTOR, "red"))),
        heatmap("Own time over the median, every rank", "Each cell counts the ranks whose own time over "
                "the job's median falls in its band: a healthy job is one bright band at 1; a straggler "
                "or a slow node is a few cells above it.", ratio, "short"),
        timeseries(f"All-reduce wait: the {TOP} ranks that wait least (DDP)",
                   "Time per step each rank sat in DDP's all-reduce after its own gradients were ready "
                   "(DDP's own timers). Everyone waits for the slowest rank, so the rank that waits "
                   "least is the one the others wait for.",
                   targets((top("bottomk", sel("tuneup_ddp_allreduce_wait_seconds")), RANK_LEGEND),
                           (sel("training_job:tuneup_ddp_allreduce_wait_seconds:min"), JOB_LEGEND + " least")),
                   "s", overrides=[dashed("B")]),
        table(f"Stragglers (own time > {factor} x the job's median rank)",
              "Ranks slower than the others of their job right now (jobs of two ranks or more). Value: "
              "own time over the median.",
              f"{ratio} > {factor}\nand on (job, training_job)\n({two_ranks_or_more})",
              ["job", "training_job", "instance", "rank", "Value"], w=12, unit="short"),

        row("Why a rank is slow"),
        timeseries(f"Data stall: the {TOP} worst ranks", "Share of step time each rank waited on its "
                   "DataLoader.", targets((top("topk", sel("rank:tuneup_data_stall:ratio1m")), RANK_LEGEND)),
                   "percentunit", limits=thresholds((0.1, "yellow"), (0.2, "red")), w=8),
        timeseries(f"Throughput: the {TOP} slowest ranks", "Samples per second each rank trains on.",
                   targets((top("bottomk", sel("rank:tuneup_samples:rate1m")), RANK_LEGEND)), "short", w=8),
        timeseries(f"GPU utilization: the {TOP} least busy ranks", "Busiest GPU each rank holds memory on.",
                   targets((top("bottomk", sel("rank:tuneup_gpu_utilization:max")), RANK_LEGEND)),
                   "percentunit", maximum=1, w=8),
        heatmap("Step time, every rank", "Each rank's mean step time: in DDP the ranks step together, so "
                "one band; ranks of another speed are another job or a rank that left the all-reduce.",
                sel("rank:tuneup_step_seconds:mean1m"), "s"),
        heatmap("GPU utilization, every rank", "Each rank's busiest own GPU.",
                sel("rank:tuneup_gpu_utilization:max"), "percentunit"),
    ])


DASHBOARDS = {"tuneup-overview.json": overview, "tuneup-ranks.json": ranks}


def build() -> dict[str, dict[str, Any]]:
    """File name -> dashboard."""
    return {name: make() for name, make in DASHBOARDS.items()}


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def expressions() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every panel query of both dashboards."""
    return [(board["uid"], panel["title"], query["expr"])
            for board in build().values() for panel in board["panels"] for query in panel.get("targets", [])]


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, variable name, query) for the Prometheus query variables."""
    return [(board["uid"], variable["name"], variable["query"]["query"])
            for board in build().values() for variable in board["templating"]["list"]
            if variable["type"] == "query"]


def main() -> int:
    for name, board in build().items():
        (HERE / name).write_text(render(board), encoding="utf-8")
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
