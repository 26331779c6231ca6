"""tuneup's per-step cost in instructions, counted by valgrind's callgrind: exact and repeatable
whatever else the machine is doing, where timings on a shared 2-core host swing by more than
the cost being measured.

    python benchmarks/bench_instructions.py [--against DIR] [--apply] [--floor] [--steps 1000] [--jobs 3]
                                            [--workload "~5 ms step"]

The ~0.4 ms CPU step of bench_overhead.py (its workload and loop: an MLP on pre-batched data,
SGD, a loss.item() every 10 steps; or another of its WORKLOADS, by name) runs bare and with
tuneup attached (advise mode, no endpoint, no run log):
1,100 warm-up steps (--warmup), then the counted ones, between two calls of getpgrp() (nothing else calls
it), at which callgrind dumps its counters (--dump-before=getpgrp): start-up and exit are not
counted. The agent's background sampler is stopped: its cost is per second, not per step,
and under valgrind's fifty-fold slowdown it would be counted fifty times over. So the counts
are the training thread's hot path: hooks, sampled and detail steps, the call watch. With
--against DIR, the tuneup checkout in DIR (e.g. a `git worktree` of an earlier commit) is
counted in the same run, side by side. The detail steps are paced (hotpath.py StepTimeline.pace)
as the sampler's first drain paces them, by the bare step's time measured outside valgrind first
(under valgrind every step looks fifty times longer). With --apply, apply mode is counted too, with
nothing to act on (no findings reach it while the sampler is stopped): it should cost what
advise mode costs. Repeated runs agree to about 3,000 instructions per step (the garbage
collector, the loader's shuffle thread; one checkout gave 43.3k, 46.0k, 43.8k and 43.5k added
in four runs, before a full garbage collection was kept out of the count; now gc.freeze() after the
warm-up): differences below that are noise, so compare within one run. With --floor, the loop with
pass-through wrappers and no-op hooks in tuneup's places: what intercepting those calls costs
before any work is done (about 8,000 of tuneup's 30,000 on the plain steps of the ~0.4 ms step). Needs valgrind
(Debian: apt-get install valgrind); a run takes minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = '''
import os
import sys

mode, steps, checkout, root, workload, warmup = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
native_step = float(sys.argv[7])  # the bare step's time outside valgrind (mode "time" measures it)
sys.path.insert(0, checkout)
import torch
import tuneup  # the checkout's, before bench_overhead puts this repository first on the path

sys.path.append(root)
from benchmarks.bench_overhead import WARMUP_STEPS, WORKLOADS, loop, make

torch.set_num_threads(1)
features, hidden, depth, batch, optimizer_class, pre_batched, _ = WORKLOADS[workload]
job = make(features, hidden, depth, batch, optimizer_class, pre_batched)
if mode == "time":
    wall, _ = loop(*job, steps)
    print(wall / (steps - WARMUP_STEPS))
    sys.exit()
if mode == "floor":  # interception alone: what any agent hooking these calls pays before doing anything
    import importlib
    from torch import nn
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    steps_module = importlib.import_module("torch.optim.optimizer")
    steps_module.register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: None)
    steps_module.register_optimizer_step_post_hook(lambda optimizer, args, kwargs: None)
    for owner, name in ((_BaseDataLoaderIter, "__next__"), (nn.Sequential, "forward"), (torch.Tensor, "backward"),
                        (torch.optim.Optimizer, "zero_grad")):
        def passing(*args, _original=owner.__dict__[name], **kwargs):
            return _original(*args, **kwargs)
        setattr(owner, name, passing)
if mode in ("tuneup", "apply"):
    agent = tuneup.attach(log=False, serve=False, gpu=False, mode="advise" if mode == "tuneup" else "apply")
    if hasattr(agent, "ticker"):  # the background sampler: see the module docstring
        agent.ticker.stop()
    else:  # a checkout from before ticker.py (--against)
        agent._stop.set()
        agent._thread.join()
loop(*job, warmup)
import gc
gc.collect()
gc.freeze()  # no full collection of torch's objects inside the count (it swung runs by 30,000 a step)
# (a checkout from before the recorder held the timeline: none to pace; --against)
timeline = getattr(getattr(agent, "recorder", None), "timeline", None) if mode in ("tuneup", "apply") else None
if hasattr(timeline, "pace"):  # the detail rate the sampler's first drain sets, from the step's native time
    timeline.pace(native_step)  # (under valgrind's fifty-fold slowdown every step looks long)
os.getpgrp()  # callgrind dumps what came before: start-up, warm-up
loop(*job, steps)
os.getpgrp()  # ... and here the counted steps
'''


def instructions(job: Path, mode: str, steps: int, warmup: int, workload: str, checkout: Path, folder: Path,
                 name: str, native_step: float) -> int:
    """Instructions of the counted steps: the dump callgrind wrote at the last getpgrp()."""
    out = folder / name
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--dump-before=getpgrp", f"--callgrind-out-file={out}", sys.executable,
         str(job), mode, str(steps), str(checkout), str(ROOT), workload, str(warmup), repr(native_step)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    # One part per dump (out.1, out.2, ...; the part after the last dump is `out` itself).
    parts = sorted(folder.glob(f"{name}.*"), key=lambda path: int(path.suffix[1:]))
    match = re.search(r"^summary: (\d+)", parts[-1].read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"callgrind wrote no summary in {parts[-1]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another tuneup checkout to count beside this one")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=1100,
                        help="steps run before counting begins (over 30; past 1000 closed, the detail steps are paced)")
    parser.add_argument("--workload", default="~0.4 ms step", help="a workload of bench_overhead.py, by name")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--floor", action="store_true",
                        help="also the loop with pass-through wrappers of the calls tuneup wraps (DataLoader "
                             "__next__, the model's forward, backward, zero_grad) and no-op optimizer step hooks: "
                             "the cost of intercepting them at all")
    parser.add_argument("--apply", action="store_true",
                        help="also apply mode with nothing to act on (no findings reach it: the sampler is stopped)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_overhead import WORKLOADS

    if args.workload not in WORKLOADS:
        parser.error(f"no workload {args.workload!r}: choose one of {', '.join(map(repr, WORKLOADS))}")
    checkouts = {"this checkout": ROOT}
    if args.against is not None:
        checkouts[str(args.against)] = args.against.resolve()
    configs = {"bare loop": ("bare", ROOT)}
    if args.floor:
        configs["pass-through wrappers and hooks"] = ("floor", ROOT)
    for label, checkout in checkouts.items():
        configs[f"tuneup ({label})"] = ("tuneup", checkout)
        if args.apply:
            configs[f"tuneup apply, idle ({label})"] = ("apply", checkout)
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / "job.py"
        job.write_text(JOB)
        native = subprocess.run([sys.executable, str(job), "time", "2000", str(ROOT), str(ROOT), args.workload, "0", "0"],
                                capture_output=True, text=True, check=True)
        native_step = float(native.stdout.split()[-1])
        with ThreadPoolExecutor(args.jobs) as pool:
            counts = dict(zip(configs, pool.map(
                lambda item: instructions(job, item[1][0], args.steps, args.warmup, args.workload, item[1][1], Path(folder),
                                          f"run{item[0]}", native_step),
                enumerate(configs.values()))))
    per_step = {name: count / args.steps for name, count in counts.items()}
    bare = per_step["bare loop"]
    print(f"instructions per training step (callgrind), over {args.steps} steps of the {args.workload} (CPU) workload"
          f" (bare step outside valgrind: {native_step * 1e3:.3f} ms, which paces the detail steps)")
    print(f"  {'configuration':<48}{'per step':>14}{'ratio':>9}{'added/step':>14}")
    for name, value in per_step.items():
        print(f"  {name:<48}{value:>14,.0f}{value / bare:>9.4f}{value - bare:>14,.0f}")


if __name__ == "__main__":
    main()
