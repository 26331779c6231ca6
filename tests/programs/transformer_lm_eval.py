"""A small causal transformer language model with periodic evaluation, shaped like the
training scripts of small-LM tutorials (PyTorch's "Language Modeling with nn.Transformer",
minGPT-style loops): token sequences from a DataLoader over a tensor dataset (shuffled,
num_workers=0), AdamW with weight decay, a warm-up then cosine schedule through LambdaLR,
`clip_grad_norm_` every step, a log line every 25 steps with `loss.item()`, and every 50 steps
an evaluation on a validation DataLoader in eval() mode under no_grad, its mean loss read
per batch. The corpus is generated: a first-order Markov chain over a 96-token vocabulary.

Ground truth, from this source (seeded): 150 optimizer steps (the loop stops there), one a
batch; a host read every 25 steps in training (`loss.item()`, READ-LOG: a read on some steps
only); evaluations after steps 50, 100 and 150, each 4 batches with a read per batch
(READ-EVAL, their own). Gradients clipped, a schedule, set_to_none zeroing, batches cheap to
make from in-memory tensors (the wait for them is a few percent of a step). Findings the truth
calls for: none.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(1337)
torch.set_num_threads(1)
VOCAB, CONTEXT, BATCH, STEPS, EVAL_EVERY, LOG_EVERY = 96, 32, 16, 150, 50, 25

transitions = torch.softmax(torch.randn(VOCAB, VOCAB) * 3, dim=1)


def corpus(sequences):
    tokens = torch.empty(sequences, CONTEXT + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (sequences,))
    for t in range(1, CONTEXT + 1):
        tokens[:, t] = torch.multinomial(transitions[tokens[:, t - 1]], 1).squeeze(1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


train_loader = DataLoader(corpus(2048), batch_size=BATCH, shuffle=True, drop_last=True)
val_loader = DataLoader(corpus(64), batch_size=BATCH)


class CausalLM(nn.Module):
    def __init__(self, d_model=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(torch.zeros(1, CONTEXT, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, idx):
        x = self.embed(idx) + self.position[:, : idx.size(1)]
        x = self.blocks(x, mask=self.mask[: idx.size(1), : idx.size(1)], is_causal=True)
        return self.head(self.norm(x))


model = CausalLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
warmup = 15


def schedule(step):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup)))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


@torch.no_grad()
def evaluate():
    model.eval()
    total = 0.0
    for inputs, targets in val_loader:
        logits = model(inputs)
        total += F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item()  # READ-EVAL
    model.train()
    return total / len(val_loader)


step = 0
while step < STEPS:
    for inputs, targets in train_loader:
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.3f}")  # READ-LOG
        if step % EVAL_EVERY == 0:
            print(f"step {step} val {evaluate():.3f}")
        if step == STEPS:
            break
print(f"steps {step}")
