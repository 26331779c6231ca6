"""A training step compiled whole, as the torch.compile tutorials and JAX-style scripts write it:
`@torch.compile` on a function that zeroes the gradients, runs the forward, the backward and
`optimizer.step()`; batches drawn by get_batch() from tensors in memory (nanoGPT-style, no
DataLoader); a small character-level MLP language model trained with AdamW.

Ground truth, from this source: STEPS iterations (default 40, printed as `steps N`), each one
AdamW update inside train_step; one `loss.item()` every 10 iterations (READ-LOG), none on the
other steps; the batches are in memory (no stall). Inside the compiled function only
zero_grad (torch marks it not to be traced: a graph break, run eagerly) and the backward
(dynamo does not trace Tensor.backward: a graph break) run outside compiled code; the
forward and the optimizer's step, its hooks with it, are traced. torch._dynamo is first
imported by torch.compile below, not at the top: the first compilation begins at the first
call of train_step.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

torch.manual_seed(0)
text = "the quick brown fox jumps over the lazy dog " * 40
vocab = sorted(set(text))
data = torch.tensor([vocab.index(c) for c in text])
block, batch_size = 8, 16


def get_batch():
    starts = torch.randint(len(data) - block - 1, (batch_size,))
    x = torch.stack([data[i:i + block] for i in starts])
    y = torch.stack([data[i + block] for i in starts])
    return x, y


class CharMLP(nn.Module):
    def __init__(self, vocab_size, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mlp = nn.Sequential(nn.Linear(block * width, 128), nn.GELU(), nn.Linear(128, vocab_size))

    def forward(self, x):
        return self.mlp(self.embed(x).flatten(1))


model = CharMLP(len(vocab))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)


@torch.compile
def train_step(x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


for step in range(args.steps):
    x, y = get_batch()
    loss = train_step(x, y)
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f}")  # READ-LOG
print(f"steps {args.steps}")
