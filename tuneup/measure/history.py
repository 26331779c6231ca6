"""A run as its event stream: the run log's events, held in memory or read back from disk.

Rules and reports read a run only through `RunHistory`, built from the same events whether
they come from a live agent (its in-memory copy, over its loopback endpoint) or from the
run log after the job ended, so both give the same findings and the same report.

Memory is bounded: past `max_intervals` interval summaries, the older half is merged pair
by pair (sums add; medians become step-weighted medians of medians), so recent intervals
stay fine-grained for the window the rules read, and old ones coarsen for the plots.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from statistics import median
from typing import Any, Iterable, Sequence

from .utilization import energy, utilization
from .windows import PARTS, SPLIT, Totals, samples_per_batch, samples_rate

MAX_INTERVALS = 1024
MAX_SYSTEM_SAMPLES = 1024
# The first steps (allocator warm-up, GradScaler's scale search, cuDNN autotuning) are left
# out of the window the rules read when enough later steps exist.
WARMUP_STEPS = 20
MIN_WINDOW_STEPS = 50


def weighted_median(pairs: Sequence[tuple[float, float]], q: float = 0.5) -> float | None:
    """The q-quantile of values given as (value, weight) pairs."""
    pairs = sorted((value, weight) for value, weight in pairs if value is not None and weight > 0)
    total = sum(weight for _, weight in pairs)
    if not total:
        return None
    running = 0.0
    for value, weight in pairs:
        running += weight
        if running >= q * total:
            return value
    return pairs[-1][0]


def _median_of(intervals: Sequence[dict[str, Any]], field: str, weight: str = "steps", key: str = "median"):
    pairs = [((entry.get(field) or {}).get(key), entry["sums"].get(weight, entry["steps"]))
             for entry in intervals if entry.get(field)]
    return weighted_median(pairs) if pairs else None


def combine(intervals: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One summary (the shape of windows.summarize's) of consecutive interval summaries.
    Sums, means and ratios are exact; medians and the p90 are step-weighted medians of the
    intervals' own (exact when there is one interval)."""
    intervals = [entry for entry in intervals if entry and entry.get("steps")]
    if not intervals:
        return None
    if len(intervals) == 1:
        return intervals[0]
    totals = Totals()
    for entry in intervals:
        totals.add(entry)
    sums = dict(totals.sums)
    sums["last_loss"] = totals.last_loss
    sums["fetches"] = sum(entry["sums"].get("fetches", 0) for entry in intervals)
    steps = int(sums["steps"])
    seconds = sums["seconds"]
    detailed = sums["detailed_steps"]
    step_dist = {
        "median": _median_of(intervals, "step_seconds"),
        "mean": seconds / steps,
        "p90": weighted_median([(e["step_seconds"]["p90"], e["steps"]) for e in intervals], 0.9),
        "min": min(e["step_seconds"]["min"] for e in intervals),
        "max": max(e["step_seconds"]["max"] for e in intervals),
    }
    summary: dict[str, Any] = {
        "steps": steps,
        "first_step": intervals[0]["first_step"],
        "last_step": intervals[-1]["last_step"],
        "time": intervals[-1].get("time"),
        "seconds": seconds,
        "step_seconds": step_dist,
        "stall_ratio": sums["data_wait_seconds"] / seconds if seconds > 0 else None,
        "steps_per_second": steps / seconds if seconds > 0 else None,
        "samples_per_second": samples_rate(sums, steps),
        "batch_size": samples_per_batch(sums, steps),
        "fetches_per_step": sums["fetches"] / steps,
        "optimizer_steps": int(sums["optimizer_steps"]),
        "skipped_steps": int(sums["skipped_steps"]),
        "syncs_per_step": sums["syncs"] / sums["sync_sampled_steps"] if sums["sync_sampled_steps"] else None,
        "sync_sampled_steps": int(sums["sync_sampled_steps"]),
        "detailed_steps": int(detailed),
        "backward_passes_per_step": weighted_median(
            [(e.get("backward_passes_per_step"), e["sums"]["detailed_steps"]) for e in intervals]),
        "gpu_seconds": _gpu(intervals),
        "loss": _loss(intervals),
        "data_wait_seconds": {"median": _median_of(intervals, "data_wait_seconds"),
                              "mean": sums["data_wait_seconds"] / steps},
    }
    forward_known = all(e.get("forward_seconds") is not None for e in intervals if e["sums"]["detailed_steps"])
    for part in SPLIT + ("other_seconds",):
        ratio = part.replace("_seconds", "_ratio")
        known = [e for e in intervals if e.get(part) is not None]
        if not detailed or not known or (part in ("forward_seconds", "other_seconds") and not forward_known):
            summary[part] = summary[ratio] = None
            continue
        if part == "other_seconds":
            amount = sum(e["other_seconds"]["mean"] * e["sums"]["detailed_steps"] for e in known)
        else:
            amount = sums[part]
        summary[part] = {"median": _median_of(known, part, "detailed_steps"), "mean": amount / detailed}
        summary[ratio] = amount / sums["detailed_seconds"] if sums["detailed_seconds"] > 0 else None
    summary["sums"] = sums
    return summary


def _gpu(intervals: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    known = [e for e in intervals if e.get("gpu_seconds")]
    if not known:
        return None
    steps = sum(e["steps"] for e in known)
    return {
        "median": _median_of(known, "gpu_seconds"),
        "mean": sum(e["gpu_seconds"]["mean"] * e["steps"] for e in known) / steps,
        "p90": weighted_median([(e["gpu_seconds"]["p90"], e["steps"]) for e in known], 0.9),
        "min": min(e["gpu_seconds"]["min"] for e in known),
        "max": max(e["gpu_seconds"]["max"] for e in known),
    }


def _loss(intervals: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    known = [e["loss"] for e in intervals if e.get("loss")]
    if not known:
        return None
    medians = [entry["median"] for entry in known if entry.get("median") is not None]
    trend = None
    if len(medians) >= 4:
        half = len(medians) // 2
        earlier = sorted(medians[:half])[half // 2]
        later = sorted(medians[half:])[(len(medians) - half) // 2]
        if earlier:
            trend = (later - earlier) / abs(earlier)
    return {
        "last": known[-1]["last"],
        "median": weighted_median([(entry.get("median"), entry["read_steps"]) for entry in known]),
        "max": max((entry.get("max") for entry in known if entry.get("max") is not None), default=None),
        "read_steps": sum(entry["read_steps"] for entry in known),
        "nonfinite_steps": sum(entry["nonfinite_steps"] for entry in known),
        "trend": trend,
    }


class RunHistory:
    """The events of one run (one rank), bounded, with the views reports and rules read."""

    def __init__(self, max_intervals: int = MAX_INTERVALS) -> None:
        self.max_intervals = max_intervals
        self.run: dict[str, Any] | None = None
        self.config: dict[str, Any] | None = None
        self.system: list[dict[str, Any]] = []
        self.intervals: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []
        self.actions: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}  # the newest cumulative sections: syncs, scaler, habits
        self.end: dict[str, Any] | None = None
        self.source: str | None = None
        self.notes: list[str] = []  # what a report leaves out of this run, and why (one line each)

    @classmethod
    def of(cls, events: Iterable[dict[str, Any]], source: str | None = None,
           notes: Sequence[str] = ()) -> "RunHistory":
        history = cls()
        history.source = source
        history.notes = list(notes)
        for event in events:
            history.add(event)
        return history

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "run":
            if self.run is None or not event.get("continued"):
                self.run = {k: v for k, v in event.items() if k != "event"}
        elif kind == "config":
            self.config = {k: v for k, v in event.items() if k not in ("event", "time")}
        elif kind == "system":
            self.system.append({k: v for k, v in event.items() if k != "event"})
            if len(self.system) > MAX_SYSTEM_SAMPLES:
                del self.system[: MAX_SYSTEM_SAMPLES // 2 : 2]  # thin the older half
        elif kind == "steps" and isinstance(event.get("sums"), dict):
            interval = {k: v for k, v in event.items() if k not in ("event", "syncs", "scaler", "habits", "compile")}
            if event.get("scaler"):
                interval["scale"] = event["scaler"].get("scale")
            self.intervals.append(interval)
            for section in ("syncs", "scaler", "habits", "compile"):
                if event.get(section) is not None:
                    self.latest[section] = event[section]
            if len(self.intervals) > self.max_intervals:
                self._coarsen()
        elif kind == "warning":
            self.warnings.append({k: v for k, v in event.items() if k != "event"})
        elif kind == "action":
            # One entry per change (apply mode): a later event of the same change replaces it.
            action = {k: v for k, v in event.items() if k != "event"}
            for index, known in enumerate(self.actions):
                if action.get("id") is not None and known.get("id") == action.get("id"):
                    self.actions[index] = action
                    break
            else:
                self.actions.append(action)
        elif kind == "end":
            self.end = {k: v for k, v in event.items() if k != "event"}
            for section in ("syncs", "scaler", "habits", "compile"):
                if event.get(section) is not None:
                    self.latest[section] = event[section]

    def _coarsen(self) -> None:
        half = len(self.intervals) // 2
        older, newer = self.intervals[:half], self.intervals[half:]
        merged = [combine(older[i : i + 2]) for i in range(0, len(older), 2)]
        self.intervals = [entry for entry in merged if entry] + newer

    def events(self) -> list[dict[str, Any]]:
        """The history as events again (what a live agent sends to `tuneup report URL`)."""
        out: list[dict[str, Any]] = []
        if self.run is not None:
            out.append({"event": "run", **self.run})
        if self.config is not None:
            out.append({"event": "config", **self.config})
        out += [{"event": "system", **sample} for sample in self.system]
        for i, interval in enumerate(self.intervals):
            event = {"event": "steps", **interval}
            if i == len(self.intervals) - 1:
                event.update(self.latest)
            out.append(event)
        out += [{"event": "warning", **warning} for warning in self.warnings]
        out += [{"event": "action", **action} for action in self.actions]
        if self.end is not None:
            out.append({"event": "end", **self.end})
        return out

    # --- views -----------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return self.intervals[-1]["last_step"] if self.intervals else 0

    def window(self, window_steps: int) -> dict[str, Any] | None:
        """The last `window_steps` steps (whole intervals), past the warm-up where possible."""
        chosen: list[dict[str, Any]] = []
        count = 0
        for interval in reversed(self.intervals):
            if count >= window_steps:
                break
            if interval["last_step"] <= WARMUP_STEPS and count >= MIN_WINDOW_STEPS:
                break
            chosen.append(interval)
            count += interval["steps"]
        return combine(chosen[::-1])

    def totals(self) -> dict[str, Any]:
        if self.end is not None and self.end.get("totals"):
            return self.end["totals"]
        totals = Totals()
        for interval in self.intervals:
            totals.add(interval)
        return totals.summary()

    def snapshot(self, window_steps: int = 1000, window: dict[str, Any] | None = None) -> dict[str, Any]:
        """The snapshot (the shape of Agent.snapshot()) from the events alone: what rules and
        reports read. `window`: the window's summary when the caller has an exact one (a
        live agent's ring), else the last `window_steps` steps of the history."""
        run = self.run or {}
        if window is None:
            window = self.window(window_steps)
        return {
            "enabled": True,
            "attached": self.end is None,
            "state": "ended" if self.end is not None else "running or ended abruptly",
            "run": {k: v for k, v in run.items() if k not in ("options", "time")},
            "run_dir": run.get("run_dir"),
            "run_log": self.source,
            "totals": self.totals(),
            "window": window,
            "syncs": self.latest.get("syncs") or {"measured": False},
            "scaler": self.latest.get("scaler") or {"present": False},
            "habits": self.latest.get("habits") or {},
            "flops": utilization((self.latest.get("habits") or {}).get("flops"), window),
            "compile": self.latest.get("compile"),
            "system": self._system_in_window(window),
            "energy": energy(self._samples_in_window(window), window),
            "gpu_history": _gpu_history(self._samples_in_window(window)),
            "config": self.config,
            "warnings": list(self.warnings),
            "actions": list(self.actions),
        }

    def _samples_in_window(self, window: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The system samples taken while the window's steps ran (the newest ones when
        the window has no times)."""
        if window is None or window.get("time") is None:
            return self.system[-120:]
        start, end = window["time"] - window["seconds"], window["time"] + 0.5
        inside = [sample for sample in self.system if start <= (sample.get("time") or 0) <= end]
        return inside or self.system[-1:]

    def _warmed_up_at(self) -> float | None:
        """The end of the run's intervals that hold warm-up steps only (the first
        WARMUP_STEPS), once a later one closed; None: none such, or none later yet."""
        ended = None
        for interval in self.intervals:
            if interval["last_step"] > WARMUP_STEPS:
                return ended
            ended = interval.get("time")
        return None

    def _system_in_window(self, window: dict[str, Any] | None) -> dict[str, Any] | None:
        """The newest system sample, with the host's CPU use averaged over the window (one
        sample says little, and the last one may be taken after the loop ended): over the
        samples taken since the intervals of warm-up steps only, where the window has some. A
        sample measures the time since the one before it, and the run's first steps hold tuneup's
        first-step work: an augmenting loop whose own threads kept 2 cores busy read 1.67 from
        a window reaching back to them (samples of 1.35 and 1.99), and data-stall predicted
        that workers would find a sixth of a core free."""
        if not self.system:
            return None
        latest = dict(self.system[-1])
        samples = self._samples_in_window(window)
        warmed = self._warmed_up_at()
        if warmed is not None:
            # The samples after the one taken at that interval's tick (a tick samples the
            # system before it writes its steps, so that one is the last not later than them).
            after = bisect_right(self.system, warmed, key=lambda sample: sample.get("time") or 0)
            chosen = {id(sample) for sample in samples}
            later = [sample for sample in self.system[after:] if id(sample) in chosen]
            samples = later or samples
        hosts = [sample["host"] for sample in samples if sample.get("host")]
        if hosts and latest.get("host"):
            latest["host"] = dict(latest["host"])
            for field in ("cpu_ratio", "workers_cpu_ratio", "busy_cores", "wait_cores", "workers_wait_cores"):
                values = [host[field] for host in hosts if host.get(field) is not None]
                if values:
                    latest["host"][field] = sum(values) / len(values)
            # The workers as they ran: the count and memory of the samples that found some (a
            # sample between two epochs of workers that do not persist finds none; one in a
            # switch of apply mode's, the old iterator's beside the new one's: their median).
            running = [host for host in hosts if host.get("workers")]
            if running:
                latest["host"]["workers"] = round(median(host["workers"] for host in running))
                latest["host"]["workers_rss_bytes"] = median(host.get("workers_rss_bytes") or 0 for host in running)
            else:
                latest["host"]["workers"] = 0
        return latest

    def series(self, max_points: int = 400) -> dict[str, list]:
        """Per-interval values for plots (step-time breakdown, stall, scale, skips, loss, GPU)."""
        intervals = self.intervals
        while len(intervals) > max_points:
            intervals = [combine(intervals[i : i + 2]) for i in range(0, len(intervals), 2)]
        out: dict[str, list] = {name: [] for name in (
            "time", "step", "step_seconds", "stall_ratio", "samples_per_second", "loss", "skipped_steps",
            "scale") + tuple(p.replace("_seconds", "") for p in PARTS) + ("other",)}
        scale = None
        for interval in intervals:
            sums = interval["sums"]
            steps = interval["steps"]
            detailed = sums["detailed_steps"]
            out["time"].append(interval.get("time"))
            out["step"].append(interval["last_step"])
            out["step_seconds"].append(interval["step_seconds"]["median"])
            out["stall_ratio"].append(interval["stall_ratio"])
            out["samples_per_second"].append(interval.get("samples_per_second"))
            out["loss"].append((interval.get("loss") or {}).get("median"))
            out["skipped_steps"].append(interval.get("skipped_steps", 0))
            scale = interval.get("scale", scale)
            out["scale"].append(scale)
            mean_step = sums["seconds"] / steps
            wait = sums["data_wait_seconds"] / steps
            out["data_wait"].append(wait)
            known = detailed and interval.get("forward_seconds") is not None
            rest = mean_step - wait
            for part in SPLIT:
                name = part.replace("_seconds", "")
                # .get: run logs from before the input part have none (0: in "other" there)
                share = sums.get(part, 0.0) / sums["detailed_seconds"] if known and sums["detailed_seconds"] else None
                out[name].append(share * mean_step if share is not None else None)
            split = [out[p.replace("_seconds", "")][-1] for p in SPLIT]
            out["other"].append(max(0.0, rest - sum(split)) if None not in split else rest)
        out["gpu_time"], out["gpu_utilization"], out["gpu_memory_ratio"], out["gpu_power_watts"] = [], [], [], []
        for sample in self.system:
            devices = ((sample.get("gpu") or {}).get("samples") or [])
            if not devices:
                continue
            out["gpu_time"].append(sample.get("time"))
            out["gpu_utilization"].append(_mean(d.get("utilization_ratio") for d in devices))
            out["gpu_memory_ratio"].append(_mean(
                d["memory_used_bytes"] / d["memory_total_bytes"] for d in devices
                if d.get("memory_used_bytes") is not None and d.get("memory_total_bytes")))
            out["gpu_power_watts"].append(_mean(d.get("power_watts") for d in devices))
        out["learning_rates"] = _learning_rates((self.end or {}).get("learning_rates"))
        return out


def _learning_rates(curves: Any) -> list[dict[str, Any]]:
    """The run log's learning-rate curves ([step, lr] where it changed, per optimizer), kept
    only where well formed (a run log may be damaged or from another version)."""
    out = []
    for entry in curves if isinstance(curves, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("curve"), list):
            continue
        points = [(point[0], point[1]) for point in entry["curve"]
                  if isinstance(point, list) and len(point) == 2
                  and all(isinstance(v, (int, float)) and math.isfinite(v) for v in point)]
        if points:
            out.append({"optimizer": str(entry.get("optimizer", "optimizer")), "curve": points})
    return out


def _mean(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None and not (isinstance(value, float) and math.isnan(value))]
    return sum(known) / len(known) if known else None


MIN_GPU_SAMPLES = 5  # NVML samples a GPU needs before its mean utilization is read


def nvml_utilization(snapshot: dict[str, Any]) -> float | None:
    """NVML's utilization of the job's GPUs (the share of time a kernel was running), the mean of
    `gpu_history`'s per-device means; None without it or with fewer than MIN_GPU_SAMPLES samples
    on a GPU (what the rules and the reports read)."""
    devices = (snapshot.get("gpu_history") or {}).get("devices") or []
    gpus = [gpu for gpu in devices if gpu.get("utilization_ratio") is not None]
    if not gpus or min(gpu["samples"] for gpu in gpus) < MIN_GPU_SAMPLES:
        return None
    return sum(gpu["utilization_ratio"] for gpu in gpus) / len(gpus)


def _gpu_history(samples: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-device means over the recent GPU samples (utilization is bursty: one sample says
    little), with the throttle reasons seen among them."""
    per_device: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        for device in ((sample.get("gpu") or {}).get("samples") or []):
            per_device.setdefault(device.get("gpu", 0), []).append(device)
    if not per_device:
        return None
    out = []
    for index, rows in sorted(per_device.items()):
        entry: dict[str, Any] = {"gpu": index, "samples": len(rows)}
        for field in ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "power_watts",
                      "power_limit_watts", "sm_clock_hz", "sm_clock_max_hz", "temperature_celsius",
                      "process_memory_bytes"):
            entry[field] = _mean(row.get(field) for row in rows)
        reasons: dict[str, int] = {}
        for row in rows:
            for reason in row.get("throttle_reasons") or ():
                reasons[reason] = reasons.get(reason, 0) + 1
        entry["throttle_reasons"] = {k: v / len(rows) for k, v in reasons.items()}
        out.append(entry)
    return {"devices": out, "samples": len(samples)}
