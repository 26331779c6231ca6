"""A long trivial loop; prints RSS (bytes) after warm-up and at the end as JSON."""

import json
import sys

import psutil
import torch

import tuneup

steps = int(sys.argv[2])
agent = tuneup.attach(run_dir=sys.argv[1], interval=0.2)
weight = torch.nn.Parameter(torch.ones(4))
optimizer = torch.optim.SGD([weight], lr=1e-6)
x = torch.ones(4)
process = psutil.Process()
warm = None
for step in range(1, steps + 1):
    loss = (weight * x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 100 == 0:
        loss.item()  # a host read now and then, as real loops have
    if step == steps // 10:
        warm = process.memory_info().rss
end = process.memory_info().rss
agent.detach()
print(json.dumps({"warm_rss": warm, "end_rss": end, "steps": agent.snapshot()["totals"]["steps"]}))
