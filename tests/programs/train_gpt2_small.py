"""A GPT-2 pretraining script in miniature, shaped like the popular single-file ones (llm.c's
train_gpt2.py): it imports ZeroRedundancyOptimizer (torch.distributed.optim scripts its
functional optimizers at import, calling torch.tensor), reads token batches from a NumPy
array with torch.tensor (one copy per step), sets the learning rate by hand (warm-up, then
cosine), clips gradients and prints the loss of every step."""

import argparse
import math

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401  (imported, as there)
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss


class DataLoaderLite:
    def __init__(self, tokens, B, T):
        self.tokens, self.B, self.T, self.position = tokens, B, T, 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.position: self.position + B * T + 1]
        buf = torch.tensor(buf.astype(np.int32), dtype=torch.long)
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.position += B * T
        if self.position + B * T + 1 > len(self.tokens):
            self.position = 0
        return x, y


def get_lr(it, warmup=3, max_steps=12, max_lr=6e-4, min_lr=6e-5):
    if it < warmup:
        return max_lr * (it + 1) / warmup
    ratio = (it - warmup) / (max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_iterations", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(42)
    tokens = np.random.default_rng(0).integers(0, 128, size=8192).astype(np.uint16)
    loader = DataLoaderLite(tokens, B=4, T=32)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=False)
    for step in range(args.num_iterations):
        x, y = loader.next_batch()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = get_lr(step, max_steps=args.num_iterations)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        print(f"step {step:4d} | loss {loss.item():.6f} | norm {norm:.4f} | lr {lr:.4e}")
