"""What counting a step's FLOPs costs (measure/flops.py), against the step it counts, and what
the per-step figure costs the steps that are not counted (nothing).

    python benchmarks/bench_flops.py [--rounds 7] [--per-step-rounds 9] [--trace-steps 3000]

The count runs once per input shape, at a step close on the training thread: one forward and
backward of the model on meta tensors under torch's FlopCounterMode (no data, no arithmetic:
Python dispatch only). For three models (an MLP, a conv net, a 6-block transformer) this
prints, over interleaved rounds, the median of the plain training step (SGD, one intra-op
thread) and the median of one count, their ratio, and the count's FLOPs.

Then the per-step figure, on bench_overhead.py's ~0.4 ms CPU step (its workload, loop and
settling: the count itself is past, at step 65, before the timed steps). Achieved FLOP/s and
MFU are computed where a snapshot or /metrics is read, on tuneup's thread; on the training
thread the FLOP work after the count is a look after each lifecycle check (64 steps apart: the
input's signature and the step's precision before the next detail step's forward, and that
step's close; paced detail steps are rarer, so looks are too). Two figures:
  - operations: a tracer counts every bytecode instruction of the FLOP count's code
    (flops.py, offstep.py, the model probe's give_input) over --trace-steps steps, and on how
    many steps any ran: the looks' steps, none of the others;
  - time: tuneup attached with the FLOP count on and with it off (recorder.flops.on = False
    before the first step), interleaved in shuffled rounds, each run's mean wall and CPU time
    (time.process_time: tuneup's thread included) per step; medians over rounds, the ratio,
    and the difference paired within a round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402
from benchmarks.bench_overhead import SETTLE, WARMUP_STEPS, WORKLOADS, loop, make  # noqa: E402
from tuneup.measure.flops import FlopCount  # noqa: E402

PER_STEP_WORKLOAD = "~0.4 ms step"
PACED_AFTER = 1100  # steps before the trace (bench_operations.py): the detail steps are paced


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(mixed.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, blocks: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def workloads() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "MLP 1024-wide, batch 256": (nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                                   nn.Linear(1024, 10)),
                                     torch.randn(256, 256), torch.randint(0, 10, (256,))),
        "conv net, batch 32 of 3x32x32": (nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                                                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)),
                                          torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))),
        "transformer 6x128, 8 x 128 tokens": (Transformer(), torch.randint(0, 512, (8, 128)),
                                              torch.randint(0, 512, (8 * 128,))),
    }


class Probe:
    on = True  # the model probe the count turns off while it runs


def step_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    began = time.perf_counter()
    optimizer.zero_grad()
    out = model(x)
    nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y).backward()
    optimizer.step()
    return time.perf_counter() - began


def count_seconds(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    counter = FlopCount(Probe())
    meta = torch.empty_like(x, device="meta")
    began = time.perf_counter()
    found = counter._count(model, (meta,), {})
    return time.perf_counter() - began, found["flops"]


def flop_code(code) -> bool:
    """The FLOP count's code on the training thread: flops.py, offstep.py (the capture it shares
    with the precision trial) and the model probe's hand-over of a forward's input."""
    name = code.co_filename.replace("\\", "/")
    return name.endswith(("/tuneup/measure/flops.py", "/tuneup/measure/offstep.py")) or (
        name.endswith("/tuneup/measure/model.py") and code.co_name == "give_input")


def trace_steps(steps: int) -> tuple[int, int, int, int]:
    """(steps traced, steps on which FLOP code ran, its operations in all, looks finished)."""
    features, hidden, depth, batch, optimizer_class, pre_batched, _ = WORKLOADS[PER_STEP_WORKLOAD]
    job = make(features, hidden, depth, batch, optimizer_class, pre_batched)
    operations = [0]
    per_step: list[int] = []

    def opcodes(frame, event, arg):
        if event == "opcode":
            operations[0] += 1
        return opcodes

    def tracer(frame, event, arg):
        if event == "call" and flop_code(frame.f_code):
            frame.f_trace_opcodes = True
            return opcodes
        return None

    def on_step():
        per_step.append(operations[0])
        operations[0] = 0

    with tuneup.attach(log=False, serve=False, gpu=False) as agent:
        loop(*job, max(PACED_AFTER, WARMUP_STEPS + 1), settle=SETTLE)
        agent.ticker.stop()
        agent.recorder.drain()
        flops = agent.recorder.flops
        assert flops.last is not None, "the count did not run before the trace"
        finished = [0]
        original = flops.finish

        def counted_finish(*args, **kwargs):
            finished[0] += 1
            return original(*args, **kwargs)

        flops.finish = counted_finish
        sys.settrace(tracer)
        try:
            loop(*job, WARMUP_STEPS + steps, on_step=on_step)
        finally:
            sys.settrace(None)
            del flops.finish
    busy = [count for count in per_step if count]
    return len(per_step), len(busy), sum(busy), finished[0]


def timed_run(job, steps: int, tmp: str, flops_on: bool) -> tuple[float, float]:
    with tuneup.attach(run_dir=Path(tmp) / f"run-{time.monotonic_ns()}") as agent:
        agent.recorder.flops.on = flops_on
        return loop(*job, steps, settle=SETTLE)


def per_step_figures(rounds: int, trace: int) -> None:
    import tempfile

    steps, busy, operations, looks = trace_steps(trace)
    print(f"\nper-step figure, {PER_STEP_WORKLOAD} workload (bench_overhead.py), after the count")
    print(f"  operations: FLOP-count code ran on {busy} of {steps} steps ({looks} looks finished: each "
          f"at the first detail step after a lifecycle check), {operations / max(looks, 1):.0f} operations a look, "
          f"{operations / steps:.2f} a step on average, 0 on the other {steps - busy} steps")
    features, hidden, depth, batch, optimizer_class, pre_batched, timed = WORKLOADS[PER_STEP_WORKLOAD]
    job = make(features, hidden, depth, batch, optimizer_class, pre_batched)
    configs = {"FLOP count on": True, "FLOP count off": False}
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            order = list(configs.items())
            random.shuffle(order)
            for name, on in order:
                seconds, processor = timed_run(job, WARMUP_STEPS + timed, tmp, on)
                wall[name].append(seconds / timed)
                cpu[name].append(processor / timed)
    print(f"  time: {rounds} interleaved rounds of {timed} timed steps a run, mean per step, median over rounds")
    for title, figures in (("wall time", wall), ("CPU time", cpu)):
        on, off = (statistics.median(figures[name]) for name in configs)
        paired = [(a - b) * 1e6 for a, b in zip(figures["FLOP count on"], figures["FLOP count off"])]
        q1, _, q3 = statistics.quantiles(paired, n=4)
        print(f"  {title:<10} on {on * 1e3:.4f} ms, off {off * 1e3:.4f} ms, on/off {on / off:.4f}; "
              f"paired on - off {statistics.median(paired):+.2f} µs a step (IQR {q1:+.2f} to {q3:+.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-step-rounds", type=int, default=9, help="rounds of the per-step timing (0: none)")
    parser.add_argument("--trace-steps", type=int, default=3000, help="steps the operation count traces")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 intra-op thread, {args.rounds} interleaved rounds (medians)")
    print(f"{'model':<36} {'step':>9} {'count':>9} {'count/step':>10} {'FLOPs counted':>14}")
    for name, (model, x, y) in workloads().items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):  # warm-up: first calls, allocator, dispatch caches
            step_seconds(model, x, y, optimizer)
            count_seconds(model, x)
        steps, counts, flops = [], [], 0.0
        for _ in range(args.rounds):
            steps.append(statistics.median(step_seconds(model, x, y, optimizer) for _ in range(5)))
            seconds, flops = count_seconds(model, x)
            counts.append(seconds)
        step, count = statistics.median(steps), statistics.median(counts)
        print(f"{name:<36} {step * 1e3:>7.2f}ms {count * 1e3:>7.2f}ms {count / step:>9.2f}x {flops:>14,.0f}")
    if args.per_step_rounds > 0:
        per_step_figures(args.per_step_rounds, args.trace_steps)


if __name__ == "__main__":
    main()
