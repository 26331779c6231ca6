"""A tabular classifier, written as the scripts that train on a CSV already loaded are: the rows
in one tensor indexed per sample, batches of 512 collated in the main process (num_workers=0),
an MLP, Adam, the loss printed every 200 steps.

Ground truth, from this source: each batch is 512 (features, label) tuples made by
__getitem__ and collated into two tensors; a young collection that comes while they are alive
promotes them, so objects keep reaching the oldest generation and Python's full collections
come every few hundred steps, each walking every object the process holds (torch's import
leaves some 170,000). With --freeze the script calls gc.collect() and gc.freeze() before its
loop (the fix tuneup names). It times the collections itself, with gc.callbacks of its own
from its first step to its last, and prints one JSON line: steps, training seconds, full
collections and their seconds (its own clock, not tuneup's), the objects gc.freeze() holds
at the loop's end and the last loss (its repr: bit for bit)."""

import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1200)
parser.add_argument("--freeze", action="store_true")
args = parser.parse_args()


class Rows(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(50_000, 64, generator=generator)
        self.labels = torch.randint(0, 2, (50_000,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.features[index], self.labels[index]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loader = DataLoader(Rows(), batch_size=512, shuffle=True, drop_last=True)

full = {"count": 0, "seconds": 0.0, "began": None, "on": False}


def timed(phase, info):
    if phase == "start":
        full["began"] = time.perf_counter() if full["on"] and info["generation"] == 2 else None
    elif full["began"] is not None:
        full["count"] += 1
        full["seconds"] += time.perf_counter() - full["began"]
        full["began"] = None


gc.callbacks.append(timed)  # (left in place: a second run in one process appends its own)
if args.freeze:
    gc.collect()
    gc.freeze()

step = 0
began = time.perf_counter()
full["on"] = True
while step < args.steps:
    for features, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(features), labels)
        loss.backward()
        optimizer.step()
        step += 1
        if step % 200 == 0:
            print(f"step {step} loss {loss.item():.3f}")
        if step == args.steps:
            break
full["on"] = False
print(json.dumps({"steps": step, "seconds": time.perf_counter() - began, "full_collections": full["count"],
                  "full_seconds": full["seconds"], "frozen": gc.get_freeze_count(), "last_loss": repr(loss.item())}))
