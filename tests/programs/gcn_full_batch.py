"""A two-layer graph convolutional network trained full-batch for node classification, shaped
like PyTorch Geometric's examples/gcn.py without the library: a symmetric-normalized sparse
adjacency (self-loops, D^-1/2 A D^-1/2) multiplied in each layer, dropout, Adam with weight
decay, `train()` returning `float(loss)`, `test()` computing the train/val/test accuracies
in eval() mode under no_grad with `int(...sum())` per mask, and a log line per epoch. The
graph is a planted partition (7 classes, 700 nodes, features noisy class means), generated
here.

Ground truth, from this source (seeded): one optimizer step per epoch, 100 epochs: 100 steps.
A host read per step in training (`float(loss)`, the line marked READ-LOSS); the accuracies'
reads happen in the evaluation after each step (`int(...)`, READ-ACC: three per evaluation,
its own). No DataLoader: the batch is the whole graph (700 nodes) every step. Findings the
truth calls for: host-syncs (a read every step, the example's own pattern); allowed:
no-lr-schedule (the example's constant rate).
"""

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(12345)
torch.set_num_threads(1)
NODES, CLASSES, FEATURES = 700, 7, 64

y = torch.arange(NODES) % CLASSES
x = torch.randn(CLASSES, FEATURES)[y] + 2.0 * torch.randn(NODES, FEATURES)
same = y[:, None] == y[None, :]
links = torch.rand(NODES, NODES) < torch.where(same, torch.tensor(0.02), torch.tensor(0.002))
links = (links | links.T) | torch.eye(NODES, dtype=torch.bool)
degree = links.sum(1).float()
norm = degree.rsqrt()
index = links.nonzero().T
adj = torch.sparse_coo_tensor(index, norm[index[0]] * norm[index[1]], (NODES, NODES)).coalesce()
order = torch.randperm(NODES)
train_mask = torch.zeros(NODES, dtype=torch.bool)
val_mask = torch.zeros(NODES, dtype=torch.bool)
test_mask = torch.zeros(NODES, dtype=torch.bool)
train_mask[order[:140]], val_mask[order[140:340]], test_mask[order[340:]] = True, True, True


class GCNConv(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x, adj):
        return torch.sparse.mm(adj, self.lin(x)) + self.bias


class GCN(nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden_channels)
        self.conv2 = GCNConv(hidden_channels, out_channels)

    def forward(self, x, adj):
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, adj).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, adj)


model = GCN(FEATURES, 16, CLASSES)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)


def train():
    model.train()
    optimizer.zero_grad()
    out = model(x, adj)
    loss = F.cross_entropy(out[train_mask], y[train_mask])
    loss.backward()
    optimizer.step()
    return float(loss)  # READ-LOSS


@torch.no_grad()
def test():
    model.eval()
    pred = model(x, adj).argmax(dim=-1)
    accs = []
    for mask in [train_mask, val_mask, test_mask]:
        accs.append(int((pred[mask] == y[mask]).sum()) / int(mask.sum()))  # READ-ACC
    return accs


best_val_acc = test_acc = 0
for epoch in range(1, 101):
    loss = train()
    train_acc, val_acc, tmp_test_acc = test()
    if val_acc > best_val_acc:
        best_val_acc, test_acc = val_acc, tmp_test_acc
    if epoch % 20 == 0:
        print(f"Epoch: {epoch:03d}, Loss: {loss:.4f}, Train: {train_acc:.4f}, Val: {val_acc:.4f}, Test: {test_acc:.4f}")
print(f"epochs {epoch}")
