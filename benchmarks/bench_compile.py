"""tuneup's added cost per step on a compiled loop, next to the same loop eager, in one run.

    python benchmarks/bench_compile.py [--rounds 11] [--backend inductor]

bench_overhead.py's two CPU loops (~5 ms AdamW step, ~0.4 ms SGD step), each eager, with
`torch.compile(model)`, and with the whole training step compiled (`@torch.compile` on a
function that zeroes the gradients, runs forward and backward and steps the optimizer: no
optimizer hook runs eagerly there, and tuneup watches every step as a loop without an
optimizer: hotpath.py StepTimeline.by_hand), each compiled once before the rounds (the
compile is not what is timed here; tuneup keeps it out of its step times too). Each round
runs the six configurations (each with and without tuneup) in a shuffled order; a run's figure is its
mean wall and CPU time per step (time.process_time(): tuneup's own thread counted); printed:
medians over rounds, the ratio to the loop without tuneup, and the added time per step paired
with the same round's run without tuneup. Every run trains bench_overhead.py's SETTLE seconds
(and until tuneup paces its detail steps) before its timed steps: the steady state's figures.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402
from benchmarks.bench_overhead import SETTLE, WARMUP_STEPS, WORKLOADS, loop, make  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (inductor, aot_eager, eager)")
    parser.add_argument("--workload", choices=list(WORKLOADS), help="only this one")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__} on CPU, backend {args.backend}, {args.rounds} interleaved rounds, "
          "mean time per step per run, median over rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for workload, (features, hidden, depth, batch, optimizer_class, pre_batched, timed) in WORKLOADS.items():
            if args.workload not in (None, workload):
                continue
            loader, model, optimizer = make(features, hidden, depth, batch, optimizer_class, pre_batched)
            compiled = torch.compile(model, backend=args.backend)

            @torch.compile(backend=args.backend)
            def train_step(x, y, model=model, optimizer=optimizer):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                return loss

            began = time.perf_counter()
            loop(loader, compiled, optimizer, WARMUP_STEPS + 10)  # compiles forward and backward
            loop(loader, model, optimizer, WARMUP_STEPS + 10, train_step=train_step)  # ... and the whole step
            compile_seconds = time.perf_counter() - began
            steps = WARMUP_STEPS + timed

            def run(trained, step_function, attached):
                if not attached:
                    return loop(loader, trained, optimizer, steps, settle=SETTLE, train_step=step_function)
                with tuneup.attach(run_dir=Path(tmp) / f"run-{time.monotonic_ns()}"):
                    return loop(loader, trained, optimizer, steps, settle=SETTLE, train_step=step_function)

            configs = {"eager": (model, None, False), "eager + tuneup": (model, None, True),
                       "compiled": (compiled, None, False), "compiled + tuneup": (compiled, None, True),
                       "step compiled": (model, train_step, False), "step compiled + tuneup": (model, train_step, True)}
            wall: dict[str, list[float]] = {name: [] for name in configs}
            cpu: dict[str, list[float]] = {name: [] for name in configs}
            for _ in range(args.rounds):
                order = list(configs.items())
                random.shuffle(order)
                for name, (trained, step_function, attached) in order:
                    seconds, cpu_seconds = run(trained, step_function, attached)
                    wall[name].append(seconds / timed)
                    cpu[name].append(cpu_seconds / timed)
            print(f"\n{workload} (batch {batch}, {timed} timed steps per run; compiling took {compile_seconds:.1f} s)")
            for title, figures in (("wall time", wall), ("CPU time", cpu)):
                print(f"  {title:<24}{'median step':>14}{'ratio':>9}{'added/step':>13}{'paired added/step (IQR)':>30}")
                for name in configs:
                    base_name = name.replace(" + tuneup", "")
                    base = statistics.median(figures[base_name])
                    median = statistics.median(figures[name])
                    added = [(value - plain) * 1e6 for value, plain in zip(figures[name], figures[base_name])]
                    q1, _, q3 = statistics.quantiles(added, n=4)
                    print(f"  {name:<24}{median * 1e3:>11.3f} ms{median / base:>9.3f}{(median - base) * 1e6:>10.1f} µs"
                          f"{statistics.median(added):>12.1f} µs ({q1:.1f} to {q3:.1f})")


if __name__ == "__main__":
    main()
