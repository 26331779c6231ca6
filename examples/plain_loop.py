"""A plain PyTorch loop with tuneup attached in one line (CPU, ~15 s).

    python examples/plain_loop.py [--steps 300] [--workers 0] [--run-dir DIR]

The DataLoader decodes its images slowly in the main process (num_workers=0): tuneup's
report ranks the data stall first, with the measured wait and the fix. Try --workers 2.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup


class SlowImages(Dataset):
    """Images that take ~1 ms each to 'decode', as JPEGs from a slow disk would."""

    def __len__(self):
        return 2048

    def __getitem__(self, index):
        time.sleep(0.001)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, 32, 32, generator=generator), index % 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()

    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(SlowImages(), batch_size=16, shuffle=True, num_workers=args.workers)

    agent = tuneup.attach(run_dir=args.run_dir)  # the one line
    step = 0
    while step < args.steps:
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    agent.detach()
    print(agent.report())


if __name__ == "__main__":
    main()
