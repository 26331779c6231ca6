"""Too many DataLoader workers for the machine: a tabular model over features already in
memory (a tensor indexed per sample, as scripts do after loading a CSV or a .npy), batches of
512 rows of 256 features, `num_workers=8` copied from a GPU server's script onto a 2-core
machine; an MLP, Adam.

Ground truth, from this source: a sample costs one row's indexing; each batch (512 KB) is
collated in a worker, pickled through shared memory and rebuilt in the main process, and 8
workers plus the main process share the machine's cores. Prints one JSON line: steps,
training wall seconds, process CPU seconds."""

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--workers", type=int, default=8)
args = parser.parse_args()


class Rows(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(100_000, 256, generator=generator)
        self.labels = torch.randint(0, 2, (100_000,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.features[index], self.labels[index]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loader = DataLoader(Rows(), batch_size=512, shuffle=True, num_workers=args.workers)

if __name__ == "__main__":
    began, cpu = time.perf_counter(), time.process_time()
    step = 0
    while step < args.steps:
        for features, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(features), labels)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)
            if step >= args.steps:
                break
    print(json.dumps({"steps": step, "seconds": time.perf_counter() - began, "cpu": time.process_time() - cpu}))
