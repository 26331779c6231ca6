"""Polynomial regression with a hand-written update, shaped like pytorch/examples'
regression/main.py: `fc.zero_grad()`, `F.smooth_l1_loss(fc(batch_x), batch_y)`,
`loss = output.item()` before backward, then `param.data.add_(-0.1 * param.grad)` for each
parameter, until the loss falls under a threshold: no optimizer, no DataLoader.

Ground truth, from this source (seeded): the loop stops after the number of batches it
prints ("after N batches"): that many steps; two host reads per step (`b_target.item()` in
`f`, called by `get_batch()`, as in the original, and `output.item()`, the line marked READ);
batches are made in the loop by `get_batch()` (random tensors, cheap: no stall); no
optimizer, so no learning-rate or optimizer finding applies.
"""

from itertools import count

import torch
import torch.nn.functional as F

POLY_DEGREE = 4
torch.manual_seed(42)
torch.set_num_threads(1)
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    return x.mm(W_target) + b_target.item()  # READ-TARGET


def get_batch(batch_size=32):
    random = torch.randn(batch_size)
    x = make_features(random)
    y = f(x)
    return x, y


fc = torch.nn.Linear(W_target.size(0), 1)

for batch_idx in count(1):
    batch_x, batch_y = get_batch()
    fc.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()  # READ
    output.backward()
    for param in fc.parameters():
        param.data.add_(-0.1 * param.grad)
    if loss < 1e-3 or batch_idx == 400:
        break

print(f"Loss: {loss:.6f} after {batch_idx} batches")
