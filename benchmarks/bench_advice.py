"""Advice precision and recall over the injected-bottleneck scenarios, in one run.

    python benchmarks/bench_advice.py

Each scenario is a real CPU training job with one injected bottleneck (see
advice_scenarios.py); the table shows what was expected, what fired and the top finding's
measured evidence, then precision and recall over the set. The jobs run on this CPU as it
is: amp-off is expected on fp32 jobs where it has bf16 units (AVX512-BF16/AMX); set
TUNEUP_CPU_BF16=0 or 1 to run them as on a CPU without or with them.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.advice_scenarios import SCENARIOS, expected_findings, fired, norms_read, precision_recall, run_scenario  # noqa: E402
from tuneup.measure.config import cpu_bf16_detected  # noqa: E402
from tuneup.options import resolve  # noqa: E402


def main() -> None:
    warnings.simplefilter("ignore")
    results = []
    forced = resolve({}).cpu_bf16
    cpu_bf16 = cpu_bf16_detected() if forced is None else forced
    print(f"CPU bf16 units: {'yes' if cpu_bf16 else 'no'} ({'detected' if forced is None else 'TUNEUP_CPU_BF16'})")
    print(f"{'scenario':<24} {'expected':<40} {'fired':<40} {'ok':<3} {'s':>5}  top finding")
    with tempfile.TemporaryDirectory() as folder:
        for index, scenario in enumerate(SCENARIOS):
            began = time.perf_counter()
            document = run_scenario(scenario, Path(folder) / f"run{index}", cpu_bf16=cpu_bf16)
            expected, either = expected_findings(scenario, cpu_bf16, document["truth"], norms_read(document))
            got = fired(document) - either
            results.append((expected, got))
            top = document["findings"][0]["observed"][:70] if document["findings"] else "-"
            ok = "yes" if got == set(expected) else "NO"
            print(f"{scenario.name:<24} {','.join(sorted(expected)) or '-':<40} "
                  f"{','.join(sorted(got)) or '-':<40} {ok:<3} {time.perf_counter() - began:5.1f}  {top}", flush=True)
    precision, recall = precision_recall(results)
    print(f"\nprecision {precision:.3f}   recall {recall:.3f}   over {len(results)} scenarios")


if __name__ == "__main__":
    main()
