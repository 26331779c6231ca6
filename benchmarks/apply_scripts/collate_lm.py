"""A small transformer language model whose DataLoader tokenizes in its collate_fn, as scripts
do that keep raw text lines in the Dataset and encode each batch on the fly: `collate()` maps
characters to ids in pure Python, pads and stacks; AdamW; `--workers` workers (default 0).

Ground truth, from this source: each step collates 32 lines of ~56 characters in Python
in the main process, then a forward/backward of a 2-layer, 64-wide transformer.
Prints one JSON line: steps, training wall seconds, process CPU seconds."""

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--workers", type=int, default=0)
args = parser.parse_args()

VOCAB = {c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,;'")}


class Lines(Dataset):
    def __init__(self):
        rng = random.Random(0)
        letters = list(VOCAB)
        self.lines = ["".join(rng.choice(letters) for _ in range(rng.randint(48, 64))) for _ in range(4000)]

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, index):
        return self.lines[index]


def collate(lines):
    encoded = [[VOCAB.get(ch, 0) for ch in line.lower()] for line in lines]
    width = max(len(ids) for ids in encoded)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in encoded])
    return ids[:, :-1], ids[:, 1:]


class TinyLM(nn.Module):
    def __init__(self, vocab=len(VOCAB) + 1, width=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, dropout=0.0)
        self.body = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
loader = DataLoader(Lines(), batch_size=32, shuffle=True, num_workers=args.workers, collate_fn=collate)

if __name__ == "__main__":
    began, cpu = time.perf_counter(), time.process_time()
    step = 0
    while step < args.steps:
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)
            if step >= args.steps:
                break
    print(json.dumps({"steps": step, "seconds": time.perf_counter() - began, "cpu": time.process_time() - cpu}))
