"""Compiled training loops, the shapes people copy from the torch.compile tutorial and
nanoGPT-style scripts: `model = torch.compile(model)`, `model.compile()`, a compiled
`optimizer.step`, `fullgraph=True`, `dynamic=True`, inductor, and the whole training step
compiled (zero_grad, forward, backward and `optimizer.step()` in one function under
torch.compile, as recent tutorials write it), each a small MLP or transformer block trained
with AdamW on batches from a DataLoader (two workers for one shape).

Run one after another in this process (dynamo reset between them); for each, the losses and
what torch's own counters say the program compiled (torch._dynamo.utils.counters: frames,
unique graphs, recompiles, graph breaks) and the warnings it raised, printed as one JSON line
`SHAPE {...}`, so that a run under `tuneup run` can be compared with plain python's.

Ground truth, from this source: STEPS optimizer steps per shape (default 12), 8 shapes: 96
steps in all; one `loss.item()` per step (the print); the data is in memory (no stall). In
the shape `step` no optimizer hook runs eagerly (dynamo traces torch's step wrapper with the
hooks in it) and no forward either: only the backward (a graph break) and zero_grad (torch
marks it not to be traced) run outside compiled code.
"""

import argparse

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from compile_witness import watch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--shapes", default="module,user-module,in-place,optimizer,fullgraph,dynamic,inductor,step")
parser.add_argument("--device", default="cpu", help="cuda: on the GPU (add the shape reduce-overhead: CUDA graphs)")
args = parser.parse_args()

witness = watch()


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP), as in nanoGPT."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x).mean(dim=1)


def data(shape):
    generator = torch.Generator().manual_seed(1)
    if shape in ("module", "optimizer", "dynamic", "reduce-overhead", "step"):
        x = torch.randn(args.steps * 16, 16, generator=generator)
    else:
        x = torch.randn(args.steps * 16, 8, 32, generator=generator)
    y = torch.randn(args.steps * 16, 1, generator=generator)
    workers = 2 if shape == "module" else 0
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False, num_workers=workers,
                      pin_memory=args.device == "cuda")


def train(shape):
    torch.manual_seed(0)
    mlp = shape in ("module", "optimizer", "dynamic", "reduce-overhead", "step")
    model = (nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)) if mlp else Block()).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=shape != "optimizer")
    backend = "inductor" if shape in ("inductor", "reduce-overhead", "step") else "eager"
    if shape == "in-place":
        model.compile(backend=backend)
    elif shape == "optimizer":
        optimizer.step = torch.compile(optimizer.step, backend=backend)
    elif shape == "fullgraph":
        model = torch.compile(model, backend=backend, fullgraph=True)
    elif shape == "dynamic":
        model = torch.compile(model, backend=backend, dynamic=True)
    elif shape == "reduce-overhead":  # CUDA graphs (on the GPU)
        model = torch.compile(model, mode="reduce-overhead")
    elif shape != "step":
        model = torch.compile(model, backend=backend)

    @torch.compile(backend=backend)
    def train_step(x, y):  # the shape `step`
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    losses = []
    for x, y in data(shape):
        x, y = x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True)
        if shape == "step":
            loss = train_step(x, y)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
        print(f"{shape} step {len(losses)} loss {losses[-1]:.6f}", flush=True)
    return losses


for shape in args.shapes.split(","):
    torch._dynamo.reset()
    counters.clear()
    witness.clear()
    losses = train(shape)
    witness.print("SHAPE", losses, guard_failures=False, shape=shape)
