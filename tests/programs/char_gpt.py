"""A character-level GPT trained the way nanoGPT's train.py trains one: batches cut from a
flat token array by `get_batch()` (random offsets, torch.stack of slices: no DataLoader),
the learning rate set by hand every iteration (linear warm-up, then cosine decay to a floor)
for every param group, an `estimate_loss()` every `eval_interval` iterations (eval(),
no_grad, `eval_iters` batches per split with a `loss.item()` each), gradient accumulation,
gradient clipping, AdamW, and a `loss.item()` logged every `log_interval` iterations.

Ground truth, from this source (defaults: max_iters 120, eval_interval 40, eval_iters 4,
gradient_accumulation_steps 2, log_interval 10):
- steps: 120 (one optimizer.step() per iteration; 2 forwards and backwards each);
- learning rate: changed by the loop every iteration (warm-up 10, cosine to 1e-4 at 120):
  a schedule, though there is no LRScheduler;
- evaluations: 3, at iterations 0, 40 and 80 (before that iteration's forward), 2 splits x 4
  batches, a READ-EVAL `.item()` each: 8 reads per evaluation, not the steps';
- host reads in the steps: READ-LOG once every 10 iterations (0.1 per step on average);
- input: `get_batch()` on the training thread, a few tensor slices: cheap (not 15% of a step);
- gradient clipping every step: no spikes finding.
"""

import argparse
import math

import torch
import torch.nn as nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--max_iters", type=int, default=120)
parser.add_argument("--eval_interval", type=int, default=40)
parser.add_argument("--eval_iters", type=int, default=4)
parser.add_argument("--log_interval", type=int, default=10)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
args = parser.parse_args()

torch.manual_seed(1337)
torch.set_num_threads(1)
batch_size, block_size, n_embd, n_head, vocab_size = 8, 32, 32, 2, 65
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-3, 1e-4, 10, 120
text = torch.randint(vocab_size, (20000,), generator=torch.Generator().manual_seed(0))
n = int(0.9 * len(text))
train_data, val_data = text[:n], text[n:]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1))

    def forward(self, x):
        T = x.size(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:T, :T], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        logits = self.head(self.ln_f(self.blocks(x)))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))
        return logits, loss


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()  # READ-EVAL
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
X, Y = get_batch("train")
iter_num = 0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % args.eval_interval == 0 and iter_num < args.max_iters:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(args.gradient_accumulation_steps):
        logits, loss = model(X, Y)
        loss = loss / args.gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % args.log_interval == 0:
        lossf = loss.item() * args.gradient_accumulation_steps  # READ-LOG
        print(f"iter {iter_num}: loss {lossf:.4f}")
    iter_num += 1
    if iter_num >= args.max_iters:
        break
print(f"steps {iter_num}")
