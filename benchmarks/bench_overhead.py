"""Overhead of tuneup in advise mode, against the bare loop and against torch.profiler.

    python benchmarks/bench_overhead.py [--rounds 15] [--startup-rounds 5] [--device cuda] [--breakdown]
                                        [--workload "~0.4 ms step"] [--no-profiler]

Two CPU training loops (DataLoader, MLP, a loss.item() every 10 steps): one with a step of
about 5 ms (AdamW), one of about 0.4 ms (SGD on pre-batched data: close to the smallest full
training step this kind of 2-core host runs). Each round runs every configuration once, in a
shuffled order, so slow drifts of the machine hit all of them alike. A run's figure is its
mean step time (wall time / steps, so the occasional sampled step is paid for); the table
prints the median over rounds, the ratio to the bare loop and the added time per step, and
the median (and IQR) of the difference to the bare run of the same round; then the same for
CPU time per step (time.process_time(): it counts tuneup's own threads). Every run trains
SETTLE seconds before its timed steps begin (the same for every configuration): the figures
are the steady state's, attach's one-time work left to bench_startup.py.

With --device cuda the same loops train on the GPU (data made on the device, a synchronize
before each run's end time): the overhead on a real CUDA loop, where tuneup's hooks are all
host work and the GPU timing and sync counting run for real.

After each table, where tuneup's own background thread spent its CPU (the snapshot's
agent_cost: share of a core, and ms a second by part). --breakdown adds tuneup with one part
of its work off at a time (sync sampling; detail steps; NVML) to tell where the rest goes.

torch.profiler runs continuously with schedule(wait=5, warmup=1, active=3, repeat=0) and a
trace handler that discards the trace: the cheapest way to keep it on for a whole run.

Then the start-up figure: plain `python` against `tuneup run` on a short script, and attach()
and detach() themselves (benchmarks/bench_startup.py, whose table this prints; 0 rounds skip it).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402

class BodyAndHead:
    """Two optimizers stepped every step, one for the body and one for the last layer, as a
    fine-tune with its own head optimizer writes it (a GAN's loop has two as well). A second
    optimizer starts model discovery again (a new model, often); it once found no new root and
    kept its nn.Module.__call__ wrapper on every module call for the rest of the run."""

    def __init__(self, model: nn.Sequential, lr: float) -> None:
        body = [p for layer in list(model)[:-1] for p in layer.parameters()]
        self.optimizers = [torch.optim.SGD(body, lr=lr), torch.optim.SGD(model[-1].parameters(), lr=lr)]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


# name: (features, hidden, hidden layers, batch, optimizer, pre-batched dataset, timed steps per run)
WORKLOADS = {
    "~5 ms step": (128, 512, 2, 128, torch.optim.AdamW, False, 200),
    "~0.4 ms step": (16, 32, 1, 8, torch.optim.SGD, True, 2500),  # about the smallest full step here
    "one optimizer, 8 layers": (16, 32, 8, 8, torch.optim.SGD, True, 2000),
    "two optimizers, 8 layers": (16, 32, 8, 8, BodyAndHead, True, 2000),
}
WARMUP_STEPS = 30
# Seconds every run trains before its timed steps: the per-step cost is the steady state's.
# What attach() does once is over by then (the first steps' model discovery and detail steps,
# the sampler's first ticks, which read the configuration and pace the detail steps); attach
# and detach themselves are timed by bench_startup.py. Without it, the 0.4 ms workload's
# 0.6 s of timed steps held those one-time costs too.
SETTLE = 1.5
PACED_STEPS = 1100  # past hotpath.PACED_FROM_STEP: the detail steps are paced by the next drain ...
PACE_WAIT = 1.1  # ... a tick later (the default interval: 1 s)


class Batches(Dataset):
    """Pre-batched tensors (batch_size=None): the loader adds no collate work."""

    def __init__(self, batches: int, batch: int, features: int) -> None:
        self.x = torch.randn(batches, batch, features)
        self.y = torch.randn(batches, batch, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def make(features, hidden, depth, batch, optimizer_class, pre_batched, device="cpu"):
    torch.manual_seed(0)
    layers = [nn.Linear(features, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(hidden, 1)).to(device)
    optimizer = optimizer_class(model if optimizer_class is BodyAndHead else model.parameters(), lr=1e-4)
    if pre_batched:
        batches = Batches(64, batch, features)
        batches.x, batches.y = batches.x.to(device), batches.y.to(device)
        loader = DataLoader(batches, batch_size=None, shuffle=True)
    else:
        data = TensorDataset(torch.randn(batch * 64, features, device=device), torch.randn(batch * 64, 1, device=device))
        loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    return loader, model, optimizer


def loop(loader, model, optimizer, steps: int, on_step=None, settle: float = 0.0,
         train_step=None) -> tuple[float, float]:
    """Run WARMUP_STEPS steps, and more until `settle` seconds have passed, then `steps -
    WARMUP_STEPS` timed steps; returns their wall and CPU time (CPU time of the whole process:
    the agent's own thread included). With a `settle`, also until PACED_STEPS steps ran and a
    tick's interval after them: tuneup paces its detail steps from PACED_FROM_STEP on, at its
    next drain (the ~5 ms workload reaches that 3.6 s in, past SETTLE: its figures were those of
    a run's first thousand steps, a detail step in four). `train_step(x, y)`: the step's body
    (zero_grad, forward, backward, update) in one function that returns the loss, a compiled
    one say (bench_compile.py)."""
    step = 0
    started = None
    end = -1
    began = time.perf_counter()
    paced_at = None if settle else began - PACE_WAIT  # no settling asked: none waited for
    while True:
        for x, y in loader:
            if paced_at is None and step >= PACED_STEPS:
                paced_at = time.perf_counter()
            if started is None and step >= WARMUP_STEPS and time.perf_counter() - began >= settle \
                    and paced_at is not None and time.perf_counter() - paced_at >= PACE_WAIT:
                started = time.perf_counter(), time.process_time()
                end = step + steps - WARMUP_STEPS
            if train_step is not None:
                loss = train_step(x, y)
            else:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
            if step % 10 == 0:
                loss.item()
            if on_step is not None:
                on_step()
            step += 1
            if step == end:
                if loss.is_cuda:
                    torch.cuda.synchronize()  # the GPU's queued work belongs to the run
                return time.perf_counter() - started[0], time.process_time() - started[1]


def bare(job, steps, _tmp):
    return loop(*job, steps, settle=SETTLE)


AGENT_COSTS: list[dict] = []  # each tuneup run's agent_cost (measure/own_cost.py)


def with_tuneup(job, steps, tmp, **options):
    with tuneup.attach(run_dir=Path(tmp) / f"run-{time.monotonic_ns()}", **options) as agent:
        timed = loop(*job, steps, settle=SETTLE)
    if not options:
        AGENT_COSTS.append(agent.snapshot()["agent_cost"])
    return timed


# --breakdown: tuneup with one part of its work off at a time, to tell where its cost goes
# (on an H100 it added 306 µs to a 4.4 ms step, where CPU runs had 1.025x: not yet located).
BREAKDOWN = {
    "tuneup, no sync sampling": dict(sync_sample_every=0),
    "tuneup, few detail steps": dict(sync_sample_every=0, detail_every=1000),
    "tuneup, no NVML": dict(gpu=False),
}


def print_agent_cost(costs: list[dict]) -> None:
    """Where tuneup's own thread spent its CPU in these runs: the median share of a core, and
    each part's CPU per second of the run (the CPU column above counts this thread too)."""
    if not costs:
        return
    share = statistics.median(cost["cpu_share"] for cost in costs)
    parts = {name for cost in costs for name in cost["parts"]}
    per_second = {name: statistics.median((cost["parts"].get(name) or {}).get("cpu_seconds", 0.0) / cost["seconds"]
                                          for cost in costs) for name in parts}
    ranked = ", ".join(f"{name} {value * 1e3:.2f}" for name, value in sorted(per_second.items(), key=lambda i: -i[1]))
    print(f"  tuneup's own thread: {share:.1%} of a core; ms of CPU a second by part: {ranked}")


def with_profiler(job, steps, _tmp):
    schedule = torch.profiler.schedule(wait=5, warmup=1, active=3, repeat=0)
    saved = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # kineto logs every cycle to stderr
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                    on_trace_ready=lambda prof: None) as profiler:
            return loop(*job, steps, on_step=profiler.step, settle=SETTLE)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


CONFIGS = {"bare loop": bare, "tuneup (advise)": with_tuneup, "torch.profiler": with_profiler}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--startup-rounds", type=int, default=5, help="rounds of bench_startup.py after (0: none)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--workload", choices=tuple(WORKLOADS), action="append",
                        help="only this workload (repeatable; default: all)")
    parser.add_argument("--no-profiler", action="store_true", help="leave torch.profiler out (faster)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also tuneup with sync sampling off, with few detail steps, and without NVML")
    args = parser.parse_args()
    configs = dict(CONFIGS)
    if args.no_profiler:
        configs.pop("torch.profiler")
    if args.breakdown:
        configs.update({name: functools.partial(with_tuneup, **options) for name, options in BREAKDOWN.items()})
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here")
    torch.set_num_threads(1)  # one core each for loop and agent thread: less noise on 2-core hosts
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {where}, {args.rounds} interleaved rounds, mean step time per run, "
          f"median over rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for workload, (features, hidden, depth, batch, optimizer_class, pre_batched, timed) in WORKLOADS.items():
            if args.workload and workload not in args.workload:
                continue
            job = make(features, hidden, depth, batch, optimizer_class, pre_batched, args.device)
            steps = WARMUP_STEPS + timed
            per_step: dict[str, list[float]] = {name: [] for name in configs}
            cpu_per_step: dict[str, list[float]] = {name: [] for name in configs}
            AGENT_COSTS.clear()
            for _ in range(args.rounds):
                order = list(configs.items())
                random.shuffle(order)
                for name, run in order:
                    wall, cpu = run(job, steps, tmp)
                    per_step[name].append(wall / timed)
                    cpu_per_step[name].append(cpu / timed)
            print(f"\n{workload} (batch {batch}, {timed} timed steps per run{', on the GPU' if args.device == 'cuda' else ''})")
            for title, figures in (("wall time", per_step), ("CPU time", cpu_per_step)):
                base = statistics.median(figures["bare loop"])
                print(f"  {title:<26}{'median step':>14}{'ratio':>9}{'added/step':>13}"
                      f"{'paired added/step (IQR)':>30}")
                for name, values in figures.items():
                    median = statistics.median(values)
                    # Paired with the bare run of the same round: drifts of the machine cancel out.
                    added = [(v - b) * 1e6 for v, b in zip(values, figures["bare loop"])]
                    q1, _, q3 = statistics.quantiles(added, n=4)
                    print(f"  {name:<26}{median * 1e3:>11.3f} ms{median / base:>9.3f}"
                          f"{(median - base) * 1e6:>10.1f} µs{statistics.median(added):>12.1f} µs"
                          f" ({q1:.1f} to {q3:.1f})")
            print_agent_cost(AGENT_COSTS)
    if args.startup_rounds > 0:
        from benchmarks.bench_startup import report

        print("\nstart-up: python S against tuneup run S (S: a short training script)")
        report(args.startup_rounds)


if __name__ == "__main__":
    main()
