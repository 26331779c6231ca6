"""Apply mode's compile action on a model whose eager steps are many small elementwise kernels,
next to the same loop eager and compiled by hand, in one run.

    python benchmarks/bench_compile_action.py [--rounds 3] [--steps 600]

Each round runs the three configurations in a shuffled order, each from a fresh model (the
same seed): eager; `model.compile()` by hand before the loop; eager under
`tuneup.attach(mode="apply", actions=["compile"])`. A run's figure is the median wall and CPU
time (time.process_time(): tuneup's thread counted) of its last quarter of steps, when apply
mode has long decided; printed: medians over rounds, the ratio to eager, and what apply mode
decided each round. Compile time is in none of these figures (it is in the first steps).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402


class Pointwise(nn.Module):
    """A block of many elementwise ops on mid-sized activations (GELU, scale, residual, norm by
    hand): eager runs one kernel per op, inductor fuses them into a few."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            h = h * torch.sigmoid(1.702 * h)  # GELU, written out
            h = (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-5)
            x = x + 0.5 * torch.tanh(h) * torch.exp(-h.abs())
        return self.head(x)


def run(config: str, steps: int, tmp: str) -> tuple[float, float, str]:
    torch.manual_seed(0)
    model = Pointwise()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(64, 256), torch.randn(64, 1)) for _ in range(8)]
    if config == "compiled by hand":
        model.compile()
    agent = None
    if config == "apply mode (compile)":
        agent = tuneup.attach(mode="apply", actions=["compile"], run_dir=Path(tmp) / f"run-{time.monotonic_ns()}")
    wall, cpu = [], []
    try:
        for step in range(steps):
            x, y = data[step % len(data)]
            began, began_cpu = time.perf_counter(), time.process_time()
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if step % 50 == 0:
                loss.item()
            wall.append(time.perf_counter() - began)
            cpu.append(time.process_time() - began_cpu)
    finally:
        decided = ""
        if agent is not None:
            records = [r for r in agent.actions() if r["action"] == "compile"]
            decided = ", ".join(f"{r['decision']} ({r.get('reason')})" for r in records) or "nothing tried"
            agent.detach()
    tail = steps * 3 // 4
    return statistics.median(wall[tail:]), statistics.median(cpu[tail:]), decided


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    configs = ["eager", "compiled by hand", "apply mode (compile)"]
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    decisions = []
    print(f"torch {torch.__version__} on CPU, {args.rounds} interleaved rounds of {args.steps} steps, "
          "median step of each run's last quarter, median over rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            order = configs[:]
            random.shuffle(order)
            for name in order:
                w, c, decided = run(name, args.steps, tmp)
                wall[name].append(w)
                cpu[name].append(c)
                if decided:
                    decisions.append(decided)
    for title, figures in (("wall time", wall), ("CPU time", cpu)):
        base = statistics.median(figures["eager"])
        print(f"  {title:<24}{'median step':>14}{'ratio':>9}")
        for name, values in figures.items():
            median = statistics.median(values)
            print(f"  {name:<24}{median * 1e3:>11.3f} ms{median / base:>9.3f}")
    print("apply mode decided:")
    for decided in decisions:
        print("  " + decided)


if __name__ == "__main__":
    main()
