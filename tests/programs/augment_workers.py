"""A small image classifier written as the CIFAR tutorials write it: a Dataset whose
`__getitem__` makes and augments each sample on the CPU (crop, flip, a 5x5 blur), a DataLoader
with `num_workers=2` and the other settings left as they are (persistent_workers=False), a
small CNN, SGD, whole epochs.

Ground truth, from this source: the dataset holds 128 samples, batches of 16: 8 steps an
epoch, each epoch forking two new workers that augment every sample and exit at its end (the
loader waits for them: `_shutdown_workers`). Every child process of this script is one of
those workers; the kernel adds each one's CPU time to the script's children's once it is
waited for, so `resource.getrusage(RUSAGE_CHILDREN)` over the loop, all epochs whole, is all
the work the workers did. Prints one JSON line: steps, epochs, the loop's wall seconds and
the workers' CPU seconds."""

import argparse
import json
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=40)
args = parser.parse_args()


class Augmented(Dataset):
    def __len__(self):
        return 128

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        image = torch.rand(3, 96, 96, generator=generator)
        top, left = torch.randint(0, 32, (2,)).tolist()
        image = image[:, top:top + 64, left:left + 64]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        for _ in range(6):  # the heavy part of the augmentation, as a blur or a colour jitter is
            image = F.conv2d(image.unsqueeze(1), torch.full((1, 1, 5, 5), 1 / 25), padding=2).squeeze(1)
        return image, index % 10


torch.set_num_threads(1)
model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Augmented(), batch_size=16, shuffle=True, num_workers=2)


def children_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


steps = 0
began, spent = time.perf_counter(), children_seconds()
for epoch in range(args.epochs):
    for images, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        steps += 1
seconds = time.perf_counter() - began
print(json.dumps({"steps": steps, "epochs": args.epochs, "seconds": seconds,
                  "workers_cpu_seconds": children_seconds() - spent}))
