"""Summaries of a run of step records (a reporting interval or the rolling window).

Records arrive column by column (per-step values from StepRing.columns), and the work runs
on the agent's background thread. Ratios are time-weighted (total data wait / total step
time), so one slow step cannot swing them the way a mean of per-step ratios would. Data
wait is measured on every step; the forward/backward/optimizer split on detail steps, so
its figures come from those steps alone.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any, Mapping, Sequence

SPLIT = ("forward_seconds", "backward_seconds", "optimizer_seconds")
PARTS = ("data_wait_seconds",) + SPLIT
Columns = Mapping[str, Sequence[Any]]


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": _percentile(ordered, 0.5),
        "mean": sum(ordered) / len(ordered),
        "p90": _percentile(ordered, 0.9),
        "min": ordered[0],
        "max": ordered[-1],
    }


def loss_summary(columns: Columns) -> dict[str, Any] | None:
    known = [value for value, read in zip(columns["loss"], columns["loss_known"]) if read]
    if not known:
        return None
    finite = [value for value in known if math.isfinite(value)]
    trend = None
    if len(finite) >= 20:
        half = len(finite) // 2
        earlier, later = median(finite[:half]), median(finite[half:])
        if earlier:
            trend = (later - earlier) / abs(earlier)  # relative change: < 0 is a falling loss
    return {
        "last": known[-1],
        "median": median(finite) if finite else None,
        "read_steps": len(known),
        "nonfinite_steps": len(known) - len(finite),
        "trend": trend,
    }


def _ratio(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def summarize(columns: Columns) -> dict[str, Any] | None:
    steps = len(columns["step_seconds"])
    if not steps:
        return None
    step_seconds = columns["step_seconds"]
    total_time = sum(step_seconds)
    data_wait = columns["data_wait_seconds"]
    samples = sum(columns["samples"])
    fetches = sum(columns["fetches"])
    sampled = [value for value in columns["syncs"] if value >= 0]
    gpu = [value for value in columns["gpu_seconds"] if value >= 0]
    detailed = [i for i, flag in enumerate(columns["detailed"]) if flag]
    detailed_time = sum(step_seconds[i] for i in detailed)
    summary: dict[str, Any] = {
        "steps": steps,
        "first_step": columns["step"][0],
        "last_step": columns["step"][-1],
        "seconds": total_time,
        "step_seconds": distribution(step_seconds),
        "stall_ratio": _ratio(sum(data_wait), total_time),
        "steps_per_second": _ratio(steps, total_time),
        "samples_per_second": _ratio(samples, total_time) if samples else None,
        "batch_size": samples / fetches if fetches else None,
        "fetches_per_step": fetches / steps,
        "optimizer_steps": int(sum(columns["optimizer_steps"])),
        "skipped_steps": int(sum(columns["skipped_steps"])),
        "syncs_per_step": sum(sampled) / len(sampled) if sampled else None,
        "sync_sampled_steps": len(sampled),
        "detailed_steps": len(detailed),
        "backward_passes_per_step": (
            sum(columns["backward_passes"][i] for i in detailed) / len(detailed) if detailed else None
        ),
        "gpu_seconds": distribution(gpu) if gpu else None,
        "loss": loss_summary(columns),
        "data_wait_seconds": {"median": median(data_wait), "mean": sum(data_wait) / steps},
        "data_wait_ratio": _ratio(sum(data_wait), total_time),
    }
    if detailed:
        for part in SPLIT:
            values = [columns[part][i] for i in detailed]
            summary[part] = {"median": median(values), "mean": sum(values) / len(values)}
            summary[part.replace("_seconds", "_ratio")] = _ratio(sum(values), detailed_time)
        other = [
            max(0.0, step_seconds[i] - sum(columns[part][i] for part in PARTS)) for i in detailed
        ]
        summary["other_seconds"] = {"median": median(other), "mean": sum(other) / len(other)}
        summary["other_ratio"] = _ratio(sum(other), detailed_time)
    else:
        for part in SPLIT + ("other_seconds",):
            summary[part] = None
            summary[part.replace("_seconds", "_ratio")] = None
    return summary


class Totals:
    """Running sums over every step since attach (constant memory)."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.data_wait = 0.0
        self.detailed_steps = 0
        self.detailed_seconds = 0.0
        self.split = dict.fromkeys(SPLIT, 0.0)
        self.samples = 0.0
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self.sync_sampled_steps = 0
        self.syncs = 0.0
        self.losses_read = 0
        self.nonfinite_losses = 0
        self.last_loss: float | None = None
        self.dropped_steps = 0  # steps the ring overwrote before they were read

    def add(self, columns: Columns) -> None:
        self.steps += len(columns["step_seconds"])
        self.seconds += sum(columns["step_seconds"])
        self.data_wait += sum(columns["data_wait_seconds"])
        detailed = [i for i, flag in enumerate(columns["detailed"]) if flag]
        self.detailed_steps += len(detailed)
        self.detailed_seconds += sum(columns["step_seconds"][i] for i in detailed)
        for part in SPLIT:
            self.split[part] += sum(columns[part][i] for i in detailed)
        self.samples += sum(columns["samples"])
        self.skipped_steps += int(sum(columns["skipped_steps"]))
        self.optimizer_steps += int(sum(columns["optimizer_steps"]))
        sampled = [value for value in columns["syncs"] if value >= 0]
        self.sync_sampled_steps += len(sampled)
        self.syncs += sum(sampled)
        known = [value for value, read in zip(columns["loss"], columns["loss_known"]) if read]
        self.losses_read += len(known)
        self.nonfinite_losses += sum(1 for value in known if not math.isfinite(value))
        if known:
            self.last_loss = known[-1]

    def summary(self) -> dict[str, Any]:
        seconds = self.seconds
        out: dict[str, Any] = {
            "steps": self.steps,
            "seconds": seconds,
            "samples": int(self.samples),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "data_wait_seconds": self.data_wait,
            "stall_ratio": _ratio(self.data_wait, seconds),
            "steps_per_second": _ratio(self.steps, seconds),
            "samples_per_second": _ratio(self.samples, seconds) if self.samples else None,
            "syncs_per_step": self.syncs / self.sync_sampled_steps if self.sync_sampled_steps else None,
            "detailed_steps": self.detailed_steps,
            "losses_read": self.losses_read,
            "nonfinite_losses": self.nonfinite_losses,
            "last_loss": self.last_loss,
            "dropped_steps": self.dropped_steps,
        }
        for part, total in self.split.items():
            out[part.replace("_seconds", "_ratio")] = _ratio(total, self.detailed_seconds)
        return out
