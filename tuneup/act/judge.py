"""How a trial is judged against its baseline: faster beyond the measured noise, loss finite
and in band.

Step times are autocorrelated (a loader with workers alternates fast and slow steps) and
heavy-tailed (a GC pause, a checkpoint), so each window is cut into BLOCKS runs of
consecutive steps and the block means are compared with an exact one-sided Mann-Whitney U
test: rank-based (one outlier block cannot decide), free of any distribution assumption,
and exact for the small samples a window gives. A change is kept only when the test says
the trial is faster (p < ALPHA) and the speed-up in mean step time, which is what
throughput is, reaches MIN_SPEEDUP (both without the steps that began an epoch: `steady`);
NOT_SLOWER changes are kept unless the same test says they are slower, or their mean step time grew by more than NOT_SLOWER_MARGIN with their blocks
leaning slower (on an H100, bf16 autocast proposed from a 1.21x gain measured off the step ran
the job's own launch-bound steps at 0.88x, p=0.09: not a change to leave in place; one slow
block among faster ones, a checkpoint say, is not such a lean).
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import median
from typing import Any, Mapping, Sequence

from ..measure.windows import summarize
from .action import FASTER

BLOCKS = 6
ALPHA = 0.05
MIN_SPEEDUP = 1.02  # below 2% a change is not worth its risk, whatever the test says
NOT_SLOWER_MARGIN = 0.05  # a NOT_SLOWER change whose steps take this much longer on average is undone,
LEANS_SLOWER = 0.5  # where its blocks lean slower too (p_slower under a half): not for one slow block
LOSS_BAND = 0.10  # the trial's median loss may exceed the baseline's by 10% (or 3 MADs)
MIN_LOSSES = 3

Columns = Mapping[str, Sequence[Any]]


def block_means(values: Sequence[float], blocks: int = BLOCKS) -> list[float]:
    """Means of `blocks` equal runs of consecutive values (the first values left over are dropped)."""
    size = len(values) // blocks
    if size == 0:
        return list(values)
    start = len(values) - size * blocks
    return [sum(values[start + i * size: start + (i + 1) * size]) / size for i in range(blocks)]


@lru_cache(maxsize=None)
def _arrangements(m: int, n: int, u: int) -> int:
    """Orderings of m x's and n y's in which exactly u (x, y) pairs have x above y."""
    if u < 0:
        return 0
    if m == 0 or n == 0:
        return 1 if u == 0 else 0
    # The largest value is an x (above all n y's) or a y (above no x).
    return _arrangements(m - 1, n, u - n) + _arrangements(m, n - 1, u)


def p_smaller(xs: Sequence[float], ys: Sequence[float]) -> float:
    """One-sided exact Mann-Whitney p-value that the xs tend to be smaller than the ys."""
    m, n = len(xs), len(ys)
    if not m or not n:
        return 1.0
    above = sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)
    limit = math.ceil(above)  # ties round against the claim
    total = math.comb(m + n, m)
    return sum(_arrangements(m, n, u) for u in range(limit + 1)) / total


def steady(columns: Columns) -> tuple[list[float], int]:
    """A window's step times without the steps that began an epoch, and how many those were.
    iter(loader) starts the epoch's workers inside one step (hundreds of milliseconds against
    steps of a few): that one step decides its block's mean and a good part of the window's,
    whichever configuration is faster, and where it falls is chance (in the baseline it flatters
    the trial, in the trial it hides the gain). What a change does to that start-up is
    persistent_workers' trial, which keeps them (Change.cut_epoch_starts). All of them where fewer
    than BLOCKS steps would be left (every step an epoch: a loader of a batch or two)."""
    times = list(columns["step_seconds"])
    starts = columns.get("epoch_starts")
    if not starts or not any(starts):
        return times, 0
    kept = [seconds for seconds, began in zip(times, starts) if not began]
    if len(kept) < BLOCKS:
        return times, 0
    return kept, len(times) - len(kept)


def window_numbers(columns: Columns) -> dict[str, Any]:
    """What a report shows of a baseline or trial window."""
    summary = summarize(columns) or {}
    loss = summary.get("loss") or {}
    return {
        "first_step": summary.get("first_step"),
        "last_step": summary.get("last_step"),
        "steps": summary.get("steps", 0),
        "step_seconds": (summary.get("step_seconds") or {}).get("median"),
        "mean_step_seconds": (summary.get("step_seconds") or {}).get("mean"),
        "stall_ratio": summary.get("stall_ratio"),
        "data_wait_seconds": (summary.get("data_wait_seconds") or {}).get("mean"),
        "samples_per_second": summary.get("samples_per_second"),
        "steps_per_second": summary.get("steps_per_second"),
        "loss": loss.get("median"),
        "nonfinite_losses": loss.get("nonfinite_steps", 0),
        "skipped_steps": summary.get("skipped_steps", 0),
    }


def _losses(columns: Columns) -> list[float]:
    return [value for value, known in zip(columns["loss"], columns["loss_known"]) if known]


def loss_problem(baseline: Columns, trial: Columns) -> str | None:
    """Why the trial's loss rules the change out: non-finite more often than in the baseline
    (a job with a few bad records has a few non-finite losses anyway), or above its band."""
    trial_losses, base_all = _losses(trial), _losses(baseline)
    bad = sum(1 for value in trial_losses if not math.isfinite(value))
    base_bad = sum(1 for value in base_all if not math.isfinite(value))
    if bad and bad / len(trial_losses) > (base_bad / len(base_all) if base_all else 0.0):
        return (f"the loss was non-finite on {bad} of {len(trial_losses)} steps read "
                f"(before: {base_bad} of {len(base_all)})")
    base_losses = [value for value in base_all if math.isfinite(value)]
    trial_losses = [value for value in trial_losses if math.isfinite(value)]
    if len(base_losses) < MIN_LOSSES or len(trial_losses) < MIN_LOSSES:
        return None
    base, now = median(base_losses), median(trial_losses)
    spread = median(abs(value - base) for value in base_losses)
    upper = base + max(LOSS_BAND * abs(base), 3 * spread)
    if now > upper:
        return f"the loss left its band: median {now:.4g} against {base:.4g} before (limit {upper:.4g})"
    return None


def judge(baseline: Columns, trial: Columns, keep: str, numerics: bool = True,
          cut_epoch_starts: bool = True, alpha: float = ALPHA) -> dict[str, Any]:
    """The verdict on a trial: {"keep": bool, "reason": str, "undecided": bool, "speedup",
    "p_faster", "p_slower", "epoch_starts_left_out", windows}. `numerics`: whether the change can
    change the loss (else the loss is not judged); `cut_epoch_starts`: the steps that began an
    epoch are left out of both windows (steady); `alpha`: the level the test is held to (a
    trial looked at twice spends ALPHA across its looks: experimenter.py). `undecided`: a FASTER
    change neither kept nor measurably slower, the loss in band: more steps would tell (a short
    first look may read a real 10% gain as 1.00x)."""
    if cut_epoch_starts:
        (before, cut_before), (after, cut_after) = steady(baseline), steady(trial)
    else:
        before, after, cut_before, cut_after = baseline["step_seconds"], trial["step_seconds"], 0, 0
    speedup = (sum(before) / len(before)) / (sum(after) / len(after))
    base_blocks, trial_blocks = block_means(before), block_means(after)
    p_faster = p_smaller(trial_blocks, base_blocks)
    p_slower = p_smaller(base_blocks, trial_blocks)
    # The windows' mean step times are those of the steps judged, so a report's before and after
    # give the speed-up they show (a step that began an epoch, left out, no longer swings them).
    verdict: dict[str, Any] = {
        "baseline": dict(window_numbers(baseline), mean_step_seconds=sum(before) / len(before)),
        "trial": dict(window_numbers(trial), mean_step_seconds=sum(after) / len(after)),
        "speedup": speedup,
        "p_faster": p_faster,
        "p_slower": p_slower,
        "criterion": keep,
        "epoch_starts_left_out": cut_before + cut_after,
    }
    problem = loss_problem(baseline, trial) if numerics else None
    faster = p_faster < alpha and speedup >= MIN_SPEEDUP
    slower = p_slower < ALPHA and speedup <= 1 / MIN_SPEEDUP
    verdict["undecided"] = False
    verdict["slower"] = False  # not kept because it made steps slower: "undone" (report/summary.py)
    # Words a user reads once: what the trial showed and what it means. How sure the test was
    # stays in the record (p_faster, p_slower, and the alpha the look was held to), not in them.
    if problem:
        verdict.update(keep=False, reason=problem)
    elif keep == FASTER:
        if faster:
            verdict.update(keep=True, reason=f"{speedup:.2f}x faster")
        elif slower:
            verdict.update(keep=False, slower=True, reason=f"{speedup:.2f}x (slower)")
        elif speedup > 1:
            verdict.update(keep=False, undecided=True,
                           reason=f"{speedup:.2f}x faster but not certain (a longer run would tell)")
        else:
            verdict.update(keep=False, undecided=True, reason=f"{speedup:.2f}x (no faster)")
    elif slower:
        verdict.update(keep=False, slower=True, reason=f"{speedup:.2f}x (slower)")
    elif speedup < 1 - NOT_SLOWER_MARGIN and p_slower < LEANS_SLOWER:
        verdict.update(keep=False, slower=True,
                       reason=f"{speedup:.2f}x (slower: more than the {NOT_SLOWER_MARGIN:.0%} a change kept for "
                              "not being slower may cost)")
    elif faster:  # kept for not being slower, and measurably faster: said as such
        verdict.update(keep=True, reason=f"{speedup:.2f}x faster")
    elif speedup < 1 - NOT_SLOWER_MARGIN:  # the mean slower, the blocks not leaning so: a few long steps
        verdict.update(keep=True, reason=f"{speedup:.2f}x on the mean, from a few long steps (most steps "
                                         "are not slower)")
    else:
        verdict.update(keep=True, reason=f"{speedup:.2f}x (not slower)")
    if cut_before + cut_after and not problem:
        left_out = cut_before + cut_after
        verdict["reason"] += f"; {left_out} step{'s' if left_out > 1 else ''} that began an epoch left out"
    return verdict
