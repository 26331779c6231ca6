"""Apply mode against an exhaustive grid, and against no tuneup.

    python benchmarks/bench_apply.py [--rounds 5] [--steps 1500] [--tail 500]

1. An I/O-bound job: a map-style dataset that waits 0.5 ms per sample (a read from slow
   storage), batches of 16, num_workers=0, and 4 ms of GIL-holding compute per step. Every
   DataLoader configuration apply mode may choose from (num_workers 0..usable cores,
   prefetch_factor 2/4/8, persistent_workers off/on; pin_memory needs CUDA) runs the same
   steps; the best is the grid's. Apply mode starts from num_workers=0 and tunes while it
   trains. Printed: each configuration's throughput, the best, apply mode's throughput
   over its last steps, the steps of its last kept change and last decision, and the ratios
   to the best and to no tuneup.
2. A job that is not input-bound (batches in memory, 4 ms compute): no tuneup, advise mode
   and apply mode, for the ratio "never slower than no tuneup".

Throughput is steps per second over the measured steps (wall time, so epoch starts and
worker start-up are paid for). Each round runs every configuration once in a shuffled
order, so slow drifts of the machine hit all alike; the table prints medians over rounds.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402
from benchmarks.scenarios import sample, spin  # noqa: E402
from tuneup.measure.host import usable_cores  # noqa: E402

LATENCY = 0.0005
BATCH = 16
COMPUTE = 0.004
EPOCH_STEPS = 100
GRID_STEPS = 600
WARMUP = 40


class SlowStorage(Dataset):
    def __init__(self, latency: float) -> None:
        self.latency = latency

    def __len__(self) -> int:
        return EPOCH_STEPS * BATCH

    def __getitem__(self, index: int):
        if self.latency:
            time.sleep(self.latency)
        return sample(index, 32)


def in_memory() -> TensorDataset:
    samples = [sample(index, 32) for index in range(EPOCH_STEPS * BATCH)]
    return TensorDataset(torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples]))


def run(steps: int, dataset: Dataset, settings: dict | None = None, mode: str | None = None,
        run_dir: Path | None = None) -> tuple[list[float], list[dict]]:
    """Train for `steps` steps; returns each step's end time and apply mode's records."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, **(settings or {}))
    agent = tuneup.attach(mode=mode, run_dir=run_dir, serve=False) if mode else None
    busy = spin(COMPUTE)
    ends: list[float] = []
    try:
        while len(ends) < steps:
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y[:, :1]).backward()
                busy()
                optimizer.step()
                ends.append(time.perf_counter())
                if len(ends) >= steps:
                    break
    finally:
        if agent is not None:
            agent.detach()
    return ends, agent.actions() if agent is not None else []


def throughput(ends: list[float], first: int) -> float:
    """Steps per second from step `first` (1-based) to the last."""
    first = max(first, 2)
    return (len(ends) - first + 1) / (ends[-1] - ends[first - 2])


def grid(cores: int) -> list[dict]:
    configs = [{"num_workers": 0}]
    for workers, prefetch, persistent in itertools.product(range(1, cores + 1), (2, 4, 8), (False, True)):
        configs.append({"num_workers": workers, "prefetch_factor": prefetch, "persistent_workers": persistent})
    return configs


def label(settings: dict) -> str:
    if not settings["num_workers"]:
        return "num_workers=0"
    return (f"num_workers={settings['num_workers']}, prefetch={settings['prefetch_factor']}, "
            f"persistent={settings['persistent_workers']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500, help="steps of each apply-mode run")
    parser.add_argument("--tail", type=int, default=500, help="apply mode's throughput: over its last TAIL steps")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    cores = int(usable_cores())
    configs = grid(cores)
    rates: dict[str, list[float]] = {label(c): [] for c in configs}
    applied: list[tuple[float, int, str]] = []
    plain_rates: dict[str, list[float]] = {"no tuneup": [], "advise": [], "apply": []}
    slow, memory = SlowStorage(LATENCY), in_memory()
    with tempfile.TemporaryDirectory() as scratch:
        for round_number in range(args.rounds):
            jobs = [("grid", c) for c in configs] + [("apply", None)] + [("plain", m) for m in plain_rates]
            random.Random(round_number).shuffle(jobs)
            for kind, what in jobs:
                if kind == "grid":
                    ends, _ = run(GRID_STEPS, slow, what)
                    rates[label(what)].append(throughput(ends, WARMUP))
                elif kind == "apply":
                    ends, records = run(args.steps, slow, mode="apply",
                                        run_dir=Path(scratch) / f"apply-{round_number}")
                    decided = [r["decided_step"] for r in records if r.get("decided_step")]
                    last = max(decided) if decided else 1
                    kept = [r for r in records if r["decision"] == "kept"]
                    settled = max((r["decided_step"] for r in kept), default=1)
                    applied.append((throughput(ends, len(ends) - args.tail + 1), last, settled,
                                    "; ".join(r["change"] for r in kept)))
                else:
                    mode = {"no tuneup": None, "advise": "advise", "apply": "apply"}[what]
                    ends, _ = run(GRID_STEPS, memory, {"num_workers": 0}, mode=mode,
                                  run_dir=Path(scratch) / f"plain-{what}-{round_number}" if mode else None)
                    plain_rates[what].append(throughput(ends, WARMUP))
            print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)

    medians = {name: statistics.median(values) for name, values in rates.items()}
    best_name = max(medians, key=medians.get)
    best = medians[best_name]
    none = medians["num_workers=0"]
    print(f"\nI/O-bound loader ({LATENCY * 1e3:.1f} ms per sample, batch {BATCH}, {COMPUTE * 1e3:.0f} ms compute, "
          f"{cores} usable cores), steps/s, median of {args.rounds} rounds:")
    print(f"{'configuration':<52}{'steps/s':>9}{'x best':>8}")
    for name, rate in sorted(medians.items(), key=lambda item: -item[1]):
        print(f"{name:<52}{rate:>9.1f}{rate / best:>8.2f}")
    apply_rate = statistics.median(rate for rate, _, _, _ in applied)
    last = statistics.median(step for _, step, _, _ in applied)
    settled = statistics.median(step for _, _, step, _ in applied)
    print(f"\n{f'apply mode, its last {args.tail} of {args.steps} steps':<52}{apply_rate:>9.1f}{apply_rate / best:>8.2f}")
    print(f"best of the grid: {best_name} ({best:.1f} steps/s); no tuneup (num_workers=0): {none:.1f} steps/s")
    print(f"apply mode: {apply_rate / best:.2f}x the grid's best, {apply_rate / none:.2f}x no tuneup; "
          f"its last kept change at step {settled:.0f}, its last decision at step {last:.0f} (medians)")
    for rate, step, kept_at, kept in applied:
        print(f"    run: {rate:.1f} steps/s; last decision at step {step}; kept (last at step {kept_at}): "
              f"{kept or 'nothing'}")
    plain = {name: statistics.median(values) for name, values in plain_rates.items()}
    print(f"\nNot input-bound (batches in memory, {COMPUTE * 1e3:.0f} ms compute), steps/s, median of "
          f"{args.rounds} rounds:")
    for name, rate in plain.items():
        print(f"{name:<52}{rate:>9.1f}{rate / plain['no tuneup']:>8.3f}")


if __name__ == "__main__":
    main()
