"""A real training job for the export tests: a small conv net fed by a DataLoader (with real
worker processes when asked), a CPU GradScaler, tuneup attached through its environment
(TUNEUP_* variables: port, mode, NVML binding, ...).

Prints one JSON line when the agent is serving ({"url", "pid", "run_id"}), then trains until
--seconds have passed (or --steps are done), then, with --hang, stops stepping but stays alive.

    --delay S         seconds each sample takes to load (a data stall)
    --workers N       DataLoader worker processes
    --compute S       extra seconds of work per step outside backward (a straggling rank)
    --skip-every K    every Kth step's loss is infinite: GradScaler skips that step
    --fake-allocator  report CUDA caching-allocator figures (for machines without CUDA; the
                      same function the agent reads, returning what a CUDA job would)
    --fake-device NAME  count the step's FLOPs as a bf16 step on the CUDA device NAME (for
                      machines without CUDA: the count runs as it does, its device is NAME, so
                      MFU is stated against that device's peak)
    --ddp             wrap the model in DistributedDataParallel over a process group of its own
                      (one process, gloo): DDP's timers run as in any DDP job
"""

import argparse
import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=30.0)
parser.add_argument("--steps", type=int, default=0)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--compute", type=float, default=0.0)
parser.add_argument("--skip-every", type=int, default=0)
parser.add_argument("--hang", action="store_true")
parser.add_argument("--fake-allocator", action="store_true")
parser.add_argument("--ddp", action="store_true")
parser.add_argument("--fake-device")
args = parser.parse_args()

if args.fake_device:
    import tuneup.measure.flops as flops

    counted = flops.FlopCount._count

    def on_the_device(self, *positional, **named):
        return dict(counted(self, *positional, **named), device="cuda", device_name=args.fake_device)

    flops.FlopCount._count = on_the_device
    # The step's precision is read off its forward at each look, not from the count: bf16.
    flops._step_precision = lambda module, parameter: {"matmul": "bfloat16", "conv": "bfloat16"}

if args.fake_allocator:
    import tuneup.measure.memory as memory

    def allocator_stats():
        gib = 2**30
        return {"available": True, "devices": [{
            "device": 0, "allocated_bytes": 3 * gib, "allocated_peak_bytes": 5 * gib, "reserved_bytes": 6 * gib,
            "reserved_peak_bytes": 7 * gib, "alloc_retries": 2, "ooms": 0, "total_bytes": 80 * gib}]}

    memory.allocator_stats = allocator_stats
    import tuneup.measure.recorder

    tuneup.measure.recorder.allocator_stats = allocator_stats


class Images(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(512, 3, 16, 16, generator=generator)
        self.labels = torch.randint(0, 10, (512,), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        if self.delay:
            time.sleep(self.delay)
        return self.images[index], self.labels[index]


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
if args.ddp:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", growth_interval=50)
loader = DataLoader(Images(args.delay), batch_size=16, shuffle=True, num_workers=args.workers,
                    persistent_workers=args.workers > 0)

agent = tuneup.attach()
print(json.dumps({"url": agent.server.url if agent.server else None, "pid": agent.run_info["pid"],
                  "run_id": agent.run_info["run_id"]}), flush=True)

end = time.monotonic() + args.seconds
step = 0
while True:
    for images, labels in loader:
        loss = nn.functional.cross_entropy(model(images), labels)
        if args.skip_every and step % args.skip_every == args.skip_every - 1:
            loss = loss * float("inf")
        if args.compute:
            time.sleep(args.compute)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        step += 1
        if time.monotonic() > end or (args.steps and step >= args.steps):
            break
    else:
        continue
    break

if args.hang:  # alive, serving, no longer stepping (a job stuck in a collective or on I/O)
    while True:
        time.sleep(1)
agent.detach()
print(json.dumps({"steps": step, "totals": agent.snapshot()["totals"]["steps"]}), flush=True)
sys.exit(0)
