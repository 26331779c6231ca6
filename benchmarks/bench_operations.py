"""tuneup's per-step work in Python operations, by function: which of its hooks cost what.

    python benchmarks/bench_operations.py [--steps 2000] [--workload "~0.4 ms step"] [--lines 0]

On the ~0.4 ms CPU step of bench_overhead.py (its workload and loop), tuneup attached in advise
mode (no endpoint, no run log) trains until its detail steps are paced (bench_overhead's
SETTLE seconds and at least 1,100 steps), its background sampler is stopped (its cost is per
second, not per step), and then a tracer counts every bytecode instruction the interpreter
runs in tuneup's own code (sys.settrace with opcode events, on the training thread) over
--steps steps: its modules' functions and the wrappers it builds to pose as torch's (their
code has `_tuneup_` names: _patching.posing_as; they show under the name of the function
they stand in for). Prints operations and calls per step, by function, most first; with
--lines N, the N busiest lines too.

Exact and repeatable (seconds, against minutes for callgrind's instruction count in
bench_instructions.py), but only a count: on that step an operation of the hot path costs
some 60 ns in place (tuneup's added time per step over its operations per step, by
bench_overhead.py), several times its warm cost, as torch's own work evicts it between hooks.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import tuneup  # noqa: E402
from benchmarks.bench_overhead import SETTLE, WARMUP_STEPS, WORKLOADS, loop, make  # noqa: E402

PACED_AFTER = 1100  # steps before the count: past hotpath.PACED_FROM_STEP, the detail steps are paced


def ours(code: CodeType) -> bool:
    """tuneup's code: its files, or a wrapper posing as torch's (its names are `_tuneup_*`)."""
    return "/tuneup/" in code.co_filename or any(name.startswith("_tuneup_") for name in code.co_freevars)


def count(steps: int, workload: str) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """(operations by function, calls by function, operations by line) over `steps` steps."""
    features, hidden, depth, batch, optimizer_class, pre_batched, _ = WORKLOADS[workload]
    job = make(features, hidden, depth, batch, optimizer_class, pre_batched)
    by_function: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    by_line: collections.Counter = collections.Counter()

    def opcodes(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            name = frame.f_code.co_qualname
            by_function[name] += 1
            by_line[f"{name}:{frame.f_lineno}"] += 1
        return opcodes

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and ours(frame.f_code):
            calls[frame.f_code.co_qualname] += 1
            frame.f_trace_opcodes = True
            return opcodes
        return None

    with tuneup.attach(log=False, serve=False, gpu=False) as agent:
        began = time.perf_counter()
        loop(*job, max(PACED_AFTER, WARMUP_STEPS + 1), settle=SETTLE)
        agent.ticker.stop()
        agent.recorder.drain()  # the pace of the detail steps, from the steps so far
        print(f"{workload}: {time.perf_counter() - began:.1f} s of training before the count, "
              f"one detail step in {agent.recorder.timeline.detail_every}")
        sys.settrace(tracer)
        try:
            loop(*job, WARMUP_STEPS + steps)  # (its first WARMUP_STEPS are counted too: all steps alike)
        finally:
            sys.settrace(None)
    return by_function, calls, by_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workload", default="~0.4 ms step", help="a workload of bench_overhead.py, by name")
    parser.add_argument("--lines", type=int, default=0, help="also the N busiest lines")
    args = parser.parse_args()
    if args.workload not in WORKLOADS:
        parser.error(f"no workload {args.workload!r}: choose one of {', '.join(map(repr, WORKLOADS))}")
    torch.set_num_threads(1)
    by_function, calls, by_line = count(args.steps, args.workload)
    counted = args.steps + WARMUP_STEPS
    print(f"\ntuneup's Python operations per step: {sum(by_function.values()) / counted:.0f} "
          f"(over {counted} steps, the detail steps' share included)")
    print(f"  {'operations':>10}  {'calls':>6}  function")
    for name, operations in by_function.most_common():
        if operations / counted < 0.5:
            break
        print(f"  {operations / counted:>10.1f}  {calls[name] / counted:>6.2f}  {name}")
    if args.lines:
        print(f"\n  {'operations':>10}  line")
        for line, operations in by_line.most_common(args.lines):
            print(f"  {operations / counted:>10.1f}  {line}")


if __name__ == "__main__":
    main()
