"""Summaries of a run of step records (a reporting interval or the rolling window).

Records arrive column by column (per-step values from StepRing.columns), and the work runs
on the agent's background thread. Ratios are time-weighted (total data wait / total step
time), so one slow step cannot swing them the way a mean of per-step ratios would. Data
wait is measured on every step; the forward/backward/optimizer split on detail steps, so
its figures come from those steps alone.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import compress
from operator import not_, or_
from statistics import median
from typing import Any, Mapping, Sequence

# The gain in mean step time a window of steps is sized to tell from the noise (apply mode's
# trials: act/experimenter.py default_window); a smaller one may be real and still read "not
# certain", or "not slower" with nothing shown.
DETECT = 0.10
SPLIT = ("input_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds")
PARTS = ("data_wait_seconds",) + SPLIT
Columns = Mapping[str, Sequence[Any]]


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _known(values: Sequence[float]) -> list[float]:
    """The values that are not negative (a side column's -1: not measured on that step)."""
    if not values or max(values) < 0.0:  # (most windows of a column measured on some steps: none)
        return []
    return list(compress(values, map((0.0).__le__, values)))


def distribution(values: Sequence[float], ordered: Sequence[float] | None = None) -> dict[str, float]:
    """`ordered`: `values` sorted, where the caller has them so."""
    if ordered is None:
        ordered = sorted(values)
    return {
        "median": _percentile(ordered, 0.5),
        "mean": sum(ordered) / len(ordered),
        "p90": _percentile(ordered, 0.9),
        "min": ordered[0],
        "max": ordered[-1],
    }


def loss_summary(known: Sequence[float]) -> dict[str, Any] | None:
    """The losses read in a run of steps (`known`: in step order; summarize's)."""
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
        "max": max(finite) if finite else None,
        "read_steps": len(known),
        "nonfinite_steps": len(known) - len(finite),
        "trend": trend,
    }


def _ratio(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def samples_per_batch(sums: dict[str, Any], steps: int) -> float | None:
    """Samples per DataLoader fetch; without fetches, per step (the forwards' batch) over the
    steps whose batch was seen (`unsampled_steps`: intervals without a detail step)."""
    if sums.get("fetches"):
        return sums["samples"] / sums["fetches"]
    seen = steps - sums.get("unsampled_steps", 0)
    return sums["samples"] / seen if sums["samples"] and seen > 0 else None


def samples_rate(sums: dict[str, Any], steps: int) -> float | None:
    """Samples per second: counted ones, or without fetches the batch seen (samples_per_batch)
    times every step, the unsampled ones' too."""
    seconds = sums["seconds"]
    if not sums["samples"] or seconds <= 0:
        return None
    if sums.get("fetches") or not sums.get("unsampled_steps"):
        return sums["samples"] / seconds
    batch = samples_per_batch(sums, steps)
    return batch * steps / seconds if batch is not None else None


MIN_DETAIL_PAIRS = 16  # detail steps (each with the plain step after it) a cost estimate needs


def detail_pairs(columns: Columns) -> tuple[list[float], list[float]]:
    """What detail_cost reads, from a run of steps: each detail step's time with the next
    step's (where that is a plain one), and the plain steps that follow a plain step."""
    seconds, detailed = columns["step_seconds"], columns["detailed"]
    pairs = [seconds[i] + seconds[i + 1] for i in compress(range(len(seconds) - 1), detailed) if not detailed[i + 1]]
    # (a step neither detailed nor after one: map and compress, no Python loop over the steps)
    plain = list(compress(seconds[1:], map(not_, map(or_, detailed[1:], detailed[:-1]))))
    return pairs, plain


def detail_cost(pairs: Sequence[float], plain: Sequence[float]) -> float | None:
    """What a detail step costs the job, in seconds: its own time and the next step's, over two
    plain steps' (medians; `detail_pairs`). The next step pays too: the close's listeners run at
    its start (a few microseconds each: the loss read, the sync sample's end;
    StepTimeline._notify) and torch's code comes back into the caches that tuneup's wrappers
    filled. None with fewer than MIN_DETAIL_PAIRS pairs (or plain steps). On the 0.1 ms CPU
    step of benchmarks/bench_overhead.py: 199 µs against 104 µs, and 137 µs the step after:
    ~130 µs at one in 64."""
    if len(pairs) < MIN_DETAIL_PAIRS or len(plain) < MIN_DETAIL_PAIRS:
        return None
    return max(0.0, median(pairs) - 2 * median(plain))


def step_distribution(step_seconds: Sequence[float], compiling: Sequence[float],
                      ordered: Sequence[float] | None = None) -> dict[str, float]:
    """The step-time statistics (median, mean, p90, min, max) of the steps that compiled
    nothing: a step that compiled (`compiling`: its compile seconds) is a warm-up step, kept
    out of them even with its compile time taken off (its first calls of the new graph, a
    recompile's guard checks and cache lookups are no steady step). Of every step where each
    one compiled (a window of warm-up only). The sums (seconds, steps/s) and the step-time
    histogram keep every step, their compile time taken off: the histogram's count is the
    dashboards' step counter (steps/s is its rate) and its sum is over the steps it counts."""
    if any(compiling) and 0.0 in compiling:
        return distribution(list(compress(step_seconds, map((0.0).__eq__, compiling))))
    return distribution(step_seconds, ordered)


def summarize(columns: Columns, forward_measured: bool = True,
              ordered: Sequence[float] | None = None) -> dict[str, Any] | None:
    """`forward_measured`: whether any model is timed; without one the forward hides in
    "other", so both are reported as unknown rather than as a misleading zero. `ordered`:
    the step times sorted, where the caller sorted them (the drain: once, for the histogram too)."""
    steps = len(columns["step_seconds"])
    if not steps:
        return None
    step_seconds = columns["step_seconds"]
    # (compress and map: the steps are walked at C speed, on the thread the training one waits for)
    detailed = list(compress(range(steps), columns["detailed"]))
    known_losses = list(compress(columns["loss"], columns["loss_known"]))
    synced = _known(columns["syncs"])
    gpu = _known(columns["gpu_seconds"])
    data_wait = columns["data_wait_seconds"]
    compiling = list(columns.get("compile_seconds", ()))
    # Plain sums, kept in the summary so the agent's running totals add them up.
    sums = {
        "steps": steps,
        "seconds": sum(step_seconds),
        "data_wait_seconds": sum(columns["data_wait_seconds"]),
        "samples": sum(columns["samples"]),
        "fetches": sum(columns["fetches"]),
        "optimizer_steps": int(sum(columns["optimizer_steps"])),
        "skipped_steps": int(sum(columns["skipped_steps"])),
        "sync_sampled_steps": len(synced),
        "syncs": sum(synced),
        "detailed_steps": len(detailed),
        "detailed_seconds": sum(step_seconds[i] for i in detailed),
        "losses_read": len(known_losses),
        "nonfinite_losses": sum(1 for value in known_losses if not math.isfinite(value)),
        "last_loss": known_losses[-1] if known_losses else None,
        "evaluation_seconds": sum(columns["evaluation_seconds"]),
        "evaluations": int(sum(columns["evaluations"])),
        # Compilations (kept out of the step times above) and the warm-up steps they ran in.
        "compile_seconds": sum(compiling),
        "warmup_steps": len(compiling) - compiling.count(0.0),
        # tuneup's own work on the training thread at step closes (a precision trial, a batch
        # shipped once), kept out of the step times above: the loop's clock holds it.
        "own_seconds": sum(columns.get("own_seconds", ())),
    }
    fed = _known(columns.get("input_samples", ()))
    if not sums["samples"] and fed:
        # No DataLoader fetch: the samples are the forwards' batch, seen on detail steps (the
        # median: the run's first step may miss the forward made before its model was found).
        sums["samples"] = round(median(fed) * steps)
    # Neither: an interval without a detail step (a short one); its samples are unknown, not
    # none (they would pull the run's batch size down: 15.84 for 16 on a busy machine).
    unsampled = not sums["samples"] and not sums["fetches"] and not fed and forward_measured
    sums["unsampled_steps"] = steps if unsampled else 0
    for part in SPLIT:
        sums[part] = sum(columns[part][i] for i in detailed)
    sums["detailed_data_wait_seconds"] = sum(data_wait[i] for i in detailed)
    # The rest of each detail step (the loop's own code; the forward too when no model is timed).
    sums["detailed_other_seconds"] = sum(
        max(0.0, step_seconds[i] - sum(columns[part][i] for part in PARTS)) for i in detailed)
    total_time = sums["seconds"]
    summary: dict[str, Any] = {
        "steps": steps,
        "first_step": columns["step"][0],
        "last_step": columns["step"][-1],
        "seconds": total_time,
        "step_seconds": step_distribution(step_seconds, compiling, ordered),
        "stall_ratio": _ratio(sums["data_wait_seconds"], total_time),
        "steps_per_second": _ratio(steps, total_time),
        "samples_per_second": samples_rate(sums, steps),
        "batch_size": samples_per_batch(sums, steps),
        "fetches_per_step": sums["fetches"] / steps,
        "optimizer_steps": sums["optimizer_steps"],
        "skipped_steps": sums["skipped_steps"],
        "syncs_per_step": sums["syncs"] / len(synced) if synced else None,
        "sync_sampled_steps": len(synced),
        "detailed_steps": len(detailed),
        "backward_passes_per_step": (
            sum(columns["backward_passes"][i] for i in detailed) / len(detailed) if detailed else None
        ),
        "gpu_seconds": distribution(gpu) if gpu else None,
        "loss": loss_summary(known_losses),
        "evaluation": evaluation_summary(sums["evaluations"], sums["evaluation_seconds"], total_time),
        "data_wait_seconds": {"median": median(data_wait), "mean": sums["data_wait_seconds"] / steps},
    }
    if detailed:
        for part in SPLIT if forward_measured else SPLIT[1:]:
            values = [columns[part][i] for i in detailed]
            summary[part] = {"median": median(values), "mean": sums[part] / len(values)}
            summary[part.replace("_seconds", "_ratio")] = _ratio(sums[part], sums["detailed_seconds"])
        if forward_measured:
            other = [
                max(0.0, step_seconds[i] - sum(columns[part][i] for part in PARTS)) for i in detailed
            ]
            summary["other_seconds"] = {"median": median(other), "mean": sums["detailed_other_seconds"] / len(other)}
            summary["other_ratio"] = _ratio(sums["detailed_other_seconds"], sums["detailed_seconds"])
        else:
            for part in ("forward_seconds", "other_seconds"):
                summary[part] = None
                summary[part.replace("_seconds", "_ratio")] = None
    else:
        for part in SPLIT + ("other_seconds",):
            summary[part] = None
            summary[part.replace("_seconds", "_ratio")] = None
    summary["sums"] = sums
    return summary


# Upper bounds of the step-time histogram (seconds): a 0.3 ms CPU step to a minute-long one.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def evaluation_summary(phases: float, seconds: float, training_seconds: float) -> dict[str, Any] | None:
    """Evaluation phases (kept out of the step times): how many, their time, their share of
    training plus evaluation; None when there were none."""
    if not phases:
        return None
    return {"phases": int(phases), "seconds": seconds, "mean_seconds": seconds / phases,
            "share": _ratio(seconds, seconds + training_seconds)}


class Totals:
    """Running sums over every step since attach (constant memory), from interval summaries.
    Only ever grow: Prometheus reads them as counters, from another thread, at any time."""

    ADDED = ("steps", "seconds", "data_wait_seconds", "samples", "optimizer_steps", "skipped_steps",
             "sync_sampled_steps", "syncs", "detailed_steps", "detailed_seconds", "losses_read",
             "nonfinite_losses", "detailed_data_wait_seconds", "detailed_other_seconds", "evaluation_seconds",
             "evaluations", "compile_seconds", "warmup_steps", "unsampled_steps", "own_seconds") + SPLIT

    def __init__(self) -> None:
        self.sums: dict[str, float] = dict.fromkeys(self.ADDED, 0)
        self.last_loss: float | None = None
        self.dropped_steps = 0  # steps the ring overwrote before they were read
        self.step_buckets = [0] * (len(STEP_BUCKETS) + 1)  # steps per bucket (not cumulative); last: +Inf
        self.last_step_time: float | None = None  # wall-clock end of the last step added

    def add(self, interval: dict[str, Any], ordered: Sequence[float] = (), last_step_time: float | None = None) -> None:
        """`interval`'s sums into the totals; `ordered`: its step times, sorted (the drain's),
        into the step-time histogram."""
        sums = interval["sums"]
        for name in self.ADDED:
            self.sums[name] += sums.get(name, 0)  # logs from older versions lack the newer sums
        if sums["last_loss"] is not None:
            self.last_loss = sums["last_loss"]
        if ordered:
            # Steps at most each bound (a bucket holds those above the bound before it), by
            # bisecting the sorted times: 15 bisections, not one per step.
            below = 0
            for index, bound in enumerate(STEP_BUCKETS):
                upto = bisect_right(ordered, bound)
                self.step_buckets[index] += upto - below
                below = upto
            self.step_buckets[-1] += len(ordered) - below
        if last_step_time is not None:
            self.last_step_time = last_step_time

    def summary(self) -> dict[str, Any]:
        sums = self.sums
        seconds = sums["seconds"]
        out: dict[str, Any] = {
            "steps": int(sums["steps"]),
            "seconds": seconds,
            "samples": int(sums["samples"]),
            "optimizer_steps": int(sums["optimizer_steps"]),
            "skipped_steps": int(sums["skipped_steps"]),
            "data_wait_seconds": sums["data_wait_seconds"],
            "stall_ratio": _ratio(sums["data_wait_seconds"], seconds),
            "steps_per_second": _ratio(sums["steps"], seconds),
            "samples_per_second": samples_rate(sums, int(sums["steps"])),
            "syncs_per_step": sums["syncs"] / sums["sync_sampled_steps"] if sums["sync_sampled_steps"] else None,
            "detailed_steps": int(sums["detailed_steps"]),
            "losses_read": int(sums["losses_read"]),
            "nonfinite_losses": int(sums["nonfinite_losses"]),
            "last_loss": self.last_loss,
            "dropped_steps": self.dropped_steps,
            "evaluation": evaluation_summary(sums["evaluations"], sums["evaluation_seconds"], seconds),
            # torch.compile's compilations, kept out of `seconds`, and the steps they ran in
            "compile_seconds": sums["compile_seconds"],
            "warmup_steps": int(sums["warmup_steps"]),
            # tuneup's own time on the training thread, kept out of `seconds` (the loop's clock
            # reads seconds + tuneup_seconds)
            "tuneup_seconds": sums["own_seconds"],
        }
        for part in SPLIT:
            out[part.replace("_seconds", "_ratio")] = _ratio(sums[part], sums["detailed_seconds"])
        return out
