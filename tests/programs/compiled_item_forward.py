"""A compiled model whose forward reads a value on the host: it rescales its hidden state when
that grows large, deciding with `.item()` (as overflow guards and adaptive layers are often
written), `model = torch.compile(model)`, AdamW, batches of 16 from a DataLoader.

Ground truth, from this source: STEPS optimizer steps (default 24). Dynamo cannot put
`.item()` in a graph (capture_scalar_outputs is off by default): the forward's graph breaks at
the BREAK line, the read runs eagerly between the graph before it and the code dynamo resumes
at after it, on every step. That resumed code is specialized to the float `peak` it was first
called with (its guard: `___stack0 == 0.93...`); the next step's value fails the guard and
dynamo recompiles it once, with the float dynamic (automatic dynamic): one recompile, none
after. The batch size never changes. One `loss.item()` per step besides (the print).

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
parser.add_argument("--steps", type=int, default=24)
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


class Rescaled(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.inner, self.outer = nn.Linear(16, width), nn.Linear(width, 1)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        peak = h.abs().amax().item()  # BREAK: a host read inside the compiled forward
        if peak > 4.0:
            h = h / peak
        return self.outer(h)


torch.manual_seed(0)
features = torch.randn(args.steps * 16, 16)
targets = features[:, :1] * 0.5 + 0.1 * torch.randn(args.steps * 16, 1)
loader = DataLoader(TensorDataset(features, targets), batch_size=16)

model = torch.compile(Rescaled(), backend=args.backend)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

losses = []
for x, y in loader:
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step {len(losses)} loss {losses[-1]:.6f}", flush=True)

from torch._dynamo.utils import counters, guard_failures  # noqa: E402  (loaded by torch.compile's first call)

print("COMPILED " + json.dumps({
    "steps": len(losses), "losses": [float.hex(value) for value in losses],
    "compiled": {section: dict(counters[section]) for section in ("frames", "stats", "recompiles", "graph_break")},
    # The guards that failed, per compiled code (a recompile each, and a lookup that passed over a cached graph)
    "guard_failures": {f"{code.co_name}:{code.co_firstlineno}": [str(reason) for reason in reasons]
                       for code, reasons in guard_failures.items()},
    "warnings": sorted(set(seen_warnings)), "torch_log": sorted(set(torch_log_records))}), flush=True)
