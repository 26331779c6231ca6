"""Direct unit tests of tuneup's pure computational cores, on small hand-made inputs.

No training loop, no threads, no agent: each test feeds a function numbers worked out by
hand (the arithmetic is in the comments) and asserts exact results.

- act/judge.py: block_means, the exact one-sided Mann-Whitney p_smaller (against a
  brute-force enumeration), window_numbers, and judge()'s decisions (FASTER, NOT_SLOWER,
  MIN_SPEEDUP, the loss checks).
- measure/windows.py: summarize (step time distribution, time-weighted ratios,
  detail-step-only phases, loss statistics, trend) and Totals.
- measure/history.py: weighted_median, combine, RunHistory (coarsening, window, totals,
  snapshot).
- report/document.py apply_outcome and report/summary.py apply_line: a finding joined to
  what apply mode did about it.
- measure/steps.py: StepRing (put, holds, columns) driven directly and through
  StepTimeline events with explicit times (hotpath.py; steps.py before it moved), and the
  step-boundary rule StepTimeline.moved_on.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from tuneup.act.action import FASTER, NOT_SLOWER
from tuneup.act.judge import ALPHA, BLOCKS, MIN_SPEEDUP, block_means, judge, p_smaller, window_numbers
from tuneup.measure.history import MAX_INTERVALS, RunHistory, combine, weighted_median
from tuneup.measure import steps as step_records
from tuneup.measure.steps import CUMULATIVE, EARLY_DETAIL_STEPS, LATE, StepRing

from tuneup.measure.hotpath import (DETAIL_BUDGET, DETAIL_COST, DETAIL_EVERY, DETAIL_PERIOD, MAX_DETAIL_EVERY,
                                    MIN_PERIOD_EVERY, PACED_FROM_STEP, StepTimeline,
                                   optimizer_hooks)
from tuneup.measure.windows import MIN_DETAIL_PAIRS, STEP_BUCKETS, SPLIT, Totals, detail_cost, detail_pairs, summarize

NAN, INF = math.nan, math.inf


# --- builders -------------------------------------------------------------------------------


def make_columns(step_seconds, first=1, losses=None, **given):
    """Columns in StepRing.columns' shape: `n` steps from `first`, quiet defaults (no data
    wait, 8 samples / 1 fetch / 1 optimizer step a step, no detail steps, no side values)
    overridden by `given`. `losses`: one entry a step, None where no loss was read."""
    n = len(step_seconds)
    out = {
        "step": range(first, first + n),
        "step_seconds": list(step_seconds),
        "data_wait_seconds": [0.0] * n,
        "forward_seconds": [0.0] * n,
        "backward_seconds": [0.0] * n,
        "optimizer_seconds": [0.0] * n,
        "input_seconds": [0.0] * n,
        "samples": [8] * n,
        "fetches": [1] * n,
        "backward_passes": [1] * n,
        "optimizer_steps": [1] * n,
        "skipped_steps": [0] * n,
        "evaluation_seconds": [0.0] * n,
        "evaluations": [0] * n,
        "detailed": [False] * n,
        "loss": [NAN] * n,
        "syncs": [-1.0] * n,
        "gpu_seconds": [-1.0] * n,
        "compile_seconds": [0.0] * n,
        "own_seconds": [0.0] * n,
        "epoch_starts": [0.0] * n,
        "input_samples": [-1.0] * n,
        "loss_known": [False] * n,
    }
    if losses is not None:
        assert len(losses) == n
        out["loss"] = [NAN if value is None else value for value in losses]
        out["loss_known"] = [value is not None for value in losses]
    for name, values in given.items():
        assert name in out, name
        assert len(values) == n, name
        out[name] = list(values)
    return out


def concat(*parts):
    """Consecutive column sets as one."""
    out = {name: [v for part in parts for v in part[name]] for name in parts[0] if name != "step"}
    out["step"] = range(parts[0]["step"][0], parts[-1]["step"][-1] + 1)
    return out


def steps_event(first, n, seconds, **given):
    """A run log "steps" event of `n` steps of `seconds` each, summarized by windows.summarize."""
    return {"event": "steps", "time": 1000.0 + first, **summarize(make_columns([seconds] * n, first, **given))}


def without_event(event):
    return {k: v for k, v in event.items() if k != "event"}


def mann_whitney_u(xs, ys):
    """U = pairs with x above y, ties half (the statistic p_smaller uses)."""
    return sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)


def brute_force_p(m, n, observed_u):
    """P(U <= observed_u) over all C(m+n, m) equally likely rank arrangements (no ties):
    each choice of the x ranks among 0..m+n-1 gives U = the y ranks below each x, summed."""
    count = total = 0
    for x_ranks in itertools.combinations(range(m + n), m):
        u = sum(rank - index for index, rank in enumerate(x_ranks))  # y's below the index-th x
        total += 1
        count += u <= observed_u
    assert total == math.comb(m + n, m)
    return count / total


# ============================================================================================
# act/judge.py
# ============================================================================================


def test_hand_made_columns_have_the_rings_shape():
    # Every builder below relies on this: the same column names StepRing.columns gives.
    assert set(make_columns([1.0])) == set(StepRing(4).columns(1, 0))


def test_block_means_equal_runs_of_consecutive_values():
    # 12 values, 6 blocks of 2: (1+2)/2, (3+4)/2, ...
    assert block_means([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == [1.5, 3.5, 5.5, 7.5, 9.5, 11.5]
    assert BLOCKS == 6


def test_block_means_drop_the_first_values_left_over():
    # 14 values, size 14 // 6 = 2, 14 - 12 = 2 left over: 1 and 2 dropped (not 13 and 14).
    assert block_means(list(range(1, 15))) == [3.5, 5.5, 7.5, 9.5, 11.5, 13.5]
    # 17 values, size 2, 5 left over: blocks start at the 6th value.
    assert block_means(list(range(1, 18))) == [6.5, 8.5, 10.5, 12.5, 14.5, 16.5]
    # Other block counts: 7 values in 3 blocks of 2, the first value dropped.
    assert block_means([100, 1, 3, 5, 7, 9, 11], blocks=3) == [2.0, 6.0, 10.0]


def test_block_means_fewer_values_than_blocks_are_returned_as_is():
    assert block_means([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert block_means([]) == []
    # Exactly as many values as blocks: blocks of one.
    assert block_means([6, 5, 4, 3, 2, 1]) == [6, 5, 4, 3, 2, 1]


def test_p_smaller_all_below():
    # U = 0; of the C(6, 3) = 20 arrangements only one has U <= 0.
    assert p_smaller([1, 2, 3], [4, 5, 6]) == 1 / 20
    # m=n=6: 1 / C(12, 6) = 1/924.
    assert p_smaller([1] * 6, [2] * 6) == 1 / 924


def test_p_smaller_all_above_is_one():
    assert p_smaller([4, 5, 6], [1, 2, 3]) == 1.0


def test_p_smaller_identical_samples():
    # m=n=3, U over 0..9 has counts 1,1,2,3,3,3,3,2,1,1 (partitions of u in a 3x3 box).
    # [1,2,3] vs [1,2,3]: pairs above 2>1, 3>1, 3>2 = 3, plus 3 ties x 0.5 = 4.5, rounded
    # up (against the claim) to 5: P(U <= 5) = (1+1+2+3+3+3)/20 = 13/20.
    assert p_smaller([1, 2, 3], [1, 2, 3]) == 13 / 20
    # All nine pairs tied: U = 4.5, same answer.
    assert p_smaller([7, 7, 7], [7, 7, 7]) == 13 / 20


def test_p_smaller_ties_count_half_and_round_against_the_claim():
    # [1,2] vs [2,3]: only the tie 2=2 counts, 0.5, rounded up to 1. For m=n=2 the counts
    # of U=0..4 are 1,1,2,1,1 of 6: P(U <= 1) = 2/6 (rounding down would give 1/6).
    assert p_smaller([1, 2], [2, 3]) == 2 / 6
    # [1,3] vs [2,3]: 3>2 counts 1, 3=3 counts 0.5: U = 1.5 -> 2: P(U <= 2) = 4/6.
    assert p_smaller([1, 3], [2, 3]) == 4 / 6


def test_p_smaller_empty_input_is_one():
    assert p_smaller([], [1.0, 2.0]) == 1.0
    assert p_smaller([1.0, 2.0], []) == 1.0
    assert p_smaller([], []) == 1.0


@pytest.mark.parametrize("m,n", [(3, 4), (4, 2), (1, 5), (5, 5)])
def test_p_smaller_matches_brute_force_enumeration(m, n):
    # Every arrangement of distinct values: xs at the chosen ranks, ys at the others.
    for x_ranks in itertools.combinations(range(m + n), m):
        xs = [float(r) for r in x_ranks]
        ys = [float(r) for r in range(m + n) if r not in x_ranks]
        u = mann_whitney_u(xs, ys)
        assert p_smaller(xs, ys) == brute_force_p(m, n, u), (xs, ys)


def test_p_smaller_with_ties_matches_brute_force_with_u_rounded_up():
    # U = 0.5 + 4 = 4.5; 0.5 + 1 + 1 + 1 = 3.5; three ties = 1.5.
    cases = [([1, 2, 6], [2, 3, 4, 5]), ([5, 1, 2], [5, 0]), ([0, 0, 0], [0, 1, 1])]
    for xs, ys in cases:
        u = mann_whitney_u(xs, ys)
        assert u != int(u)  # each case has a half
        assert p_smaller(xs, ys) == brute_force_p(len(xs), len(ys), math.ceil(u))


def test_window_numbers_of_hand_made_columns():
    # 4 steps of 1, 1, 2, 4 s (sum 8): median 1.5, mean 2; data wait 0, 1, 0, 1 (sum 2):
    # stall 2/8, mean wait 0.5; 8 samples a step: 32/8 = 4 samples/s; 4/8 steps/s.
    # Losses read on 3 steps, one of them non-finite; one step skipped.
    columns = make_columns([1, 1, 2, 4], first=5, losses=[3.0, None, NAN, 1.0],
                           data_wait_seconds=[0, 1, 0, 1], skipped_steps=[0, 1, 0, 0])
    assert window_numbers(columns) == {
        "first_step": 5,
        "last_step": 8,
        "steps": 4,
        "step_seconds": 1.5,
        "mean_step_seconds": 2.0,
        "stall_ratio": 0.25,
        "data_wait_seconds": 0.5,
        "samples_per_second": 4.0,
        "steps_per_second": 0.5,
        "loss": 2.0,  # median of the finite 3 and 1
        "nonfinite_losses": 1,
        "skipped_steps": 1,
    }


def test_window_numbers_of_no_steps():
    numbers = window_numbers(make_columns([]))
    assert numbers["steps"] == 0 and numbers["skipped_steps"] == 0 and numbers["nonfinite_losses"] == 0
    assert numbers["first_step"] is None and numbers["step_seconds"] is None and numbers["loss"] is None


# A loader with workers alternates slow and fast steps: block means of two steps even it out.
BASE = [0.09, 0.11] * 6  # mean 0.1
FAST = [0.07, 0.09] * 6  # mean 0.08: 1.25x


def test_judge_keeps_a_clearly_faster_trial():
    verdict = judge(make_columns(BASE), make_columns(FAST, first=13), FASTER)
    # Every trial block (0.08) is below every baseline block (0.1): p = 1/C(12,6) = 1/924.
    assert verdict["p_faster"] == 1 / 924
    assert verdict["p_slower"] == 1.0
    assert verdict["speedup"] == pytest.approx(1.25, rel=1e-12)
    assert verdict["keep"] is True
    assert verdict["reason"] == "1.25x faster"
    assert verdict["criterion"] == FASTER
    assert verdict["baseline"] == window_numbers(make_columns(BASE))
    assert verdict["trial"]["first_step"] == 13 and verdict["trial"]["steps"] == 12


def test_judge_does_not_keep_a_trial_within_the_noise():
    verdict = judge(make_columns([0.1] * 12), make_columns([0.1] * 12), FASTER)
    # All 36 block pairs tied: U = 18, P(U <= 18) = 491/924 (the middle of a symmetric law).
    assert verdict["speedup"] == 1.0
    assert verdict["p_faster"] == verdict["p_slower"] == 491 / 924
    assert verdict["keep"] is False
    assert verdict["reason"] == "1.00x (no faster)"


def test_judge_one_outlier_block_cannot_decide():
    # Six steps a window: blocks of one. The baseline's mean (10*5+40)/6 = 15 is swung by one
    # slow block; the trial (11 each) has 1.36x its throughput but is above 5 of its 6
    # blocks: U = 6*5 = 30 of 36, so p_faster is large and the trial is not kept.
    verdict = judge(make_columns([10, 10, 10, 10, 10, 40]), make_columns([11] * 6), FASTER)
    assert verdict["speedup"] == 15 / 11
    assert verdict["p_faster"] > ALPHA
    assert verdict["keep"] is False
    assert verdict["reason"] == "1.36x faster but not certain (a longer run would tell)"


def test_judge_does_not_keep_a_faster_trial_below_min_speedup():
    # Every block faster (p = 1/924) but only 101/100 = 1.01x.
    verdict = judge(make_columns([101.0] * 12), make_columns([100.0] * 12), FASTER)
    assert verdict["p_faster"] == 1 / 924
    assert verdict["speedup"] == 1.01
    assert verdict["keep"] is False
    assert "1.01x faster but not certain" in verdict["reason"]


def test_judge_min_speedup_is_inclusive():
    # 51/50 == 1.02 exactly as floats: reaching MIN_SPEEDUP is enough.
    verdict = judge(make_columns([51.0] * 12), make_columns([50.0] * 12), FASTER)
    assert verdict["speedup"] == MIN_SPEEDUP
    assert verdict["keep"] is True


def test_judge_p_at_alpha_is_not_enough():
    # Three steps a window: fewer than BLOCKS, so the steps are the blocks; every trial step
    # below every baseline step gives p = 1/C(6,3) = 1/20 = ALPHA, which is not below it.
    verdict = judge(make_columns([2.0] * 3), make_columns([1.0] * 3), FASTER)
    assert verdict["p_faster"] == ALPHA == 0.05
    assert verdict["speedup"] == 2.0
    assert verdict["keep"] is False
    # Four steps a window: 1/C(8,4) = 1/70 < ALPHA: kept.
    assert judge(make_columns([2.0] * 4), make_columns([1.0] * 4), FASTER)["keep"] is True


def test_judge_leaves_out_the_steps_that_began_an_epoch():
    # 24 steps a side. The trial's steps are 1.25x faster (0.08 against 0.1 s), but its step 30
    # began an epoch: 0.08 + 0.9 s of worker start-up. With it, the trial's mean is 0.1175
    # (0.85x) and the block holding it is the slowest of all; without it, every trial block is
    # below every baseline block.
    base = make_columns([0.1] * 24)
    trial_steps = [0.08] * 24
    trial_steps[5] += 0.9
    starts = [0.0] * 24
    starts[5] = 1.0
    whole = judge(base, make_columns(trial_steps, first=25), FASTER)  # no step marked: judged whole
    assert whole["keep"] is False and whole["speedup"] < 1 and whole["epoch_starts_left_out"] == 0
    verdict = judge(base, make_columns(trial_steps, first=25, epoch_starts=starts), FASTER)
    assert verdict["speedup"] == pytest.approx(1.25, rel=1e-12)
    assert verdict["p_faster"] == 1 / 924 and verdict["keep"] is True
    assert verdict["epoch_starts_left_out"] == 1
    assert verdict["reason"] == "1.25x faster; 1 step that began an epoch left out"
    # The windows' means a report shows are the judged steps': their ratio is the speed-up said
    # (with the epoch's start, the trial's mean is 0.1175 s: 0.1 -> 0.1175 beside "1.25x faster")
    assert verdict["trial"]["mean_step_seconds"] == pytest.approx(0.08)
    assert verdict["baseline"]["mean_step_seconds"] / verdict["trial"]["mean_step_seconds"] == \
        pytest.approx(verdict["speedup"], rel=1e-12)
    # In the baseline it flatters the trial: 0.1 against 0.1 is no gain once it is left out.
    base_steps = [0.1] * 24
    base_steps[0] += 0.9
    flattered = judge(make_columns(base_steps, epoch_starts=[1.0] + [0.0] * 23), make_columns([0.1] * 24, first=25),
                      FASTER)
    assert flattered["speedup"] == pytest.approx(1.0) and flattered["keep"] is False
    # persistent_workers' trial keeps them: its gain is in those steps.
    kept = judge(base, make_columns(trial_steps, first=25, epoch_starts=starts), FASTER, cut_epoch_starts=False)
    assert kept["epoch_starts_left_out"] == 0 and kept["speedup"] < 1


def test_judge_keeps_every_step_where_too_few_would_be_left():
    # A loader of one batch: every step begins an epoch. Nothing is left out.
    verdict = judge(make_columns([2.0] * 6, epoch_starts=[1.0] * 6), make_columns([1.0] * 6, epoch_starts=[1.0] * 6),
                    FASTER)
    assert verdict["epoch_starts_left_out"] == 0 and verdict["speedup"] == 2.0 and verdict["keep"] is True


def test_judge_faster_criterion_rejects_a_slower_trial_as_slower():
    verdict = judge(make_columns(FAST), make_columns(BASE), FASTER)
    assert verdict["p_slower"] == 1 / 924
    assert verdict["keep"] is False
    assert verdict["reason"] == "0.80x (slower)" and verdict["slower"] is True


def test_judge_not_slower_keeps_a_trial_within_the_noise():
    verdict = judge(make_columns([0.1] * 12), make_columns([0.1] * 12), NOT_SLOWER)
    assert verdict["keep"] is True
    assert verdict["reason"] == "1.00x (not slower)" and verdict["slower"] is False
    assert verdict["criterion"] == NOT_SLOWER


def test_judge_not_slower_keeps_a_measurably_but_slightly_slower_trial():
    # Every block slower (p_slower = 1/924) but only by 1%: 100/101 = 0.990 > 1/1.02.
    verdict = judge(make_columns([100.0] * 12), make_columns([101.0] * 12), NOT_SLOWER)
    assert verdict["p_slower"] == 1 / 924
    assert verdict["keep"] is True


def test_judge_not_slower_rejects_a_clearly_slower_trial():
    verdict = judge(make_columns(FAST), make_columns(BASE), NOT_SLOWER)
    assert verdict["keep"] is False
    assert verdict["reason"] == "0.80x (slower)" and verdict["slower"] is True
    # 50/51 is 1/1.02: the slower bound is inclusive too.
    assert judge(make_columns([50.0] * 12), make_columns([51.0] * 12), NOT_SLOWER)["keep"] is False


def test_judge_not_slower_rejects_a_trial_much_slower_on_average_though_not_certainly():
    # As on an H100 (bf16 autocast at 0.88x, p=0.09): most blocks slower, the rank test not
    # sure (p = 0.09), the mean step 0.100 -> 0.108 s (0.93x): kept for "not slower", it would not be.
    trial = [0.13, 0.10] * 3 + [0.09, 0.11] * 3
    verdict = judge(make_columns(BASE), make_columns(trial), NOT_SLOWER)
    assert 0.05 < verdict["p_slower"] < 0.5 and verdict["speedup"] < 0.95
    assert verdict["keep"] is False
    assert verdict["reason"].startswith("0.93x (slower: more than the 5%") and verdict["slower"] is True
    # One slow block (two 0.3 s steps: a checkpoint) among faster ones: the mean says 0.80x,
    # the blocks do not lean slower (p = 0.98): kept.
    outlier = judge(make_columns(BASE), make_columns([0.09] * 10 + [0.3] * 2), NOT_SLOWER)
    assert outlier["speedup"] < 0.95 and outlier["p_slower"] > 0.5 and outlier["keep"] is True
    # Said as what it is, not as "0.80x: not slower" (a full garbage collection of 150 ms in a
    # trial of 2.5 ms steps read that way in many_workers' report)
    assert outlier["reason"] == f"{outlier['speedup']:.2f}x on the mean, from a few long steps (most steps are not slower)"


def test_judge_not_slower_keeps_a_faster_trial():
    verdict = judge(make_columns(BASE), make_columns(FAST), NOT_SLOWER)
    assert verdict["keep"] is True
    # Measurably faster, it is said as such (not "not slower": a user reads a gain once)
    assert verdict["reason"] == "1.25x faster"


def test_judge_rejects_a_faster_trial_with_a_non_finite_loss():
    base = make_columns(BASE, losses=[1.0] * 12)
    trial = make_columns(FAST, losses=[1.0] * 11 + [NAN])
    verdict = judge(base, trial, FASTER)
    assert verdict["keep"] is False
    assert verdict["reason"] == "the loss was non-finite on 1 of 12 steps read (before: 0 of 12)"
    assert verdict["trial"]["nonfinite_losses"] == 1
    # Inf counts as non-finite too, under either criterion.
    trial = make_columns(FAST, losses=[INF] + [1.0] * 11)
    assert judge(base, trial, NOT_SLOWER)["keep"] is False


def test_judge_non_finite_losses_no_more_often_than_before_are_tolerated():
    # 1 of 12 before, 1 of 12 now: not more often, so not a problem.
    base = make_columns(BASE, losses=[NAN] + [1.0] * 11)
    trial = make_columns(FAST, losses=[1.0] * 11 + [NAN])
    assert judge(base, trial, FASTER)["keep"] is True
    # 2 of 12 now: more often.
    trial = make_columns(FAST, losses=[1.0] * 10 + [NAN, NAN])
    verdict = judge(base, trial, FASTER)
    assert verdict["keep"] is False
    assert verdict["reason"] == "the loss was non-finite on 2 of 12 steps read (before: 1 of 12)"


def test_judge_rejects_a_loss_above_its_band():
    # Baseline losses all 1: no spread, band = 1 + 10% = 1.1.
    base = make_columns(BASE, losses=[1.0] * 12)
    verdict = judge(base, make_columns(FAST, losses=[1.2] * 12), FASTER)
    assert verdict["keep"] is False
    assert verdict["reason"] == "the loss left its band: median 1.2 against 1 before (limit 1.1)"
    # At the limit (1.0 + 0.1 == 1.1 as floats) and below it, the loss is fine.
    assert judge(base, make_columns(FAST, losses=[1.1] * 12), FASTER)["keep"] is True
    assert judge(base, make_columns(FAST, losses=[0.2] * 12), FASTER)["keep"] is True


def test_judge_loss_band_widens_to_three_mads():
    # Baseline losses 1..5 on five steps: median 3, deviations 2,1,0,1,2 -> MAD 1;
    # band = 3 + max(0.3, 3 * 1) = 6.
    base = make_columns(BASE, losses=[1, 2, 3, 4, 5] + [None] * 7)
    assert judge(base, make_columns(FAST, losses=[6.0] * 3 + [None] * 9), FASTER)["keep"] is True
    verdict = judge(base, make_columns(FAST, losses=[6.5] * 3 + [None] * 9), FASTER)
    assert verdict["keep"] is False
    assert verdict["reason"] == "the loss left its band: median 6.5 against 3 before (limit 6)"


def test_judge_loss_band_needs_min_losses_on_both_sides():
    # Two finite baseline losses (< MIN_LOSSES = 3): the band is not judged.
    base = make_columns(BASE, losses=[1.0, 1.0] + [None] * 10)
    assert judge(base, make_columns(FAST, losses=[100.0] * 12), FASTER)["keep"] is True
    base = make_columns(BASE, losses=[1.0] * 12)
    assert judge(base, make_columns(FAST, losses=[100.0] * 2 + [None] * 10), FASTER)["keep"] is True
    assert judge(base, make_columns(FAST, losses=[100.0] * 3 + [None] * 9), FASTER)["keep"] is False


# --- a finding joined to what apply mode did about it -----------------------------------------


def test_a_finding_reads_its_kept_change_over_a_later_undone_one():
    from tuneup.report.document import apply_outcome
    from tuneup.report.summary import apply_line

    fixes = ["data-stall", "pageable-copies"]
    actions = [
        {"id": 1, "action": "dataloader", "fixes": fixes, "change": "num_workers 0 -> 2", "decision": "kept",
         "reason": "1.87x faster", "applied_step": 45, "undone": {"step": 151, "reason": "detach"}},
        {"id": 2, "action": "dataloader", "fixes": fixes, "change": "prefetch_factor 2 -> 4", "decision": "reverted",
         "reason": "1.01x (no faster)", "applied_step": 90},
        {"id": 3, "action": "zero-grad", "fixes": ["zero-grad-keeps-tensors"], "change": "set_to_none", "decision": "trying",
         "applied_step": 120},
    ]
    outcome = apply_outcome("data-stall", [{"actions": actions}])
    assert outcome["id"] == 1 and outcome["decision"] == "kept"
    line = apply_line({"rule": "data-stall", "can_apply": True, "applied": outcome})
    # In effect from the step after the close that applied it; undone at detach goes unsaid
    assert line == ("apply mode made it (change 1): num_workers 0 -> 2, kept from step 46: 1.87x faster. "
                    "It lasts until detach: write it into the job to keep it")
    # A change still on trial is no outcome; a rule no record fixes has none
    assert apply_outcome("zero-grad-keeps-tensors", [{"actions": actions}]) is None
    assert apply_outcome("host-syncs", [{"actions": actions}]) is None
    assert apply_line({"rule": "host-syncs", "can_apply": False, "applied": None}) is None
    assert apply_line({"rule": "x", "can_apply": True, "applied": None}).startswith("a safe change")


def test_the_jobs_own_precision_leaves_out_an_autocast_apply_mode_put_on():
    """The autocast the configuration read is apply mode's where an AMP change was applied in
    the run, whatever became of it (kept and undone at detach, a trial cut short at detach,
    one rolled back in the last steps: the autocast is read at forwards, and none came after)."""
    from tuneup.diagnose.rule import Facts

    config = {"autocast": {"cpu": "bfloat16"}, "models": [{"dtypes": {"float32": 10}}]}
    assert Facts({"config": config}).job_precision == "bfloat16"  # the job's own
    for decision in ("kept", "reverted", "rolled back", "trying"):
        actions = [{"action": "amp", "decision": decision, "applied_step": 80}]
        facts = Facts({"config": config, "actions": actions})
        assert facts.job_precision is None, decision
        assert facts.reduced_precision == "bfloat16"  # what the last steps ran with
    refused = [{"action": "amp", "decision": "not applicable", "reason": "..."}]
    assert Facts({"config": config, "actions": refused}).job_precision == "bfloat16"
    half = {"autocast": {}, "models": [{"dtypes": {"bfloat16": 10}}]}  # a model the job itself made bf16
    assert Facts({"config": half, "actions": [{"action": "amp", "applied_step": 3}]}).job_precision == "bfloat16"


def test_a_finding_whose_change_was_not_kept_or_not_made_says_why():
    from tuneup.report.document import apply_outcome
    from tuneup.report.summary import apply_line

    undone = [{"id": 1, "action": "dataloader", "fixes": ["data-stall"], "change": "num_workers 8 -> 2",
               "decision": "reverted", "reason": "0.90x (slower)", "slower": True, "applied_step": 40}]
    line = apply_line({"rule": "data-stall", "can_apply": True, "applied": apply_outcome("data-stall", [{"actions": undone}])})
    assert line == "apply mode tried it (change 1): num_workers 8 -> 2, undone: 0.90x (slower)"
    refused = [{"id": 1, "action": "amp", "fixes": ["amp-off"], "decision": "not applicable",
                "reason": "the model is compiled"}]
    line = apply_line({"rule": "amp-off", "can_apply": False, "applied": apply_outcome("amp-off", [{"actions": refused}])})
    assert line == "apply mode did not make it (not applicable): the model is compiled"


def test_judge_without_numerics_does_not_judge_the_loss():
    base = make_columns(BASE, losses=[1.0] * 12)
    for losses in ([100.0] * 12, [NAN] * 12):
        verdict = judge(base, make_columns(FAST, losses=losses), FASTER, numerics=False)
        assert verdict["keep"] is True
        assert verdict["reason"].startswith("1.25x faster")


# ============================================================================================
# measure/windows.py
# ============================================================================================

# Six steps, 11..16. Steps 11, 13 and 16 are detail steps (split measured); the values on
# the other steps are junk that must not count.
SIX = make_columns(
    [1, 3, 2, 8, 4, 6],  # sum 24; sorted 1 2 3 4 6 8
    first=11,
    data_wait_seconds=[0.5, 1, 0, 2, 0.5, 2],  # sum 6; sorted 0 .5 .5 1 2 2
    samples=[16, 16, 32, 16, 16, 0],  # 96
    fetches=[1, 1, 2, 1, 1, 1],  # 7
    detailed=[True, False, True, False, False, True],
    forward_seconds=[0.25, 9, 0.5, 9, 9, 2.5],
    backward_seconds=[0.25, 9, 0.5, 9, 9, 1],
    optimizer_seconds=[0.25, 9, 0.25, 9, 9, 1],
    backward_passes=[1, 5, 2, 5, 5, 3],
    optimizer_steps=[1, 1, 1, 1, 1, 0],
    skipped_steps=[0, 0, 1, 0, 0, 1],
    syncs=[-1, 2, -1, 4, -1, -1],
    gpu_seconds=[0.5, -1, 1.5, -1, -1, -1],
    losses=[2.0, None, 1.0, None, None, INF],
)


def test_summarize_step_time_and_ratios():
    s = summarize(SIX)
    assert (s["steps"], s["first_step"], s["last_step"], s["seconds"]) == (6, 11, 16, 24)
    # median: position 5*0.5 = 2.5 -> 3 + (4-3)*0.5; p90: position 4.5 -> 6 + (8-6)*0.5.
    assert s["step_seconds"] == {"median": 3.5, "mean": 4.0, "p90": 7.0, "min": 1, "max": 8}
    assert s["stall_ratio"] == 6 / 24  # time-weighted, not a mean of per-step ratios
    assert s["steps_per_second"] == 6 / 24
    assert s["samples_per_second"] == 96 / 24
    assert s["batch_size"] == 96 / 7
    assert s["fetches_per_step"] == 7 / 6
    assert s["data_wait_seconds"] == {"median": 0.75, "mean": 1.0}
    assert s["optimizer_steps"] == 5
    assert s["skipped_steps"] == 2
    assert s["syncs_per_step"] == 3.0  # (2 + 4) / 2 sampled steps; -1 is "not sampled"
    assert s["sync_sampled_steps"] == 2
    # GPU time on two steps: 0.5, 1.5; p90 at position 0.9.
    assert s["gpu_seconds"] == {"median": 1.0, "mean": 1.0, "p90": pytest.approx(1.4, rel=1e-12),
                                "min": 0.5, "max": 1.5}


def test_summarize_phases_come_from_detail_steps_only():
    s = summarize(SIX)
    assert s["detailed_steps"] == 3
    assert s["backward_passes_per_step"] == (1 + 2 + 3) / 3
    # Detail steps 11, 13, 16: step seconds 1 + 2 + 6 = 9.
    assert s["forward_seconds"] == {"median": 0.5, "mean": 3.25 / 3}  # 0.25, 0.5, 2.5
    assert s["backward_seconds"] == {"median": 0.5, "mean": 1.75 / 3}  # 0.25, 0.5, 1
    assert s["optimizer_seconds"] == {"median": 0.25, "mean": 1.5 / 3}  # 0.25, 0.25, 1
    assert s["forward_ratio"] == 3.25 / 9
    assert s["backward_ratio"] == 1.75 / 9
    assert s["optimizer_ratio"] == 1.5 / 9
    # Other = step - wait - split, clipped at 0: 1-(.5+.25+.25+.25) = -.25 -> 0;
    # 2-(0+.5+.5+.25) = .75; 6-(2+2.5+1+1) = -.5 -> 0 (unclipped, the median would be -.25).
    assert s["other_seconds"] == {"median": 0.0, "mean": 0.25}
    assert s["other_ratio"] == 0.75 / 9
    sums = s["sums"]
    assert sums["detailed_seconds"] == 9
    assert sums["detailed_data_wait_seconds"] == 2.5  # 0.5 + 0 + 2
    assert sums["detailed_other_seconds"] == 0.75
    assert (sums["forward_seconds"], sums["backward_seconds"], sums["optimizer_seconds"]) == (3.25, 1.75, 1.5)


def test_summarize_sums():
    sums = summarize(SIX)["sums"]
    assert sums["steps"] == 6 and sums["seconds"] == 24 and sums["data_wait_seconds"] == 6
    assert sums["samples"] == 96 and sums["fetches"] == 7
    assert sums["optimizer_steps"] == 5 and sums["skipped_steps"] == 2
    assert sums["sync_sampled_steps"] == 2 and sums["syncs"] == 6
    assert sums["detailed_steps"] == 3
    assert sums["losses_read"] == 3 and sums["nonfinite_losses"] == 1
    assert sums["last_loss"] == INF  # the last loss read, finite or not


def test_summarize_loss_statistics():
    # Known losses 2, 1, inf: finite 2 and 1.
    assert summarize(SIX)["loss"] == {
        "last": INF, "median": 1.5, "max": 2.0, "read_steps": 3, "nonfinite_steps": 1, "trend": None,
    }
    assert summarize(make_columns([1.0, 1.0]))["loss"] is None  # no loss read


def test_summarize_all_losses_non_finite():
    loss = summarize(make_columns([1.0, 1.0], losses=[NAN, INF]))["loss"]
    assert loss["median"] is None and loss["max"] is None
    assert loss["read_steps"] == 2 and loss["nonfinite_steps"] == 2


def test_summarize_without_a_timed_model_reports_forward_and_other_as_unknown():
    s = summarize(SIX, forward_measured=False)
    for name in ("forward_seconds", "forward_ratio", "other_seconds", "other_ratio"):
        assert s[name] is None, name
    assert s["backward_seconds"] == {"median": 0.5, "mean": 1.75 / 3}
    assert s["optimizer_ratio"] == 1.5 / 9


def test_summarize_without_detail_steps():
    s = summarize(make_columns([1.0, 2.0], forward_seconds=[5, 5]))
    for part in SPLIT + ("other_seconds",):
        assert s[part] is None and s[part.replace("_seconds", "_ratio")] is None
    assert s["detailed_steps"] == 0 and s["backward_passes_per_step"] is None
    assert s["sums"]["forward_seconds"] == 0  # junk on non-detail steps is not summed
    assert s["gpu_seconds"] is None and s["syncs_per_step"] is None


def test_summarize_without_samples_or_time():
    s = summarize(make_columns([0.0, 0.0], samples=[0, 0]))
    assert s["samples_per_second"] is None
    assert s["stall_ratio"] is None and s["steps_per_second"] is None  # no time: no ratio


def test_a_loop_without_a_dataloader_has_its_batch_from_the_intervals_that_saw_one():
    # No fetches: 16 rows a forward, seen on a detail step of the first interval; the second
    # interval (one step, no detail step) saw none: its samples are unknown, not zero.
    seen = summarize(make_columns([0.01] * 4, samples=[0] * 4, fetches=[0] * 4, detailed=[True] + [False] * 3,
                                  input_samples=[16.0, -1.0, -1.0, -1.0]))
    unseen = summarize(make_columns([0.01], first=5, samples=[0], fetches=[0]))
    assert seen["batch_size"] == 16 and unseen["batch_size"] is None and unseen["samples_per_second"] is None
    totals = Totals()
    totals.add(seen)
    totals.add(unseen)
    assert totals.summary()["samples_per_second"] == pytest.approx(16 / 0.01)  # the batch seen, every step
    assert combine([seen, unseen])["batch_size"] == 16


def test_summarize_of_no_steps_is_none():
    assert summarize(make_columns([])) is None


def test_summarize_loss_trend():
    # 20 finite losses: earlier half median 2, later 1: (1 - 2) / 2.
    loss = summarize(make_columns([1.0] * 20, losses=[2.0] * 10 + [1.0] * 10))["loss"]
    assert loss["trend"] == -0.5
    # 19 finite (one non-finite of 20): too few for a trend.
    loss = summarize(make_columns([1.0] * 20, losses=[2.0] * 10 + [1.0] * 9 + [NAN]))["loss"]
    assert loss["trend"] is None


def test_totals_add_and_summary():
    a_steps = [0.001, 0.002, 0.0025]
    a = summarize(make_columns(a_steps, losses=[3.0, None, 2.0], data_wait_seconds=[0.0005, 0, 0],
                               syncs=[2, -1, -1], detailed=[True, True, False],
                               forward_seconds=[0.0005, 0.0005, 0]))
    b_steps = [0.5, 100.0]
    b = summarize(make_columns(b_steps, skipped_steps=[1, 0], samples=[4, 4], syncs=[-1, 4]))
    totals = Totals()
    totals.add(a, a_steps, last_step_time=5.0)
    totals.add(b, b_steps)
    for name in Totals.ADDED:
        assert totals.sums[name] == a["sums"][name] + b["sums"][name], name
    assert totals.last_loss == 2.0  # b read no loss: a's last stays
    assert totals.last_step_time == 5.0  # None leaves it
    out = totals.summary()
    seconds = a["sums"]["seconds"] + b["sums"]["seconds"]
    assert out["steps"] == 5 and isinstance(out["steps"], int)
    assert out["seconds"] == seconds
    assert out["samples"] == 3 * 8 + 8
    assert out["optimizer_steps"] == 5 and out["skipped_steps"] == 1
    assert out["stall_ratio"] == 0.0005 / seconds
    assert out["steps_per_second"] == 5 / seconds
    assert out["samples_per_second"] == 32 / seconds
    assert out["syncs_per_step"] == 3.0  # (2 + 4) / 2
    assert out["detailed_steps"] == 2
    assert out["forward_ratio"] == 0.001 / (0.001 + 0.002)
    assert out["backward_ratio"] == 0.0
    assert (out["losses_read"], out["nonfinite_losses"], out["last_loss"]) == (2, 0, 2.0)
    assert out["dropped_steps"] == 0
    totals.dropped_steps = 3
    assert totals.summary()["dropped_steps"] == 3


def test_totals_step_histogram_buckets():
    totals = Totals()
    values = [0.001, 0.002, 0.0025, 0.0026, 0.5, 60.0, 100.0]
    totals.add(summarize(make_columns(values)), values)
    expected = [0] * (len(STEP_BUCKETS) + 1)
    expected[0] = 1  # 0.001: an upper bound is inclusive (Prometheus "le")
    expected[1] = 2  # 0.002, 0.0025
    expected[2] = 1  # 0.0026 <= 0.005
    expected[STEP_BUCKETS.index(0.5)] = 1
    expected[STEP_BUCKETS.index(60.0)] = 1
    expected[-1] = 1  # 100 s: +Inf
    assert totals.step_buckets == expected
    assert sum(totals.step_buckets) == len(values)  # per bucket, not cumulative


def test_totals_add_tolerates_older_sums():
    # A run log from an older version lacks the newer sums: they count as 0.
    interval = summarize(make_columns([1.0, 1.0]))
    del interval["sums"]["detailed_other_seconds"], interval["sums"]["detailed_data_wait_seconds"]
    totals = Totals()
    totals.add(interval)
    assert totals.sums["detailed_other_seconds"] == 0 and totals.sums["steps"] == 2


def test_totals_of_nothing():
    out = Totals().summary()
    assert out["steps"] == 0 and out["stall_ratio"] is None and out["samples_per_second"] is None
    assert out["last_loss"] is None and out["forward_ratio"] is None


# ============================================================================================
# measure/history.py
# ============================================================================================


def test_weighted_median_plain():
    assert weighted_median([(3, 1), (1, 1), (2, 1)]) == 2
    assert weighted_median([(1, 1), (2, 1)]) == 1  # running weight 1 reaches half of 2: the lower


def test_weighted_median_weights():
    # Total 7, half 3.5: the value 1 alone carries 5.
    assert weighted_median([(100, 1), (1, 5), (10, 1)]) == 1
    # Total 7, half 3.5: 1 (1), 10 (2), 100 (6): reached at 100.
    assert weighted_median([(1, 1), (10, 1), (100, 5)]) == 100


def test_weighted_median_q():
    # Ten values of weight 1: 0.9 of 10 = 9 is reached at the 9th.
    assert weighted_median([(v, 1) for v in range(1, 11)], q=0.9) == 9
    # Weight 9 on 1, 1 on 50: 0.9 of 10 is reached by 1's own weight.
    assert weighted_median([(1, 9), (50, 1)], q=0.9) == 1
    assert weighted_median([(1, 8), (50, 2)], q=0.9) == 50


def test_weighted_median_ignores_zero_weights_and_none_values():
    # With q=0 the first value carrying weight is the answer: a zero-weight 1 is not.
    assert weighted_median([(1, 0), (2, 1)], q=0.0) == 2
    assert weighted_median([(0, 0), (5, 1), (9, 1)]) == 5
    assert weighted_median([(-1, -3), (5, 1)]) == 5  # negative weights too
    assert weighted_median([(None, 5), (2, 1), (3, 1)]) == 2
    assert weighted_median([(None, 5)]) is None


def test_weighted_median_of_nothing():
    assert weighted_median([]) is None
    assert weighted_median([(1, 0), (2, 0)]) is None


# Interval A: steps 1-2, both detail steps; interval B: steps 3-6, one detail step (3).
A_COLUMNS = make_columns(
    [1, 1], first=1,
    data_wait_seconds=[0.25, 0.25],
    detailed=[True, True],
    forward_seconds=[0.25, 0.25], backward_seconds=[0.25, 0.25], optimizer_seconds=[0.125, 0.125],
    backward_passes=[1, 1],
    syncs=[2, -1],
    losses=[1.0, 2.0],  # median 1.5, 2 read
)
B_COLUMNS = make_columns(
    [3, 3, 3, 4], first=3,
    data_wait_seconds=[1, 0.5, 0.5, 1],
    fetches=[1, 2, 1, 1],
    detailed=[True, False, False, False],
    forward_seconds=[0.5, 0, 0, 0], backward_seconds=[1, 0, 0, 0], optimizer_seconds=[0.25, 0, 0, 0],
    backward_passes=[2, 0, 0, 0],
    optimizer_steps=[1, 0, 1, 1], skipped_steps=[0, 1, 0, 0],
    syncs=[-1, -1, 4, -1],
    gpu_seconds=[2.0, -1, -1, 2.5],
    losses=[4.0, None, NAN, 3.0],  # finite 4, 3: median 3.5; 3 read, one non-finite
)


def test_combine_sums_add_exactly():
    a, b = summarize(A_COLUMNS), summarize(B_COLUMNS)
    both = combine([a, b])
    for name in Totals.ADDED + ("fetches",):
        assert both["sums"][name] == a["sums"][name] + b["sums"][name], name
    assert both["sums"]["last_loss"] == 3.0
    assert (both["steps"], both["first_step"], both["last_step"]) == (6, 1, 6)


def test_combine_means_and_ratios_equal_those_of_the_steps_together():
    both = combine([summarize(A_COLUMNS), summarize(B_COLUMNS)])
    whole = summarize(concat(A_COLUMNS, B_COLUMNS))
    exact = pytest.approx
    for name in ("seconds", "stall_ratio", "steps_per_second", "samples_per_second", "batch_size",
                 "fetches_per_step", "optimizer_steps", "skipped_steps", "syncs_per_step",
                 "sync_sampled_steps", "detailed_steps", "forward_ratio", "backward_ratio",
                 "optimizer_ratio", "other_ratio"):
        assert both[name] == exact(whole[name], rel=1e-12), name
    for part in SPLIT + ("other_seconds", "data_wait_seconds"):
        assert both[part]["mean"] == exact(whole[part]["mean"], rel=1e-12), part
    for key in ("mean", "min", "max"):
        assert both["step_seconds"][key] == exact(whole["step_seconds"][key], rel=1e-12), key
    assert both["gpu_seconds"]["mean"] == whole["gpu_seconds"]["mean"] == 2.25
    for key in ("last", "max", "read_steps", "nonfinite_steps"):
        assert both["loss"][key] == whole["loss"][key], key
    # Spot values: 2 + 13 = 15 s over 6 steps; 0.5 + 3 = 3.5 s of data wait; 6 syncs on 2 sampled steps.
    assert both["step_seconds"]["mean"] == 15 / 6
    assert both["stall_ratio"] == 3.5 / 15
    assert both["syncs_per_step"] == 3.0


def test_combine_medians_are_weighted_medians_of_medians():
    a, b = summarize(A_COLUMNS), summarize(B_COLUMNS)
    both = combine([a, b])
    # Step time: A's median 1 (2 steps), B's 3 (4 steps): half of 6 is reached at B.
    # (Unweighted, the lower of the two would win.)
    assert both["step_seconds"]["median"] == 3
    # p90: 0.9 of 6 = 5.4 reached at B's p90 (3 + (4-3) * 0.7).
    assert both["step_seconds"]["p90"] == b["step_seconds"]["p90"]
    # Data wait: A 0.25 (2 steps), B 0.75 (4 steps).
    assert both["data_wait_seconds"]["median"] == 0.75
    # Phases weigh by detail steps: forward A 0.25 (2 detail steps), B 0.5 (1): 0.25.
    # (Weighted by steps, B's 4 would win.)
    assert both["forward_seconds"]["median"] == 0.25
    assert both["backward_passes_per_step"] == 1.0  # A 1.0 (2 detail steps), B 2.0 (1)
    # Loss weighs by losses read: A 1.5 (2 read), B 3.5 (3 read): half of 5 reached at B.
    assert both["loss"]["median"] == 3.5
    assert both["gpu_seconds"]["median"] == 2.25  # B alone measured GPU time


def test_combine_p90_is_the_step_weighted_90th_percentile_of_the_p90s():
    fast = summarize(make_columns([1.0] * 5))  # p90 1
    slow = summarize(make_columns([2.0] * 4, first=6))  # p90 2
    both = combine([fast, slow])
    # 9 steps: half (4.5) is reached within the 5 fast steps, 0.9 of 9 (8.1) only at the slow ones.
    assert both["step_seconds"]["median"] == 1.0
    assert both["step_seconds"]["p90"] == 2.0
    assert (both["step_seconds"]["min"], both["step_seconds"]["max"]) == (1.0, 2.0)


def test_combine_of_one_interval_is_that_interval():
    a = summarize(A_COLUMNS)
    assert combine([a]) is a
    assert combine([None, a, {"steps": 0}]) is a  # empty entries are left out
    assert combine([]) is None
    assert combine([None]) is None


def test_combine_forward_unknown_in_one_interval_is_unknown():
    a = summarize(A_COLUMNS, forward_measured=False)
    both = combine([a, summarize(B_COLUMNS)])
    assert both["forward_seconds"] is None and both["other_seconds"] is None
    assert both["backward_seconds"] is not None


def test_run_history_coarsens_the_older_half_pair_by_pair():
    history = RunHistory(max_intervals=8)
    events = [steps_event(10 * i + 1, 10, float(i + 1)) for i in range(9)]  # steps 1-90
    for event in events[:8]:
        history.add(event)
    assert history.intervals == [without_event(e) for e in events[:8]]  # at the limit: untouched
    history.add(events[8])
    # 9 > 8: the older half (4) merged pair by pair into 2; the newer 5 untouched.
    intervals = history.intervals
    assert len(intervals) == 7
    assert intervals[0] == combine([without_event(events[0]), without_event(events[1])])
    assert intervals[1] == combine([without_event(events[2]), without_event(events[3])])
    assert (intervals[0]["first_step"], intervals[0]["last_step"], intervals[0]["steps"]) == (1, 20, 20)
    assert (intervals[1]["first_step"], intervals[1]["last_step"], intervals[1]["steps"]) == (21, 40, 20)
    assert intervals[0]["sums"]["seconds"] == 10 * 1 + 10 * 2
    assert intervals[2:] == [without_event(e) for e in events[4:]]


def test_run_history_coarsening_an_odd_older_half_keeps_its_last_one():
    history = RunHistory(max_intervals=6)
    events = [steps_event(10 * i + 1, 10, 1.0) for i in range(7)]
    for event in events:
        history.add(event)
    # 7 > 6: older half 3 -> (1,2) merged, 3 as is; then 4..7.
    assert [(e["first_step"], e["last_step"]) for e in history.intervals] == [
        (1, 20), (21, 30), (31, 40), (41, 50), (51, 60), (61, 70)]
    assert history.intervals[1] == without_event(events[2])


def test_run_history_coarsening_preserves_steps_and_sums():
    coarse, fine = RunHistory(max_intervals=8), RunHistory(max_intervals=1000)
    events = [steps_event(5 * i + 1, 5, float(i % 7 + 1), samples=[i % 3 + 1] * 5) for i in range(40)]
    for event in events:
        coarse.add(event)
        fine.add(event)
    assert len(coarse.intervals) <= 8 and len(fine.intervals) == 40
    # The intervals still tile steps 1..200 in order.
    assert coarse.intervals[0]["first_step"] == 1 and coarse.steps == 200
    for before, after in zip(coarse.intervals, coarse.intervals[1:]):
        assert after["first_step"] == before["last_step"] + 1
    assert sum(e["steps"] for e in coarse.intervals) == 200
    # Whole-number sums, so they add up exactly in any order.
    assert coarse.totals() == fine.totals()
    assert coarse.totals()["seconds"] == sum(5 * (i % 7 + 1) for i in range(40))
    assert coarse.intervals[-1] == without_event(events[-1])
    assert MAX_INTERVALS == RunHistory().max_intervals


def history_of_10_step_intervals(count):
    history = RunHistory()
    for i in range(count):
        history.add(steps_event(10 * i + 1, 10, 1.0))
    return history


def test_run_history_window_takes_whole_intervals():
    history = history_of_10_step_intervals(8)  # steps 1-80
    window = history.window(25)  # 71-80, 61-70, 51-60: 30 >= 25
    assert (window["first_step"], window["last_step"], window["steps"]) == (51, 80, 30)
    assert history.window(30)["first_step"] == 51
    assert history.window(31)["first_step"] == 41
    assert history.window(5)["first_step"] == 71  # one interval: itself
    assert history.window(5) == history.intervals[-1]


def test_run_history_window_leaves_out_the_warm_up_when_enough_later_steps_exist():
    # Steps 1-80: back to 21-30 the window has 60 >= 50 steps, so 11-20 (last step 20 <=
    # WARMUP_STEPS) is left out.
    window = history_of_10_step_intervals(8).window(1000)
    assert (window["first_step"], window["steps"]) == (21, 60)
    # Steps 1-60: at 11-20 only 40 later steps: it is taken (50), then 1-10 is left out.
    window = history_of_10_step_intervals(6).window(1000)
    assert (window["first_step"], window["steps"]) == (11, 50)
    # Steps 1-30: too few steps past the warm-up, so everything.
    window = history_of_10_step_intervals(3).window(1000)
    assert (window["first_step"], window["steps"]) == (1, 30)


def test_run_history_host_cpu_is_averaged_over_the_samples_past_the_warm_up():
    # Steps 1-30 in intervals written at ticks 1001, 1011 and 1021 (the window: all 30 steps,
    # too few past the warm-up; the first two hold warm-up steps only), each tick's host sample
    # taken just before its steps: 0.5 cores at 1000.99 (since the start), 1.0 at 1010.99 (the
    # warm-up's steps), then 2.0 at 1015.5 and 1020.99.
    def system(time, cores):
        return {"event": "system", "time": time, "host": {"cpu_ratio": cores, "busy_cores": cores}}

    history = RunHistory()
    history.add(system(1000.99, 0.5))
    history.add(steps_event(1, 10, 1.0))
    # Before an interval past the warm-up has closed: every sample in the window (991-1001).
    assert history.snapshot()["system"]["host"]["cpu_ratio"] == pytest.approx(0.5)
    history.add(system(1010.99, 1.0))
    history.add(steps_event(11, 10, 1.0))
    history.add(system(1015.5, 2.0))
    history.add(system(1020.99, 2.0))
    history.add(steps_event(21, 10, 1.0))
    host = history.snapshot()["system"]["host"]
    assert host["cpu_ratio"] == pytest.approx(2.0) and host["busy_cores"] == pytest.approx(2.0)
    # No interval past the warm-up yet: the window's samples, as before.
    early = RunHistory()
    for event in (system(1000.99, 1.0), steps_event(1, 10, 1.0), system(1010.99, 3.0), steps_event(11, 10, 1.0)):
        early.add(event)
    assert early.snapshot()["system"]["host"]["cpu_ratio"] == pytest.approx(2.0)


def test_run_history_window_of_nothing():
    assert RunHistory().window(100) is None


def test_run_history_totals():
    history = RunHistory()
    history.add(steps_event(1, 3, 2.0, losses=[5.0, None, 4.0]))
    history.add(steps_event(4, 2, 1.0, data_wait_seconds=[0.5, 0.5]))
    totals = history.totals()
    assert totals["steps"] == 5 and totals["seconds"] == 8.0
    assert totals["stall_ratio"] == 1.0 / 8.0
    assert totals["samples"] == 40 and totals["last_loss"] == 4.0 and totals["losses_read"] == 2
    # The end event's totals (the agent's exact counters) win.
    history.add({"event": "end", "totals": {"steps": 99}})
    assert history.totals() == {"steps": 99}


def test_run_history_snapshot_window():
    history = history_of_10_step_intervals(8)
    snapshot = history.snapshot(20)
    assert (snapshot["window"]["first_step"], snapshot["window"]["steps"]) == (61, 20)
    assert snapshot["totals"] == history.totals() and snapshot["totals"]["steps"] == 80
    assert snapshot["attached"] is True
    # A window given by the caller (a live agent's exact one) is taken as it is.
    exact = summarize(make_columns([0.5] * 7, first=74))
    snapshot = history.snapshot(20, window=exact)
    assert snapshot["window"] is exact
    history.add({"event": "end"})
    snapshot = history.snapshot()
    assert snapshot["attached"] is False and snapshot["state"] == "ended"
    assert snapshot["window"]["first_step"] == 21  # 1000 steps asked, warm-up left out


# ============================================================================================
# measure/steps.py
# ============================================================================================


class Optimizer:
    """Stands for an optimizer: the timeline only takes its id()."""


def fetch(tl, began, ended, samples=8):
    """What the loader's __next__ wrapper does around a fetch (loader.py)."""
    tl.moved_on(began)
    tl.fetches += 1
    tl.samples += samples
    tl.data_wait += ended - began


class HookProbe:
    """What the optimizer hooks (hotpath.optimizer_hooks) need of OptimizerProbe; its clock
    reads `now`."""

    def __init__(self, tl):
        self.timeline, self.now, self.measured, self.unmeasured_steps = tl, 0.0, set(), 0
        self.guard_before = self.guard_after = self.gradients = None

    def clock(self):
        return self.now

    def admit(self, optimizer):
        self.measured.add(id(optimizer))
        return True

    def read_rate(self, optimizer):
        pass

    def fail(self, exc):
        raise exc


def optimizer_step(tl, optimizer, began, ended):
    """optimizer.step() from `began` to `ended`, through the real pre- and post-hooks."""
    probe = HookProbe(tl)
    pre, post = optimizer_hooks(probe)
    probe.now = began
    pre(optimizer, (), {})
    probe.now = ended
    post(optimizer, (), {})


def timeline(capacity=16):
    failures = []
    tl = StepTimeline(capacity, lambda name, exc: failures.append((name, exc)))
    tl.attached_at = 0.0
    return tl


def record(end, skipped=0, detailed=True, **totals):
    """A ring record: the close time, running totals (0 unless given), the detail flag."""
    return step_records.record(end, detailed, **{"skipped_steps": skipped, **totals})


def totals_of(record):
    """A record's running totals by name, read the plain way (steps.record's layout)."""
    return dict(zip(CUMULATIVE, record[1:-1] + record[-1][:-1]))


def ring_of(capacity, count, origin=0.0):
    """A ring with steps 1..count closed, step s ending at s * 1.5 s (origin 0), s samples
    in step s (running total s*(s+1)/2), skipped on every third step."""
    ring = StepRing(capacity)
    ring.origin = record(origin)
    for step in range(1, count + 1):
        ring.records[(step - 1) % capacity] = record(
            step * 1.5, samples=step * (step + 1) // 2, skipped=step // 3, detailed=step % 2 == 1)
    ring.count = count
    return ring


def test_step_ring_holds():
    ring = ring_of(4, 6)  # holds 4 slots: the open step 7 and closed 6, 5, 4
    assert [s for s in range(0, 10) if ring.holds(s)] == [4, 5, 6, 7]
    assert [s for s in range(0, 5) if StepRing(4).holds(s)] == [1]  # nothing closed: the open step 1


def test_step_ring_put_sets_and_adds():
    ring = ring_of(4, 2)
    ring.put("syncs", 2, 3.0)
    ring.put("syncs", 2, 5.0)  # set: replaces
    assert ring.syncs[1] == 5.0 and ring.syncs_step[1] == 2
    ring.put("late_skips", 2, 1.0, add=True)
    ring.put("late_skips", 2, 1.0, add=True)  # add: on top of its own value
    assert ring.late_skips[1] == 2.0


def test_a_step_that_compiled_is_a_warm_up_step_without_its_compile_time():
    # Steps 1..4 of 1.5 s each, odd ones detailed; 0.5 s then 0.25 s of compilation in step 3.
    ring = ring_of(8, 4)
    ring.put("compile_seconds", 3, 0.5, add=True)
    ring.put("compile_seconds", 3, 0.25, add=True)
    columns = ring.columns(1, 4)
    assert columns["step_seconds"] == [1.5, 1.5, 0.75, 1.5]
    assert columns["detailed"] == [True, False, False, False]  # step 3 gives no phase split
    summary = summarize(columns, ordered=sorted(columns["step_seconds"]))  # (as the drain passes it)
    sums = summary["sums"]
    assert (sums["steps"], sums["seconds"], sums["compile_seconds"], sums["warmup_steps"]) == (4, 5.25, 0.75, 1)
    assert sums["detailed_steps"] == 1
    # ... and no step-time statistic: those are steps 1, 2 and 4's (step 3's 0.75 s left out).
    assert summary["step_seconds"] == {"median": 1.5, "mean": 1.5, "p90": 1.5, "min": 1.5, "max": 1.5}
    # A window of warm-up steps only: their own statistics (there are no others).
    ring.put("compile_seconds", 1, 0.1, add=True)
    ring.put("compile_seconds", 2, 0.1, add=True)
    ring.put("compile_seconds", 4, 0.1, add=True)
    assert summarize(ring.columns(1, 4))["step_seconds"]["min"] == pytest.approx(0.75)


def test_step_ring_put_add_does_not_add_to_another_steps_value():
    ring = ring_of(4, 2)
    ring.put("late_skips", 2, 7.0)
    ring.count = 5  # step 6 (open) now uses step 2's slot
    ring.put("late_skips", 6, 1.0, add=True)
    assert ring.late_skips[1] == 1.0 and ring.late_skips_step[1] == 6


def test_step_ring_put_is_ignored_once_the_slot_was_reused():
    ring = ring_of(4, 6)
    ring.put("loss", 3, 9.0)  # step 3's slot is step 7's now
    ring.put("loss", 8, 9.0)  # not yet held
    ring.put("loss", 0, 9.0)
    assert list(ring.loss_step) == [0, 0, 0, 0]
    ring.put("loss", 4, 9.0)
    assert ring.loss_step[3] == 4 and ring.loss[3] == 9.0


def test_step_ring_columns_are_differences_of_running_totals():
    ring = ring_of(8, 4)
    columns = ring.columns(1, 4)
    assert list(columns["step"]) == [1, 2, 3, 4]
    assert columns["step_seconds"] == [1.5, 1.5, 1.5, 1.5]  # step 1 against the origin (0.0)
    assert columns["samples"] == [1, 2, 3, 4]  # 1, 3, 6, 10 running
    assert columns["skipped_steps"] == [0, 0, 1, 0]  # 0, 0, 1, 1 running
    assert columns["detailed"] == [True, False, True, False]
    assert columns["data_wait_seconds"] == [0, 0, 0, 0]
    assert columns["loss_known"] == [False] * 4
    assert all(math.isnan(v) for v in columns["loss"])
    assert columns["syncs"] == [-1.0] * 4 and columns["gpu_seconds"] == [-1.0] * 4
    assert "late_skips" not in columns


def test_step_ring_step_one_is_measured_against_origin():
    ring = ring_of(8, 3, origin=1.0)
    assert ring.columns(1, 1)["step_seconds"] == [0.5]  # 1.5 - 1.0
    assert ring.columns(2, 3)["step_seconds"] == [1.5, 1.5]  # against step 1's record


def test_step_ring_columns_wrap_around():
    ring = ring_of(4, 6)  # slots hold 5, 6, 3, 4
    columns = ring.columns(1, 6)
    # Step 3's record is held but step 4 needs it: 4..6 (count - capacity + 2 = 4).
    assert list(columns["step"]) == [4, 5, 6]
    assert columns["samples"] == [4, 5, 6]
    assert columns["skipped_steps"] == [0, 0, 1]  # running 1, 1, 1, 2
    assert columns["detailed"] == [False, True, False]
    assert columns["step_seconds"] == [1.5, 1.5, 1.5]
    # A range that wraps from the last slot to the first.
    ring = ring_of(4, 9)  # holds 6..9; slot of 7 is 2, of 9 is 0
    assert ring.columns(7, 9)["samples"] == [7, 8, 9]


def test_step_ring_columns_clip_to_what_is_held():
    ring = ring_of(4, 6)
    assert list(ring.columns(5, 100)["step"]) == [5, 6]
    assert list(ring.columns(-3, 4)["step"]) == [4]
    empty = ring.columns(6, 5)
    assert list(empty["step"]) == [] and all(list(v) == [] for v in empty.values())
    assert all(list(v) == [] for v in StepRing(4).columns(1, 10).values())  # nothing closed
    # With as many steps as slots, step 1 is already gone (the open step 5 owns its slot).
    assert list(ring_of(4, 4).columns(1, 4)["step"]) == [2, 3, 4]
    assert list(ring_of(4, 3).columns(1, 4)["step"]) == [1, 2, 3]


def test_step_ring_late_values_only_for_their_owning_step():
    ring = ring_of(4, 2)
    ring.put("loss", 1, 0.5)
    ring.put("syncs", 2, 3.0)
    ring.put("gpu_seconds", 2, 0.25)
    columns = ring.columns(1, 2)
    assert columns["loss"][0] == 0.5 and math.isnan(columns["loss"][1])
    assert columns["loss_known"] == [True, False]
    assert columns["syncs"] == [-1.0, 3.0] and columns["gpu_seconds"] == [-1.0, 0.25]
    # Steps 5 and 6 reuse those slots without values of their own: none show.
    for step in range(3, 7):
        ring.records[(step - 1) % 4] = record(step * 1.5)
    ring.count = 6
    columns = ring.columns(5, 6)
    assert columns["loss_known"] == [False, False]
    assert columns["syncs"] == [-1.0, -1.0] and columns["gpu_seconds"] == [-1.0, -1.0]


def test_step_ring_skipped_steps_add_late_skips():
    ring = ring_of(8, 4)  # record skips 0, 0, 1, 0
    ring.put("late_skips", 3, 1.0, add=True)
    ring.put("late_skips", 4, 1.0, add=True)
    ring.put("late_skips", 4, 1.0, add=True)
    assert ring.columns(1, 4)["skipped_steps"] == [0, 0, 2, 2]


def reference_columns(ring, first, last):
    """StepRing.columns written step by step, the obvious way (a slot's side value counts
    only for the step that owns it; a step's time less its evaluation, own and compile time,
    never below 0; late skips added to the record's)."""
    first = max(first, ring.count - ring.capacity + 2, 1)
    last = min(last, ring.count)
    out = {"step": list(range(first, last + 1))}
    rows = [ring.origin if s == 1 else ring.records[(s - 2) % ring.capacity] for s in out["step"]]
    now = [ring.records[(s - 1) % ring.capacity] for s in out["step"]]
    for name in CUMULATIVE:
        out[name] = [totals_of(b)[name] - totals_of(a)[name] for a, b in zip(rows, now)]
    for name, missing in LATE:
        slots = [(s - 1) % ring.capacity for s in out["step"]]
        out[name] = [getattr(ring, name)[i] if getattr(ring, name + "_step")[i] == s else missing
                     for s, i in zip(out["step"], slots)]
    out["loss_known"] = [ring.loss_step[(s - 1) % ring.capacity] == s for s in out["step"]]
    out["step_seconds"] = [max(0.0, b[0] - a[0] - ev - own - comp) for a, b, ev, own, comp
                           in zip(rows, now, out["evaluation_seconds"], out["own_seconds"], out["compile_seconds"])]
    out["skipped_steps"] = [a + b for a, b in zip(out["skipped_steps"], out.pop("late_skips"))]
    out["detailed"] = [r[-1][-1] and not comp for r, comp in zip(now, out["compile_seconds"])]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_step_ring_columns_equal_the_step_by_step_reference(seed):
    # Random running totals in a ring that wrapped, side values on some steps only (some
    # sparse, one on every step), evaluation and own time, a step whose close came before its
    # predecessor's end (it reads 0 s, not less).
    rng = random.Random(seed)
    capacity, count = 64, 64 * 3 + rng.randrange(64)
    ring = StepRing(capacity)
    ring.origin = record(0.0)
    end, totals = 0.0, {name: 0 for name in CUMULATIVE}
    for step in range(1, count + 1):
        end += rng.choice((0.5, 1.0, 1.5, -0.25 if step % 17 == 0 else 0.75))
        totals["samples"] += rng.randrange(1, 9)
        totals["data_wait_seconds"] += rng.random()
        if rng.random() < 0.1:
            totals["evaluation_seconds"] += rng.random()
            totals["evaluations"] += 1
        made = record(end, detailed=rng.random() < 0.3, **totals)
        previous = ring.records[(step - 2) % capacity] if step > 1 else None
        if previous is not None and previous[-1] == made[-1]:  # plain steps share `rest`, as the close writes them
            made = made[:-1] + (previous[-1],)
        ring.records[(step - 1) % capacity] = made
        ring.count = step
        ring.put("gpu_seconds", step, rng.random())  # every step
        if rng.random() < 0.2:
            ring.put("loss", step, rng.random())
        if rng.random() < 0.05:
            ring.put("syncs", step, float(rng.randrange(4)))
            ring.put("own_seconds", step, rng.random() / 4)
            ring.put("late_skips", step, 1.0, add=True)
        if rng.random() < 0.02:
            ring.put("compile_seconds", step, rng.random())
    for first, last in ((1, count), (count - 40, count - 3), (count - capacity + 5, count - capacity + 30)):
        got, expected = ring.columns(first, last), reference_columns(ring, first, last)
        assert list(got.pop("step")) == expected.pop("step")
        assert got.keys() == expected.keys()
        for name, values in expected.items():
            assert len(got[name]) == len(values), name
            assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got[name], values)), name


def test_timeline_steps_close_at_the_next_fetch():
    tl, optimizer = timeline(), Optimizer()
    fetch(tl, 10.0, 10.25, samples=4)  # opens step 1 at 10.0
    optimizer_step(tl, optimizer, 10.5, 10.75)
    fetch(tl, 11.0, 11.5, samples=4)  # closes step 1 at 11.0; this wait is step 2's
    optimizer_step(tl, optimizer, 11.75, 12.25)
    fetch(tl, 12.5, 12.5, samples=2)  # closes step 2
    assert tl.ring.count == 2
    tl.manual_step(now=13.0)  # tuneup.step(): step 3, no optimizer in it
    fetch(tl, 13.0, 13.25, samples=4)
    optimizer_step(tl, optimizer, 13.5, 14.0)
    tl.flush()  # detach: step 4 ends at its last optimizer step
    assert tl.ring.count == 4
    columns = tl.ring.columns(1, 4)
    assert columns["step_seconds"] == [1.0, 1.5, 0.5, 1.0]
    assert columns["data_wait_seconds"] == [0.25, 0.5, 0.0, 0.25]
    assert columns["optimizer_seconds"] == [0.25, 0.5, 0.0, 0.5]
    assert columns["samples"] == [4, 4, 2, 4]
    assert columns["fetches"] == [1, 1, 1, 1]
    assert columns["optimizer_steps"] == [1, 1, 0, 1]
    assert columns["detailed"] == [True] * 4  # the first EARLY_DETAIL_STEPS steps
    tl.flush()  # nothing stepped since: no empty step
    assert tl.ring.count == 4


def test_timeline_detail_steps():
    tl = timeline(capacity=512)
    for step in range(1, 401):
        tl.manual_step(now=float(step))
    # The first five, then one step drawn from each block of 4 (detail_every): 5-8, 9-12, ...
    assert EARLY_DETAIL_STEPS == 5
    detailed = tl.ring.columns(1, 400)["detailed"]
    assert detailed[:5] == [True] * 5
    blocks = [detailed[start:start + 4] for start in range(8, 400, 4)]  # steps 9-12, ..., 397-400
    assert all(block.count(True) == 1 for block in blocks)
    assert sum(detailed[5:8]) <= 1  # block 5-8: its draw, unless it fell on an early step
    # Drawn, not every 4th: each position within a block is taken about as often.
    positions = [block.index(True) for block in blocks]
    assert all(positions.count(place) >= 10 for place in range(4)), positions


def test_the_detail_rate_is_paced_by_the_step_time_and_their_cost_unless_set():
    """Unset, one detail step in 4, fewer where their cost (DETAIL_COST until measured) would
    add over DETAIL_BUDGET to the training time, yet one in every DETAIL_PERIOD of training (one
    in 256 always allowed) and never fewer than one in MAX_DETAIL_EVERY, and not before
    PACED_FROM_STEP steps; a rate the job set stays as set."""
    assert (DETAIL_EVERY, DETAIL_BUDGET, DETAIL_COST, DETAIL_PERIOD, MIN_PERIOD_EVERY, MAX_DETAIL_EVERY,
            PACED_FROM_STEP) == (4, 0.002, 150e-6, 0.1, 256, 4096, 1000)
    tl = timeline(capacity=2048)
    for step in range(1, PACED_FROM_STEP):
        tl.manual_step(now=float(step))
    tl.pace(0.0001)
    assert tl.detail_every == 4  # a short run: not yet
    tl.manual_step(now=float(PACED_FROM_STEP))
    # 150 µs a detail step, at most 0.2% of the training: one in 150e-6 / (0.002 * median)
    # (the period binds below 0.4 ms: 0.1 s of 0.1 ms steps is 1,000 of them; 0.1 s of 1 µs ones, over 4,096)
    for median, every in ((0.04, 4), (0.01, 8), (0.005, 15), (0.002, 38), (0.001, 75), (0.00036, 209),
                          (0.0001, 750), (0.00002, 3750), (1e-6, 4096), (2.0, 4), (0.0, 4)):  # (no median: as it was)
        tl.pace(median)
        assert tl.detail_every == every, (median, tl.detail_every)
    # A measured cost: a cheap detail step comes more often, a dear one less.
    # ... and where the budget would space them further: one in every DETAIL_PERIOD of training
    # (0.1 s of 0.1 ms steps), or one in MIN_PERIOD_EVERY where that is sooner (1 ms steps).
    for median, cost, every in ((0.01, 20e-6, 4), (0.001, 20e-6, 10), (0.0001, 20e-6, 100), (0.001, 400e-6, 200),
                                (0.0001, 0.0, 4), (0.0001, 400e-6, 1000), (0.001, 1e-3, 256)):
        tl.pace(median, cost)
        assert tl.detail_every == every, (median, cost, tl.detail_every)
    for chosen in (1, 4, 7):
        fixed = StepTimeline(16, lambda name, exc: None, chosen)
        fixed.ring.count = PACED_FROM_STEP
        fixed.pace(0.0001)
        assert fixed.detail_every == chosen


def test_a_detail_step_s_cost_is_its_own_and_the_next_step_s_extra_time():
    """windows.detail_pairs and detail_cost on hand-made columns: detail steps of 300 µs whose
    next step takes 150 µs, among plain steps of 100 µs, cost 250 µs; a detail step followed by
    another gives no pair; fewer than MIN_DETAIL_PAIRS pairs, or a cost that reads negative,
    are None and 0."""
    def cost(columns):
        return detail_cost(*detail_pairs(columns))

    blocks = MIN_DETAIL_PAIRS + 2
    seconds, detailed = [], []
    for block in range(blocks):
        seconds += [300e-6, 150e-6] + [100e-6] * 8
        detailed += [True] + [False] * 9
    pairs, plain = detail_pairs({"step_seconds": seconds, "detailed": detailed})
    assert pairs == [pytest.approx(450e-6)] * blocks and len(plain) == 8 * blocks  # (not the steps right after one)
    assert cost({"step_seconds": seconds, "detailed": detailed}) == pytest.approx(250e-6)
    # The run's first five steps are detail steps one after another (and the next block begins
    # with one): none of them pairs.
    early = {"step_seconds": [400e-6] * 5 + seconds, "detailed": [True] * 5 + detailed}
    assert len(detail_pairs(early)[0]) == blocks and cost(early) == pytest.approx(250e-6)
    few = {"step_seconds": seconds[:10 * (MIN_DETAIL_PAIRS - 1)], "detailed": detailed[:10 * (MIN_DETAIL_PAIRS - 1)]}
    assert cost(few) is None
    cheap = {"step_seconds": [90e-6, 100e-6] + [100e-6] * 8, "detailed": [True] + [False] * 9}
    cheap = {name: values * blocks for name, values in cheap.items()}
    assert cost(cheap) == 0.0


def test_paced_detail_steps_stay_drawn_from_blocks():
    """The rate changes between detail steps: the draw after it comes from blocks of the new size."""
    tl = timeline(capacity=2048)
    for step in range(1, 1001):
        tl.manual_step(now=float(step))
    tl.pace(0.0075)  # one in 10 from here (DETAIL_COST / (DETAIL_BUDGET * 7.5 ms))
    assert tl.detail_every == 10
    for step in range(1001, 1901):
        tl.manual_step(now=float(step))
    detailed = tl.ring.columns(1001, 1900)["detailed"]
    blocks = [detailed[start:start + 10] for start in range(10, 900, 10)]  # steps 1011-1020, ..., 1891-1900
    assert all(block.count(True) == 1 for block in blocks)


def test_sampled_steps_do_not_alias_with_a_loop_period():
    """A read every 50 steps (evaluation, logging) against steps sampled from blocks of 20:
    every 20th would meet it on every sampled step it shares with 100; drawn at random, the
    average over the samples is close to the truth (1 in 50)."""
    from tuneup.measure.steps import sampled_after

    samples, step = [], 0
    while True:
        step = sampled_after(step, 20)
        if step > 200_000:
            break
        samples.append(step)
    assert len(samples) == 10_000
    assert all(sampled_after(s - 1, 20) == s for s in samples[:100])  # a pure function of the block
    on_period = sum(1 for s in samples if s % 50 == 0) / len(samples)
    assert on_period == pytest.approx(1 / 50, abs=0.006)
    every_20th = sum(1 for s in range(20, 200_001, 20) if s % 50 == 0) / 10_000
    assert every_20th == pytest.approx(1 / 5)  # what every Nth sampling saw


def test_timeline_first_step_starts_at_attach_when_nothing_came_before():
    tl = timeline()
    tl.attached_at = 5.0
    tl.manual_step(now=6.5)
    assert tl.ring.columns(1, 1)["step_seconds"] == [1.5]


def test_moved_on_a_fetch_after_an_optimizer_stepped_closes_the_step():
    tl, optimizer = timeline(), Optimizer()
    tl.moved_on(1.0)
    tl.moved_on(2.0)  # a second fetch before any optimizer step: step 1 still open from 1.0
    assert tl.ring.count == 0 and tl.step_start == 1.0
    optimizer_step(tl, optimizer, 2.5, 3.0)
    tl.moved_on(4.0)
    assert tl.ring.count == 1
    assert tl.ring.columns(1, 1)["step_seconds"] == [3.0]  # 1.0 to 4.0
    tl.moved_on(5.0)  # nothing stepped in step 2 yet: it stays open
    assert tl.ring.count == 1


def test_moved_on_a_second_optimizer_in_the_same_iteration_does_not_close():
    tl, generator, discriminator = timeline(), Optimizer(), Optimizer()
    tl.moved_on(1.0)
    optimizer_step(tl, generator, 2.0, 2.5)
    optimizer_step(tl, discriminator, 3.0, 3.5)  # another optimizer: the same step
    assert tl.ring.count == 0
    optimizer_step(tl, generator, 4.0, 4.5)  # the first one again: a new iteration
    assert tl.ring.count == 1
    columns = tl.ring.columns(1, 1)
    assert columns["step_seconds"] == [3.0]  # 1.0 to 4.0
    assert columns["optimizer_steps"] == [2]
    assert columns["optimizer_seconds"] == [1.0]
    # Step 2 holds the generator's 4.0 step; the discriminator then joins it, and the
    # discriminator stepping again closes it.
    optimizer_step(tl, discriminator, 5.0, 5.5)
    assert tl.ring.count == 1
    optimizer_step(tl, discriminator, 6.0, 6.5)
    assert tl.ring.count == 2
    assert tl.ring.columns(2, 2)["step_seconds"] == [2.0]  # 4.0 to 6.0


def test_moved_on_the_same_optimizer_stepping_again_closes_the_step():
    tl, optimizer = timeline(), Optimizer()
    optimizer_step(tl, optimizer, 1.0, 1.5)  # opens step 1 at 1.0 (no fetch: an iterator-less loop)
    optimizer_step(tl, optimizer, 2.0, 2.5)
    optimizer_step(tl, optimizer, 3.0, 3.5)
    assert tl.ring.count == 2
    assert tl.ring.columns(1, 2)["step_seconds"] == [1.0, 1.0]


def test_timeline_skips_recorded_and_late():
    tl, optimizer = timeline(), Optimizer()
    for t in (1.0, 2.0, 3.0):
        fetch(tl, t, t)
        optimizer_step(tl, optimizer, t + 0.5, t + 0.75)
    # Steps 1 and 2 closed, step 3 open.
    tl.record_skip(3)  # the open step: into its record
    tl.record_skip(2)  # already closed: a late skip
    tl.in_tuneup = True
    tl.record_skip(3)  # from inside tuneup's own bookkeeping: late, even for the open step
    tl.in_tuneup = False
    tl.optimizer_skipped(optimizer, 3.9)  # GradScaler skipped step 4's update: closes step 3
    tl.moved_on(4.5)  # closes step 4
    assert tl.ring.count == 4
    columns = tl.ring.columns(1, 4)
    assert columns["skipped_steps"] == [0, 1, 2, 1]
    assert columns["optimizer_steps"] == [1, 1, 1, 0]


def test_a_close_writes_every_total_where_the_columns_read_it_by_name():
    """The close writes the record by hand (hotpath.py: six fields on a plain step, the detail
    totals in `_close_due`), in steps.record's order: each of the twelve running totals, moved
    by its own amount, comes back under its own name, on a detail step and on a plain one."""
    attributes = {"data_wait_seconds": "data_wait", "samples": "samples", "fetches": "fetches",
                  "optimizer_steps": "optimizer_steps", "forward_seconds": "forward",
                  "backward_seconds": "backward", "optimizer_seconds": "optimizer", "input_seconds": "input",
                  "backward_passes": "backward_passes", "skipped_steps": "skipped",
                  "evaluation_seconds": "evaluation", "evaluations": "evaluations"}
    assert set(attributes) == set(CUMULATIVE)
    tl = StepTimeline(64, lambda name, exc: None, detail_every=1000)
    tl.attached_at, tl.wake_at = 0.0, 10**6  # (no listener asks for a close)
    moved = {name: 2 ** index for index, name in enumerate(CUMULATIVE)}
    every_step = {name: moved[name] for name in step_records.EVERY_STEP}

    def move(amounts):
        for name, amount in amounts.items():
            setattr(tl, attributes[name], getattr(tl, attributes[name]) + amount)

    for step in range(1, 8):  # 1-5 detail steps (step 1: every total moves), 6 and 7 plain ones
        move(moved if step == 1 else every_step if step > 5 else {})
        tl.manual_step(now=10.0 * step)
    columns = tl.ring.columns(1, 7)
    for name, amount in moved.items():
        assert columns[name][0] == amount, name
        assert columns[name][5] == columns[name][6] == every_step.get(name, 0), name
    assert columns["detailed"] == [True] * 5 + [False] * 2


def test_plain_steps_share_one_record_of_the_detail_totals_and_events_write_it_anew():
    """steps.record: past the first five, plain steps' records share one tuple of the totals
    that move on detail steps; an evaluation phase ending or a GradScaler skip on a plain step
    makes its close write them anew, so each lands in its own step, and the columns read every
    total under its own name (the close writes them in ON_DETAIL's order)."""
    tl, optimizer = StepTimeline(64, lambda name, exc: None, detail_every=1000), Optimizer()
    tl.attached_at, tl.wake_at = 0.0, 10**6  # (no listener asks for a close)
    t = 0.0
    for step in range(1, 13):
        t += 1.0
        fetch(tl, t, t + 0.125)
        if step == 4:  # the open step 4 is a detail step: every total of its split moves
            assert tl.detail
            tl.forward += 0.25
            tl.backward += 0.5
            tl.input += 0.0625
            tl.backward_passes += 1
        if step == 8:  # a plain step: an evaluation phase inside it, from 8.25 to 8.5
            assert not tl.detail
            tl.evaluation_forward(t + 0.25)
            tl.evaluation_forward_ended(t + 0.5)
            tl.evaluation_ends(t + 0.5)
        if step == 10:  # a plain step whose update GradScaler skips
            tl.optimizer_skipped(optimizer, t + 0.75)
            continue
        optimizer_step(tl, optimizer, t + 0.5, t + 0.75)
    tl.flush()
    rest = {step: tl.ring.records[step - 1][-1] for step in range(6, 13)}
    assert rest[7] is rest[6] and rest[9] is rest[8] and rest[12] is rest[11]  # one tuple, until an event
    assert rest[8] is not rest[7] and rest[10] is not rest[9]
    columns = tl.ring.columns(1, 12)
    assert columns["detailed"] == [True] * 5 + [False] * 7
    assert columns["forward_seconds"][3] == 0.25 and columns["backward_seconds"][3] == 0.5
    assert columns["input_seconds"][3] == 0.0625 and columns["backward_passes"][3] == 1
    assert columns["evaluations"] == [0] * 7 + [1] + [0] * 4
    assert columns["evaluation_seconds"] == [0.0] * 7 + [0.25] + [0.0] * 4
    assert columns["step_seconds"][7] == 0.75  # 1 s from close to close, less the phase
    assert columns["skipped_steps"] == [0] * 9 + [1] + [0] * 2
    assert all(name in columns for name in CUMULATIVE)
    assert sum(columns["forward_seconds"]) == 0.25 and sum(columns["evaluation_seconds"]) == 0.25


def test_timeline_skip_reported_while_a_step_closes_goes_to_that_step():
    # A close listener runs before the ring publishes the new count: a skip it reports for
    # the step being closed must not land in the next step's record.
    tl, optimizer = timeline(), Optimizer()
    tl.add_listener("scaler", lambda step: tl.record_skip(step) if step == 2 else None)
    for t in (1.0, 2.0, 3.0, 4.0):
        fetch(tl, t, t)
        optimizer_step(tl, optimizer, t + 0.5, t + 0.75)
    tl.flush()
    assert tl.ring.count == 4
    assert tl.ring.columns(1, 4)["skipped_steps"] == [0, 1, 0, 0]


def test_the_compile_check_is_one_call_that_dynamo_folds():
    """_patching.COMPILING: False in eager code at one Python call; True while dynamo traces,
    with no graph break and no guard on the flag (fullgraph, the same answer on each call)."""
    import torch

    from tuneup._patching import compile_check

    dynamo, flags = compile_check()
    assert dynamo is torch.compiler.is_dynamo_compiling and flags is torch.compiler
    assert not (dynamo() or flags._is_compiling_flag)

    def step(x):
        return x + 1 if (dynamo() or flags._is_compiling_flag) else x - 1

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert compiled(torch.zeros(1)).item() == 1.0 and compiled(torch.zeros(1)).item() == 1.0
    assert step(torch.zeros(1)).item() == -1.0


def test_change_rows_say_kept_not_kept_or_undone_once():
    from tuneup.report.summary import change_rows

    def record(decision, reason, undone=None, **flags):
        return {"id": 1, "action": "amp", "title": "AMP", "change": "autocast", "decision": decision,
                "reason": reason, "speedup": 1.0, "undone": undone, "applied_step": 57, **flags}

    rows = change_rows([
        record("kept", "1.22x faster", undone={"reason": "detach"}),
        record("reverted", "1.12x faster but not certain (a longer run would tell)", slower=False),
        record("reverted", "0.91x (slower)", slower=True),
        record("reverted", "0.91x: slower (p=0.004)"),  # a run log from before the judge's flag
        record("kept", "1.30x faster", undone={"reason": "revert_all"}),
        record("rolled back", "a non-finite loss"),
    ])
    assert [row[2] for row in rows] == ["kept from step 58", "not kept", "undone", "undone",
                                        "kept from step 58 (undone by revert_all)", "rolled back"]


def test_another_trial_stops_where_its_expected_cost_outweighs_what_it_may_save():
    """The experimenter's stop rule on hand-made records: two undone DataLoader trials that cost
    0.5 s each (100 steps 5 ms slower) against a finding that may save 30% of a 10 ms step."""
    from types import SimpleNamespace

    from tuneup.act.experimenter import Experimenter

    def trial(decision, slower=0.005, steps=100):
        return {"action": "dataloader", "decision": decision, "baseline": {"mean_step_seconds": 0.010},
                "trial": {"mean_step_seconds": 0.010 + slower, "steps": steps}}

    def why(records, steps, gain=0.3):
        me = SimpleNamespace(job=SimpleNamespace(finding=lambda *rules: {"gain": gain}), records=records)
        action = SimpleNamespace(id="dataloader", fixes=("data-stall",))
        return Experimenter._not_worth_a_trial(me, action, {"step_seconds": {"mean": 0.010}}, steps)

    undone = [trial("reverted"), trial("reverted")]
    # Expected cost (1 - 1/4) x 0.5 s = 0.375 s; may save 0.3 x 10 ms x steps x 1/4.
    assert why(undone, 400) is not None and "cost the job 1.00 s" in why(undone, 400)  # 0.30 s to save
    assert "against 0.30 s it may save" in why(undone, 400)
    assert why(undone, 600) is None  # 0.45 s to save: worth another
    assert why(undone[:1], 100) is None  # one undone trial is not yet a pattern
    assert why([trial("reverted", slower=-0.001), trial("reverted", slower=0.0)], 10) is None  # they cost nothing
    # A keep raises the chance: (1 + 1) / (3 + 2) = 40%; expected cost 0.6 x 0.5 s = 0.3 s, to save 0.3 x 10 ms x 400 x 0.4.
    assert why(undone + [trial("kept", slower=-0.004)], 400) is None
    assert why(undone, 400, gain=None) is None  # no stated gain: nothing to weigh
    # Settle steps count too: 10 steps of worker start-up taking 0.25 s where the baseline's took 0.1 s.
    settled = [dict(trial("reverted"), settle={"steps": 10, "seconds": 0.25}) for _ in range(2)]
    assert "cost the job 1.30 s" in why(settled, 400)
    # So do those after the undo (the old workers starting again), and both add up.
    undone_settled = [dict(trial("reverted"), undo_settle={"steps": 10, "seconds": 0.25}) for _ in range(2)]
    assert "cost the job 1.30 s" in why(undone_settled, 400)
    both = [dict(record, settle={"steps": 10, "seconds": 0.2}) for record in undone_settled]
    assert "cost the job 1.50 s" in why(both, 400)


def test_the_steps_after_an_undo_are_costed_once_they_closed():
    """Experimenter._undo_settled on a real step ring: an undo at the close of step 30 with 5
    settle steps; steps 31-35 took 30 ms each (the old workers starting), the rest 10 ms."""
    from types import SimpleNamespace

    from tuneup.act.experimenter import Experimenter
    from tuneup.measure.hotpath import StepTimeline

    timeline = StepTimeline(64, fail=lambda name, exc: None)
    now = 0.0
    for step in range(1, 41):
        now += 0.030 if 31 <= step <= 35 else 0.010
        timeline.close(now)
    record = {"decision": "reverted"}
    me = SimpleNamespace(job=SimpleNamespace(timeline=timeline), _undo_settling=[(record, 31, 35)])
    Experimenter._undo_settled(me, 34)  # step 35 not closed yet: nothing
    assert "undo_settle" not in record and me._undo_settling
    Experimenter._undo_settled(me, 40)
    assert record["undo_settle"]["steps"] == 5 and record["undo_settle"]["seconds"] == pytest.approx(0.150)
    assert me._undo_settling == []


def test_the_loader_configuration_marks_apply_mode_s_settings_with_the_job_s_own():
    """config.loader_config with the job's own settings beside a loader apply mode set others on:
    the knobs that differ, each with the job's value; prefetch_factor left unset by the job is
    the workers' default 2, not a setting of tuneup's; format.set_by_apply_mode says it."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tuneup.format import set_by_apply_mode
    from tuneup.measure.config import loader_config

    loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)
    own = {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None}
    assert "set_by_tuneup" not in loader_config(loader, own) and "set_by_tuneup" not in loader_config(loader)
    vars(loader).update(num_workers=2, prefetch_factor=2)  # as the DataLoader action sets them
    config = loader_config(loader, own)
    assert (config["num_workers"], config["set_by_tuneup"]) == (2, {"num_workers": 0})
    vars(loader).update(prefetch_factor=4)
    assert loader_config(loader, own)["set_by_tuneup"] == {"num_workers": 0, "prefetch_factor": None}
    assert set_by_apply_mode(config) == "set by apply mode: num_workers (the job's own: 0)"
    assert set_by_apply_mode({}) == "" and set_by_apply_mode({"set_by_tuneup": ["damaged"]}) == ""


def test_per_step_wait_spans_the_window_of_steps():
    from tuneup.measure.host import MIN_STEPS, PerStep

    marks = PerStep(steps=100)
    assert marks.add(0, 0.0) is None and marks.add(MIN_STEPS - 1, 0.5) is None  # under MIN_STEPS steps
    assert marks.add(50, 1.0) == pytest.approx(1.0 / 50)
    assert marks.add(50, 1.5) == pytest.approx(1.5 / 50)  # no step since: the newer total stands
    # At step 150 the marks reach back to step 50 (the one at or before 150 - 100): 2.0 s more over 100 steps.
    assert marks.add(150, 3.5) == pytest.approx(2.0 / 100)
    # At 300: the mark at 150 is dropped only once a later one is at or before 200; none is: 150 stays.
    assert marks.add(300, 5.0) == pytest.approx(1.5 / 150)
    assert marks.add(420, 5.0) == pytest.approx(0.0)  # from the mark at 300: no wait since
    short = PerStep(steps=10)  # a window under MIN_STEPS steps still gives its figure
    assert short.add(0, 0.0) is None and short.add(10, 0.5) == pytest.approx(0.05)
