"""Attach, train a while, then die by SIGKILL mid-run (no atexit, no flush at exit)."""

import os
import signal
import sys
import time

import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp

tuneup.attach(run_dir=sys.argv[1], interval=0.05)
model = mlp(hidden=16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
started = time.perf_counter()
for x, y in loader_for(SlowDataset(size=100_000, latency=0.0005)):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    if time.perf_counter() - started > 0.6:
        os.kill(os.getpid(), signal.SIGKILL)
