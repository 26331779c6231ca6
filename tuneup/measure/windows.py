"""Summaries of a run of step records (a reporting interval or the rolling window).

Ratios are time-weighted (total data wait / total step time), so one slow step cannot
swing them the way a mean of per-step ratios would.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any, Sequence

PARTS = ("data_wait_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds")


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


def loss_summary(rows: Sequence[dict[str, float]]) -> dict[str, Any] | None:
    known = [row["loss"] for row in rows if row["loss_known"]]
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


def summarize(rows: Sequence[dict[str, float]]) -> dict[str, Any] | None:
    if not rows:
        return None
    step_times = [row["step_seconds"] for row in rows]
    total_time = sum(step_times)
    totals = {part: sum(row[part] for row in rows) for part in PARTS}
    samples = sum(row["samples"] for row in rows)
    fetches = sum(row["fetches"] for row in rows)
    sampled = [row["syncs"] for row in rows if row["syncs"] >= 0]
    gpu = [row["gpu_seconds"] for row in rows if row["gpu_seconds"] >= 0]
    other = [
        max(0.0, row["step_seconds"] - sum(row[part] for part in PARTS)) for row in rows
    ]
    summary: dict[str, Any] = {
        "steps": len(rows),
        "first_step": int(rows[0]["step"]),
        "last_step": int(rows[-1]["step"]),
        "seconds": total_time,
        "step_seconds": distribution(step_times),
        "stall_ratio": totals["data_wait_seconds"] / total_time if total_time > 0 else None,
        "steps_per_second": len(rows) / total_time if total_time > 0 else None,
        "samples_per_second": samples / total_time if total_time > 0 and samples else None,
        "batch_size": samples / fetches if fetches else None,
        "fetches_per_step": fetches / len(rows),
        "backward_passes_per_step": sum(row["backward_passes"] for row in rows) / len(rows),
        "optimizer_steps": int(sum(row["optimizer_steps"] for row in rows)),
        "skipped_steps": int(sum(row["skipped_steps"] for row in rows)),
        "syncs_per_step": sum(sampled) / len(sampled) if sampled else None,
        "sync_sampled_steps": len(sampled),
        "gpu_seconds": distribution(gpu) if gpu else None,
        "loss": loss_summary(rows),
    }
    for part in PARTS:
        summary[part] = {"median": median(row[part] for row in rows), "mean": totals[part] / len(rows)}
        summary[part.replace("_seconds", "_ratio")] = totals[part] / total_time if total_time > 0 else None
    summary["other_seconds"] = {"median": median(other), "mean": sum(other) / len(other)}
    return summary


class Totals:
    """Running sums over every step since attach (constant memory)."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.samples = 0.0
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self.sync_sampled_steps = 0
        self.syncs = 0.0
        self.losses_read = 0
        self.nonfinite_losses = 0
        self.last_loss: float | None = None
        self.dropped_steps = 0  # steps the ring overwrote before they were read

    def add(self, rows: Sequence[dict[str, float]]) -> None:
        for row in rows:
            self.steps += 1
            self.seconds += row["step_seconds"]
            for part in PARTS:
                self.parts[part] += row[part]
            self.samples += row["samples"]
            self.skipped_steps += int(row["skipped_steps"])
            self.optimizer_steps += int(row["optimizer_steps"])
            if row["syncs"] >= 0:
                self.sync_sampled_steps += 1
                self.syncs += row["syncs"]
            if row["loss_known"]:
                self.losses_read += 1
                self.last_loss = row["loss"]
                if not math.isfinite(row["loss"]):
                    self.nonfinite_losses += 1

    def summary(self) -> dict[str, Any]:
        seconds = self.seconds
        out: dict[str, Any] = {
            "steps": self.steps,
            "seconds": seconds,
            "samples": int(self.samples),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "stall_ratio": self.parts["data_wait_seconds"] / seconds if seconds > 0 else None,
            "steps_per_second": self.steps / seconds if seconds > 0 else None,
            "samples_per_second": self.samples / seconds if seconds > 0 and self.samples else None,
            "syncs_per_step": self.syncs / self.sync_sampled_steps if self.sync_sampled_steps else None,
            "losses_read": self.losses_read,
            "nonfinite_losses": self.nonfinite_losses,
            "last_loss": self.last_loss,
            "dropped_steps": self.dropped_steps,
        }
        for part, total in self.parts.items():
            out[part] = total
        return out
