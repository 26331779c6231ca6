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
import json
import logging
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--backend", default="inductor")
args = parser.parse_args()

seen_warnings = []
warnings.simplefilter("always")
warnings.showwarning = lambda message, category, *rest, **kw: seen_warnings.append(f"{category.__name__}: {message}")
torch_log_records = []


class Keep(logging.Handler):
    def emit(self, record):
        torch_log_records.append(f"{record.levelname}: {record.getMessage()[:200]}")


logging.getLogger("torch").addHandler(Keep(level=logging.WARNING))

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

from torch._dynamo.utils import counters, guard_failures  # noqa: E402  (loaded by torch.compile's first call)

print("COMPILED " + json.dumps({
    "steps": len(losses), "losses": [float.hex(value) for value in losses],
    "compiled": {section: dict(counters[section]) for section in ("frames", "stats", "recompiles", "graph_break")},
    # The guards that failed, per compiled code (a recompile each, and a lookup that passed over a cached graph)
    "guard_failures": {f"{code.co_name}:{code.co_firstlineno}": [str(reason) for reason in reasons]
                       for code, reasons in guard_failures.items()},
    "warnings": sorted(set(seen_warnings)), "torch_log": sorted(set(torch_log_records))}), flush=True)
