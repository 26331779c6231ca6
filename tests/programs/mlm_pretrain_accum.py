"""Masked-language-model pretraining with gradient accumulation, shaped like the BERT/RoBERTa
pretraining scripts people adapt (run_mlm_no_trainer.py's loop without the libraries): a small
transformer encoder, a DataLoader over tokenized sequences, 15% of the tokens masked per
micro-batch in the loop (80% [MASK], 10% random, 10% kept), the loss divided by the
accumulation steps, `clip_grad_norm_` and an AdamW step every 4 micro-batches, a linear
warm-up and decay written into `param_group["lr"]` by hand, a log line every 10 updates.

Ground truth, from this source (seeded): 200 micro-batches, 4 per update: 50 optimizer steps,
each with 4 fetches and 4 forward/backward passes. Host reads: `loss.item()` every 10 updates
(READ-LOG, on some steps only). The learning rate changes every update (set by the loop: a
schedule). Gradients clipped every update. The masking in the loop is a few elementwise ops
on a 16 x 64 batch, a small share of a step of 4 forward/backward passes. Findings the truth
calls for: none.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(42)
torch.set_num_threads(1)
VOCAB, LENGTH, MASK, PAD = 200, 64, 1, 0
ACCUMULATION, MICRO_BATCHES, WARMUP, PEAK_LR = 4, 200, 5, 1e-3
UPDATES = MICRO_BATCHES // ACCUMULATION

sequences = torch.randint(2, VOCAB, (1600, LENGTH))
loader = DataLoader(TensorDataset(sequences), batch_size=16, shuffle=True, drop_last=True)


class Encoder(nn.Module):
    def __init__(self, d_model=64, heads=4, layers=2):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.positions = nn.Embedding(LENGTH, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.lm_head = nn.Linear(d_model, VOCAB)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.size(1)))
        return self.lm_head(self.encoder(x))


def mask_tokens(ids):
    labels = ids.clone()
    chosen = torch.rand(ids.shape) < 0.15
    labels[~chosen] = -100
    roll = torch.rand(ids.shape)
    ids = ids.clone()
    ids[chosen & (roll < 0.8)] = MASK
    random = chosen & (roll >= 0.8) & (roll < 0.9)
    ids[random] = torch.randint(2, VOCAB, ids.shape)[random]
    return ids, labels


model = Encoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)


def learning_rate(update):
    if update < WARMUP:
        return PEAK_LR * (update + 1) / WARMUP
    return PEAK_LR * max(0.0, (UPDATES - update) / (UPDATES - WARMUP))


micro, update = 0, 0
model.train()
while micro < MICRO_BATCHES:
    for (ids,) in loader:
        inputs, labels = mask_tokens(ids)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        (loss / ACCUMULATION).backward()
        micro += 1
        if micro % ACCUMULATION == 0:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(update)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if update % 10 == 0:
                print(f"update {update} loss {loss.item():.4f}")  # READ-LOG
        if micro == MICRO_BATCHES:
            break
print(f"steps {update}")
