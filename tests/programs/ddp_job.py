"""A DDP training job for torchrun (gloo, CPU), run under `-m tuneup run`.

    --steps N         train this many steps (every rank the same: they all-reduce each step)
    --slow-rank R     this rank does --delay seconds of extra work per step outside backward
    --die-rank R      this rank kills itself (SIGKILL) after --die-after seconds
"""

import argparse
import os
import signal
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
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--die-after", type=float, default=3.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)

began = time.monotonic()
step = epoch = 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for x, y in loader:
        if rank == args.slow_rank:
            time.sleep(args.delay)  # a slower host, outside the backward's all-reduce
        if rank == args.die_rank and time.monotonic() - began > args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step == args.steps:
            break
    epoch += 1
dist.destroy_process_group()
