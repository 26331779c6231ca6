"""DistributedDataParallel under torchrun (gloo on CPU, ~10 s), with tuneup attached by
`tuneup run` — no code change:

    torchrun --standalone --nproc_per_node=2 -m tuneup run examples/torchrun_ddp.py --slow-rank 1

Every rank is measured and serves its own endpoint (port 9477 + local rank, labelled with
its rank); the ranks share one run directory; rank 0 reads the others' summaries through
the job's store (no collective) and at the end prints a summary across ranks naming the
straggler: --slow-rank R makes rank R do --delay seconds of extra host work per step, before
its forward, or with --slow-in backward inside its backward (a slower GPU, say): there whole
step times and backward times come out equal across ranks, and only the other ranks' wait in
DDP's all-reduce (measured by DDP's own timers) tells which rank is slow. --step-wait S makes
every rank wait S seconds per step, as a host waits for its GPU's share of the step.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--delay", type=float, default=0.01)
parser.add_argument("--slow-in", choices=("host", "backward"), default="host")
parser.add_argument("--step-wait", type=float, default=0.0)
args = parser.parse_args()


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes --delay seconds longer."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(args.delay)
        return grad


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)

step = epoch = 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for x, y in loader:
        slow = rank == args.slow_rank
        if args.step_wait:
            time.sleep(args.step_wait)  # every rank alike: the device's share of the step
        if slow and args.slow_in == "host":
            time.sleep(args.delay)  # a slower host, outside the backward's all-reduce
        out = model(x)
        if slow and args.slow_in == "backward":
            out = SlowBackward.apply(out)  # its backward runs first, before any gradient is ready
        loss = nn.functional.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step == args.steps:
            break
    epoch += 1
dist.destroy_process_group()
