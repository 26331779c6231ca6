"""Stated gains against measured ones: for each finding with a gain, the share of the step
tuneup says its fix saves, beside the share that applying the fix saves in the same job on
this machine, in one run.

    python benchmarks/bench_gain_calibration.py [--repeats 7]

Each case is a scenario job of advice_scenarios.py run once under tuneup (the finding and its
stated gain), then the job as it is and the job with the finding's fix, without tuneup,
in `--repeats` interleaved pairs (A B, B A, ...): the loop's own mean step time past its
warm-up (Truth.step_seconds). Measured gain: the median pair's 1 - fixed / as-is, with the
lowest and highest pair's beside it (this machine's noise). A stated gain is calibrated when
within 30% of the measured one (relative, or 2 points of the step where both are small); one
that rests on no measurement says so in its gain text ("an estimate"); a finding with no
figure ("not through workers") is checked by the sign of the fix it advises against; a
silent rule missed a gain if every pair gained 5% or more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.advice_scenarios import CLEAN, SCENARIOS, Job, Scenario, run_job, run_scenario  # noqa: E402
from tuneup.measure.config import cpu_bf16_detected  # noqa: E402

TOLERANCE = 0.30
SMALL = 0.02  # both under this share of the step: agreement within it counts
MISSED = 0.05  # a silent rule missed a gain if every pair's gain was at least this


@dataclass(frozen=True)
class Case:
    name: str
    scenario: Scenario
    rule: str
    fix: Callable[[Job, dict[str, Any]], Job]  # the job with the finding's fix applied


def scenario(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)


def with_workers(job: Job, evidence: dict[str, Any]) -> Job:
    return replace(job, workers=int(evidence.get("suggested_workers") or 2))


CASES = [
    Case("io-bound loader: more workers", scenario("io-bound loader"), "data-stall", with_workers),
    # Batches made in a fraction of a millisecond (no latency, 16 rows) on a small step:
    # the wait is real, and workers would cost more to ship each batch than making it does.
    Case("cheap batches: workers advised against",
         Scenario("cheap batches", replace(CLEAN, batch_size=16, hidden=32), frozenset({"data-stall"})),
         "data-stall", lambda job, evidence: replace(job, workers=2)),
    # The case: the same cheap batches from 5 workers on this 2-core machine.
    Case("cheap batches, 5 workers: fewer",
         Scenario("cheap batches, 5 workers", replace(CLEAN, batch_size=16, hidden=32, workers=5),
                  frozenset({"data-stall"})),
         "data-stall", lambda job, evidence: replace(job, workers=int(evidence.get("suggested_workers", 0)))),
    Case("host reads: removed", scenario("host reads"), "host-syncs", lambda job, _: replace(job, host_reads=0)),
    Case("numpy copies: as_tensor", scenario("numpy copies"), "numpy-copies",
         lambda job, _: replace(job, numpy_shared=True)),
    # The scenarios' own MLP is near break-even under bf16 here (amp-off stays silent on it);
    # 1,024 wide at 256 rows a batch, autocast saves ~45% of its forward + backward on this CPU.
    Case("wide fp32 model: bf16 autocast",
         Scenario("wide fp32 model", replace(CLEAN, hidden=1024, batch_size=256, steps=160), frozenset({"amp-off"})),
         "amp-off", lambda job, _: replace(job, autocast=torch.bfloat16)),
    Case("small fp32 model: bf16 autocast", scenario("clean"), "amp-off",
         lambda job, _: replace(job, autocast=torch.bfloat16)),
]


def measured_gain(case: Case, fixed: Job, repeats: int) -> tuple[float, float, float, float, float]:
    """(as-is median step, fixed median step, the median pair's gain, the lowest and the
    highest pair's): `repeats` pairs, interleaved A B, B A, ..., each pair's gain 1 - B / A."""
    restore = case.scenario.setup() if case.scenario.setup else None
    try:
        times: dict[str, list[float]] = {"as is": [], "fixed": []}
        for rep in range(repeats):
            for variant in (("as is", "fixed") if rep % 2 == 0 else ("fixed", "as is")):
                times[variant].append(run_job(case.scenario.job if variant == "as is" else fixed).step_seconds)
    finally:
        if restore is not None:
            restore()
    gains = sorted(1.0 - after / base for base, after in zip(times["as is"], times["fixed"]))
    return (statistics.median(times["as is"]), statistics.median(times["fixed"]), statistics.median(gains),
            gains[0], gains[-1])


def verdict(finding: dict[str, Any] | None, measured: float, low: float, high: float) -> str:
    if finding is None:
        return "MISSED" if low >= MISSED else "right to be silent"
    stated, text = finding.get("gain"), finding.get("gain_text") or ""
    if stated is None:
        return "advised against: fix measured slower" if high <= 0 else "no figure stated"
    if "estimate" in text:
        return "labelled an estimate"
    close = abs(stated - measured) <= TOLERANCE * abs(measured) or max(abs(stated), abs(measured)) < SMALL
    return "within 30%" if close else ("OFF, within the pairs' spread" if low <= stated <= high else "OFF")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"CPU bf16 units: {'yes' if cpu_bf16_detected() else 'no'}; jobs on {CLEAN.threads} intra-op thread(s) "
          f"(of {torch.get_num_threads()}) unless a case sets more; "
          f"{args.repeats} interleaved runs per variant")
    print(f"{'case':<40} {'rule':<14} {'stated':>7} {'as is':>9} {'fixed':>9} {'measured':>8} {'pairs: low, high':>16} "
          f"{'ratio':>6}  verdict")
    with tempfile.TemporaryDirectory() as folder:
        for index, case in enumerate(CASES):
            began = time.perf_counter()
            document = run_scenario(case.scenario, Path(folder) / f"run{index}", cpu_bf16=None)
            finding = next((f for f in document["findings"] if f["rule"] == case.rule), None)
            fixed = case.fix(case.scenario.job, (finding or {}).get("evidence") or {})
            base, after, measured, low, high = measured_gain(case, fixed, args.repeats)
            stated = finding.get("gain") if finding else None
            ratio = f"{stated / measured:6.2f}" if stated is not None and measured > 0 else f"{'-':>6}"
            shown = "silent" if finding is None else ("none" if stated is None else f"{stated:.1%}")
            print(f"{case.name:<40} {case.rule:<14} {shown:>7} {base * 1e3:7.2f}ms {after * 1e3:7.2f}ms "
                  f"{measured:8.1%} [{low:6.1%},{high:6.1%}] {ratio}  {verdict(finding, measured, low, high)}  "
                  f"({time.perf_counter() - began:.0f} s)")
            truth = document["truth"]
            print(f"{'':<40} the loop's own measure under tuneup: stall {truth.stall:.1%}, copies {truth.copy_share:.1%}"
                  + (f"; gain text: {finding['gain_text'][:90]}" if finding else ""))


if __name__ == "__main__":
    main()
