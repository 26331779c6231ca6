"""torch's intra-op threads beside busy processes: the step time of a small CNN's training loop
with one intra-op thread against torch's default, on a quiet machine and beside N CPU-bound
processes (what cpu-oversubscribed's advice for a shared machine must rest on).

    python benchmarks/bench_threads_busy.py [--rounds 5] [--steps 60] [--busy 0,2]

Each run is a fresh process (`torch.set_num_threads(T)` before anything runs; the default is
torch's own count), training the same model on the same in-memory batch, 5 steps of warm-up,
then `--steps` timed. Every round runs every (busy, threads) pair once in a shuffled order; the
burners of a `busy` level run only while that level's runs do. Printed: median wall and CPU
(process time) ms a step over rounds, the ratio of the default to one thread, and the spread
(min-max) of the runs, which beside busy processes is most of the story.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import busy_processes  # noqa: E402

LOOP = r"""
import json, sys, time, torch
import torch.nn.functional as F
from torch import nn
threads, steps = int(sys.argv[1]), int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                      nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2048, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
def step():
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
for _ in range(5):
    step()
began, cpu = time.perf_counter(), time.process_time()
for _ in range(steps):
    step()
print(json.dumps({"wall_ms": 1000 * (time.perf_counter() - began) / steps,
                  "cpu_ms": 1000 * (time.process_time() - cpu) / steps, "threads": torch.get_num_threads()}))
"""


def run(threads: int, steps: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", LOOP, str(threads), str(steps)], capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--busy", default="0,2", help="busy-process counts, comma-separated")
    args = parser.parse_args()
    levels = [int(level) for level in args.busy.split(",")]
    results: dict[tuple[int, int], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for busy in random.sample(levels, len(levels)):
            with busy_processes(busy):
                for threads in random.sample([1, 0], 2):  # 0: torch's default
                    results.setdefault((busy, threads), []).append(run(threads, args.steps))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    default = torch.get_num_threads()
    print(f"{args.rounds} rounds, {args.steps} timed steps a run; torch's default: {default} intra-op threads")
    print(f"  {'busy':>4} {'threads':>8} {'wall ms':>9} {'CPU ms':>8} {'wall min-max':>16}  ratio to 1 thread")
    for busy in levels:
        one = statistics.median(r["wall_ms"] for r in results[(busy, 1)])
        for threads in (1, 0):
            runs = results[(busy, threads)]
            wall = statistics.median(r["wall_ms"] for r in runs)
            cpu = statistics.median(r["cpu_ms"] for r in runs)
            spread = f"{min(r['wall_ms'] for r in runs):.1f}-{max(r['wall_ms'] for r in runs):.1f}"
            print(f"  {busy:>4} {runs[0]['threads']:>8} {wall:>9.1f} {cpu:>8.1f} {spread:>16}  {wall / one:.2f}")


if __name__ == "__main__":
    main()
