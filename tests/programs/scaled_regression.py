"""A regression trained the way mixed-precision tutorials train one: a Dataset that reads its
samples from storage (a 0.5 ms sleep each), a DataLoader with no workers, a GradScaler
(`torch.amp.GradScaler("cpu")`), `loss.item()` each step for the running average, and a
validation pass under `torch.no_grad()` every 100 steps.

Ground truth, from this source (defaults: 240 steps, batch 16):
- steps: 240 (one optimizer step each; the scaler skips none: the loss is finite);
- host reads: 1 per step (`loss.item()`, line marked READ);
- input: 16 samples x 0.5 ms of sleep a batch in the main process (8 ms), against a small
  MLP's forward and backward: data loading is most of the step.
The run-log fuzz tests (test_records.py) take its run log as real records to damage.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=240)
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()


class StoredSamples(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, index):
        time.sleep(0.0005)  # reading the sample
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(32, generator=generator)
        return x, x[:4].sum(dim=0, keepdim=True)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
loader = DataLoader(StoredSamples(), batch_size=args.batch_size, shuffle=True)
validation = [StoredSamples()[i] for i in range(32)]

step, running = 0, 0.0
while step < args.steps:
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()  # READ
        step += 1
        if step % 100 == 0:
            with torch.no_grad():
                error = sum(nn.functional.mse_loss(model(vx), vy).item() for vx, vy in validation)
            print(f"step {step}: train {running / 100:.4f} validation {error / len(validation):.4f}")
            running = 0.0
        if step == args.steps:
            break
