"""An image classifier reading its samples from network storage: each sample is fetched (a
0.4 ms wait on the storage, the thread asleep, as a real read's is), then decoded and
normalized on the CPU; a small CNN, SGD with momentum; `DataLoader(shuffle=True)` with its own
generator; `--workers` workers (default 0).

Ground truth, from this source: each step reads 32 samples in the main process (workers=0):
13 ms asleep on the storage, a decode of a 3x32x32 image each (a seeded draw, a crop, a
normalization), then a forward/backward of a small CNN on the batch. Workers overlap the
reads with the step without needing a core for them, however busy the machine is.
Prints one JSON line: steps, training wall seconds, process CPU seconds."""

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--workers", type=int, default=0)
args = parser.parse_args()

READ_SECONDS = 0.0004


class RemoteImages(Dataset):
    def __len__(self):
        return 50_000

    def __getitem__(self, index):
        time.sleep(READ_SECONDS)  # the storage's answer
        generator = torch.Generator().manual_seed(index)  # the "decoded file"
        image = torch.randint(0, 256, (3, 36, 36), generator=generator, dtype=torch.uint8).float() / 255
        image = image[:, 2:34, 2:34]
        image = (image - 0.5) / 0.25
        return image, index % 10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = DataLoader(RemoteImages(), batch_size=32, shuffle=True, num_workers=args.workers,
                    generator=torch.Generator().manual_seed(0))

if __name__ == "__main__":
    began, cpu = time.perf_counter(), time.process_time()
    step = 0
    while step < args.steps:
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)
            if step >= args.steps:
                break
    print(json.dumps({"steps": step, "seconds": time.perf_counter() - began, "cpu": time.process_time() - cpu}))
