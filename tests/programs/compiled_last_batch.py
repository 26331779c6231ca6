"""A compiled model trained over epochs whose last batch is short, as most scripts load their
data: `DataLoader(..., batch_size=32, shuffle=True)` with drop_last=False (the default) over
200 rows, `model = torch.compile(model)`, AdamW, a small MLP regressor.

Ground truth, from this source: EPOCHS epochs (default 3) of 7 batches, 6 of 32 rows and the
last of 8: 21 optimizer steps. The first call compiles the forward for batches of 32; the
first short batch fails its guard on x's size (dim 0: 32, then 8) and dynamo recompiles it once, with
that dimension dynamic (automatic dynamic shapes): one recompile, none after. No graph break.
One `loss.item()` per step (the print).

At its end it prints what torch's own counters say it compiled, with its losses, steps and
warnings, as one JSON line `COMPILED {...}`, so that a run under `tuneup run` can be compared
with plain python's.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from compile_witness import watch

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--backend", default="inductor")
args = parser.parse_args()

witness = watch()

torch.manual_seed(0)
features = torch.randn(200, 12)
targets = features @ torch.randn(12, 1) + 0.1 * torch.randn(200, 1)
loader = DataLoader(TensorDataset(features, targets), batch_size=32, shuffle=True,
                    generator=torch.Generator().manual_seed(1))

model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
model = torch.compile(model, backend=args.backend)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

losses = []
for epoch in range(args.epochs):
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"epoch {epoch} loss {losses[-1]:.6f}", flush=True)

witness.print("COMPILED", losses, steps=len(losses))
