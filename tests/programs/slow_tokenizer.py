"""A small transformer language model fed by a tokenizer that runs in the loop, as scripts do
that read raw text lines and encode each batch on the fly: `encode()` maps characters to ids
in pure Python for every line of every batch, then pads and stacks them, on the training
thread, before the forward. AdamW, no DataLoader, a `loss.item()` every 20 steps.

Ground truth, from this source (defaults: 150 steps, batch 32 lines of 192 characters):
- steps: 150;
- input: `encode()` (READ-ENCODE marks its loop) runs in pure Python over ~6,000 characters per
  step before the forward: a large share of each step (the script prints what it measured
  for the tokenizer on stderr, `tokenize share`), the lines to name being encode() and
  make_batch();
- host reads: READ-LOG every 20 steps (0.05 per step): below the host-syncs threshold;
- AdamW at a constant learning rate, no scheduler, 150 steps: no-lr-schedule is true.
"""

import argparse
import random
import sys
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--length", type=int, default=192)
args = parser.parse_args()

random.seed(0)
torch.manual_seed(0)
torch.set_num_threads(1)
alphabet = "abcdefghijklmnopqrstuvwxyz .,;!?"
# A greedy longest-match tokenizer over characters, bigrams and trigrams, in pure Python.
pieces = list(alphabet) + [a + b for a in "etaoin " for b in "etaoin "] + ["the", "and", "ing", "ion"]
vocab = {piece: i + 1 for i, piece in enumerate(pieces)}
corpus = ["".join(random.choice(alphabet) for _ in range(args.length + random.randint(0, 8))) for _ in range(512)]


def encode(line):
    ids, i = [], 0
    while i < len(line):  # READ-ENCODE
        for size in (3, 2, 1):
            piece = line[i:i + size]
            if piece in vocab:
                ids.append(vocab[piece])
                i += len(piece)
                break
        else:
            ids.append(0)
            i += 1
    return ids


def make_batch(lines):
    encoded = [encode(line)[: args.length + 1] for line in lines]
    width = max(len(ids) for ids in encoded)
    padded = [ids + [0] * (width - len(ids)) for ids in encoded]
    batch = torch.tensor(padded)
    return batch[:, :-1], batch[:, 1:]


class TinyLM(nn.Module):
    def __init__(self, vocab_size=len(pieces) + 1, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        self.mix = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.out = nn.Linear(d, vocab_size)

    def forward(self, x):
        h = self.emb(x)
        return self.out(h + self.mix(h))


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokenizing = 0.0
started = time.perf_counter()
for step in range(args.steps):
    began = time.perf_counter()
    x, y = make_batch(random.sample(corpus, args.batch))
    tokenizing += time.perf_counter() - began
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 20 == 0:
        print(f"step {step}: loss {loss.item():.4f}")  # READ-LOG
total = time.perf_counter() - started
print(f"steps {args.steps}")
print(f"tokenize share {tokenizing / total:.3f}", file=sys.stderr)  # timings vary: not on stdout
