"""A word-level language model trained with hand-written SGD, shaped like pytorch/examples'
word_language_model/main.py: a corpus batchified into columns, `get_batch` slicing bptt
rows, the hidden state repackaged, `model.zero_grad()`, gradient clipping, then
`p.data.add_(p.grad, alpha=-lr)` for every parameter: no optimizer object. A
`loss.item()` every batch; an evaluation pass (eval(), no_grad, one `.item()` per batch)
after every epoch, which quarters the learning rate when the validation loss did not
improve. The corpus is random tokens (nothing is downloaded).

Ground truth, from this source (defaults: 2 epochs, 36 training batches per epoch):
- steps: 72 (each batch one manual update; the script prints the count it ran);
- host reads: 1 per step (`total_loss += loss.item()`, the line marked READ-TRAIN), plus
  5 per evaluation (READ-EVAL, 2 evaluations), none in the loader (there is none);
- input: `get_batch` slices a tensor already in memory: no stall;
- no optimizer, so no learning-rate or optimizer finding applies.
"""

import argparse
import math

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="word-level LSTM language model, manual SGD")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--bptt", type=int, default=10)
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--log-interval", type=int, default=12)
args = parser.parse_args()

torch.manual_seed(1111)
torch.set_num_threads(1)
ntokens = 50


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input, hidden):
        emb = self.encoder(input)
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


train_data = batchify(torch.randint(ntokens, (2888,)), args.batch_size)  # 361 rows: 36 batches of bptt 10
val_data = batchify(torch.randint(ntokens, (400,)), args.batch_size)  # 50 rows: 5 batches
model = RNNModel(ntokens, 32, 32, 1)
criterion = nn.NLLLoss()


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(args.batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()  # READ-EVAL
    return total_loss / (len(data_source) - 1)


def train(epoch, lr):
    model.train()
    total_loss = 0.0
    hidden = model.init_hidden(args.batch_size)
    batches = 0
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()  # READ-TRAIN
        batches += 1
        if batch % args.log_interval == 0 and batch > 0:
            print(f"| epoch {epoch:3d} | {batch:5d} batches | lr {lr:02.2f} | loss {total_loss / args.log_interval:5.2f}")
            total_loss = 0.0
    return batches


lr = args.lr
best_val_loss = None
steps = 0
for epoch in range(1, args.epochs + 1):
    steps += train(epoch, lr)
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}")
    if best_val_loss is None or val_loss < best_val_loss:
        best_val_loss = val_loss
    else:
        lr /= 4.0
print(f"steps {steps}")
