"""A training job for fault tests: run it with and without the agent and compare.

Prints "step N" after each optimizer step and "done steps=N" at the end.
"""

import argparse
import json
import sys

import torch
from torch import nn

from benchmarks.scenarios import SlowDataset, loader_for, mlp

parser = argparse.ArgumentParser()
parser.add_argument("--agent", choices=["on", "off"], default="on")
parser.add_argument("--run-dir")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--latency", type=float, default=0.0)
parser.add_argument("--fail-at", type=int, default=None)
parser.add_argument("--snapshot", action="store_true", help="print the agent's totals as JSON at the end")
args = parser.parse_args()

if args.agent == "on":
    import tuneup

    agent = tuneup.attach(run_dir=args.run_dir, interval=0.05)

torch.manual_seed(0)
model = mlp(hidden=32)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = loader_for(SlowDataset(size=4096, latency=args.latency, fail_at=args.fail_at),
                    batch_size=8, num_workers=args.workers)
steps = 0
for x, y in loader:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    steps += 1
    print(f"step {steps}", flush=True)
    if steps == args.steps:
        break
print(f"done steps={steps}", flush=True)
if args.agent == "on" and args.snapshot:
    agent.detach()
    print(json.dumps(agent.snapshot()["totals"]), flush=True)
sys.exit(0)
