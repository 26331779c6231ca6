"""Detection accuracy over the injected-bottleneck scenarios: truth vs tuneup, side by side.

    python benchmarks/bench_accuracy.py

The truth comes from the training loop itself (benchmarks/scenarios.py times its own next()
calls and counts its own host reads and injected overflows). Targets: stall ratio within
±2 points; syncs per step and skipped steps exact.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402
from benchmarks.scenarios import SlowDataset, SlowStream, loader_for, mlp, spin, train  # noqa: E402


def job(dataset, **loader_kwargs):
    torch.manual_seed(0)
    model = mlp(hidden=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return loader_for(dataset, **loader_kwargs), model, optimizer


def measure(run_dir: Path, build, **train_kwargs):
    loader, model, optimizer = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tuneup.attach(run_dir=run_dir, sync_sample_every=5) as agent:
            truth = train(loader, model, optimizer, **train_kwargs)
    return truth, agent.snapshot()


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        def run_dir():
            run_dir.count += 1
            return Path(tmp) / f"run{run_dir.count}"
        run_dir.count = 0

        stall_cases = [
            ("no loader latency", lambda: job(SlowDataset(), batch_size=16), 0.004),
            ("0.25 ms/sample, 0 workers", lambda: job(SlowDataset(latency=0.00025), batch_size=16), 0.004),
            ("0.5 ms/sample, 0 workers", lambda: job(SlowDataset(latency=0.0005), batch_size=16), 0.004),
            ("1 ms/sample, 0 workers", lambda: job(SlowDataset(latency=0.001), batch_size=16), 0.004),
            ("2 ms/sample, 2 workers (fork)", lambda: job(SlowDataset(latency=0.002), batch_size=8, num_workers=2), 0.004),
            ("2 ms/sample, 2 workers (spawn)", lambda: job(SlowDataset(latency=0.002), batch_size=8, num_workers=2,
                                                           multiprocessing_context="spawn"), 0.004),
            ("iterable, 1 ms/sample, 2 workers", lambda: job(SlowStream(size=100_000, latency=0.001), batch_size=8,
                                                             num_workers=2), 0.004),
        ]
        for name, build, compute in stall_cases:
            truth, snapshot = measure(run_dir(), build, steps=60, compute=spin(compute))
            measured = snapshot["totals"]["stall_ratio"]
            error = abs(measured - truth.stall_ratio) * 100
            rows.append(("stall ratio", name, f"{truth.stall_ratio:.3f}", f"{measured:.3f}",
                         f"{error:.2f} pts", error <= 2.0))

        for reads in (0, 1, 2, 5):
            truth, snapshot = measure(run_dir(), lambda: job(SlowDataset(), batch_size=8), steps=60, host_reads=reads)
            measured = snapshot["syncs"]["per_step"]
            rows.append(("syncs/step", f"{reads} .item() per step", str(reads), f"{measured:g}",
                         f"{abs(measured - reads):g}", measured == reads))
        scaler_truth, snapshot = measure(
            run_dir(), lambda: job(SlowDataset(), batch_size=8), steps=60, host_reads=1,
            scaler=torch.amp.GradScaler("cpu"),
        )
        rows.append(("syncs/step", "1 .item() + GradScaler", "2", f"{snapshot['syncs']['per_step']:g}",
                     f"{abs(snapshot['syncs']['per_step'] - 2):g}", snapshot["syncs"]["per_step"] == 2))

        for pattern in (frozenset(), frozenset({7}), frozenset({5, 6, 7, 40}), frozenset(range(10, 60, 3))):
            scaler = torch.amp.GradScaler("cpu", growth_interval=8)
            truth, snapshot = measure(run_dir(), lambda: job(SlowDataset(), batch_size=8), steps=80,
                                      scaler=scaler, overflow_at=pattern)
            summary = snapshot["scaler"]
            exact = (summary["skipped_steps"], summary["backoff_events"], summary["growth_events"]) == (
                truth.skipped_steps, truth.backoff_events, truth.growth_events)
            rows.append(("skipped steps", f"{len(pattern)} injected overflows",
                         f"{truth.skipped_steps} skip/{truth.backoff_events} back-off/{truth.growth_events} grow",
                         f"{summary['skipped_steps']}/{summary['backoff_events']}/{summary['growth_events']}",
                         "0" if exact else "differs", exact))

        for accumulate in (1, 4):
            truth, snapshot = measure(run_dir(), lambda: job(SlowDataset(), batch_size=8), steps=30,
                                      accumulate=accumulate)
            steps = snapshot["totals"]["steps"]
            rows.append(("step boundary", f"accumulate {accumulate} batches", str(truth.steps), str(steps),
                         str(abs(steps - truth.steps)), steps == truth.steps))

    width = [max(len(str(row[i])) for row in rows) for i in range(5)]
    header = ("measure", "scenario", "truth (loop)", "tuneup", "error")
    width = [max(w, len(h)) for w, h in zip(width, header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, width)) + "  within target")
    for row in rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row[:5], width)) + ("  yes" if row[5] else "  NO"))
    hits = sum(row[5] for row in rows)
    print(f"\n{hits}/{len(rows)} scenarios within target")


if __name__ == "__main__":
    main()
