"""tuneup's per-step cost in instructions, counted by valgrind's callgrind: exact and repeatable
whatever else the machine is doing, where timings on a shared 2-core host swing by more than
the cost being measured.

    python benchmarks/bench_instructions.py [--against DIR] [--steps 1000] [--jobs 3]

The ~0.4 ms CPU step of bench_overhead.py (an MLP on pre-batched data, SGD, a loss.item()
every 10 steps) runs bare and with tuneup attached (advise mode, no endpoint, no run log):
200 warm-up steps, then the counted ones, between two calls of getpgrp() (nothing else calls
it), at which callgrind dumps its counters (--dump-before=getpgrp): start-up and exit are not
counted. The agent's background sampler is stopped: its cost is per second, not per step,
and under valgrind's fifty-fold slowdown it would be counted fifty times over. So the counts
are the training thread's hot path: hooks, sampled and detail steps, the call watch. With
--against DIR, the tuneup checkout in DIR (e.g. a `git worktree` of an earlier commit) is
counted in the same run, side by side. Needs valgrind (Debian: apt-get install valgrind); a run takes minutes.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, sys.argv[3])
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)
mode, steps = sys.argv[1], int(sys.argv[2])


class Batches(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, 16, generator=generator)
        self.y = torch.randn(64, 8, 1, generator=generator)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return self.x[index], self.y[index]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
loader = DataLoader(Batches(), batch_size=None, shuffle=True)
agent = None
if mode == "tuneup":
    import tuneup
    agent = tuneup.attach(log=False, serve=False, gpu=False)
    agent._stop.set()  # the background sampler: see the module docstring
    agent._thread.join()


def train(steps):
    step = 0
    while step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if step % 10 == 0:
                loss.item()
            step += 1
            if step == steps:
                return


train(200)
os.getpgrp()  # callgrind dumps what came before: start-up, warm-up
train(steps)
os.getpgrp()  # ... and here the counted steps
'''


def instructions(job: Path, mode: str, steps: int, checkout: Path, folder: Path, name: str) -> int:
    """Instructions of the counted steps: the dump callgrind wrote at the last getpgrp()."""
    out = folder / name
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--dump-before=getpgrp", f"--callgrind-out-file={out}", sys.executable,
         str(job), mode, str(steps), str(checkout)],
        capture_output=True, text=True, check=True)
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
    parser.add_argument("--jobs", type=int, default=3)
    args = parser.parse_args()
    configs = {"bare loop": ("bare", ROOT), "tuneup (this checkout)": ("tuneup", ROOT)}
    if args.against is not None:
        configs[f"tuneup ({args.against})"] = ("tuneup", args.against.resolve())
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / "job.py"
        job.write_text(JOB)
        with ThreadPoolExecutor(args.jobs) as pool:
            counts = dict(zip(configs, pool.map(
                lambda item: instructions(job, item[1][0], args.steps, item[1][1], Path(folder), f"run{item[0]}"),
                enumerate(configs.values()))))
    per_step = {name: count / args.steps for name, count in counts.items()}
    bare = per_step["bare loop"]
    print(f"instructions per training step (callgrind), over {args.steps} steps of the ~0.4 ms CPU step")
    print(f"  {'configuration':<40}{'per step':>14}{'ratio':>9}{'added/step':>14}")
    for name, value in per_step.items():
        print(f"  {name:<40}{value:>14,.0f}{value / bare:>9.4f}{value - bare:>14,.0f}")


if __name__ == "__main__":
    main()
