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

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from compile_witness import watch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--backend", default="inductor")
args = parser.parse_args()

witness = watch()


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

witness.print("COMPILED", losses, steps=len(losses))
