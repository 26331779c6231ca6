"""A training script shaped like the public examples (argparse, a Dataset class, a model
class, the usual loop), that fails on purpose where it is told to: in the model's forward,
in a backward (a custom autograd Function), or in the Dataset; with --interrupt it waits
there instead, for a Ctrl-C (SIGINT to its process group), after creating --marker.

Ground truth: `python failing_train.py ...` prints the traceback it prints; `tuneup run` and
`tuneup.attach()` (--attach) must not change a character of it."""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

parser = argparse.ArgumentParser()
parser.add_argument("--fail", choices=("forward", "backward", "dataset"), required=True)
parser.add_argument("--at", type=int, default=0, help="the step (the batch) that fails")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--interrupt", action="store_true", help="wait there for SIGINT instead of raising")
parser.add_argument("--marker", default="", help="created once the script waits there")
parser.add_argument("--attach", action="store_true", help="tuneup.attach() in the script itself")
parser.add_argument("--closure", action="store_true", help="forward and backward in a closure optimizer.step() calls")
args = parser.parse_args()

if args.attach:
    import tuneup

    tuneup.attach()

BATCH = 8


def trouble(what):
    if args.interrupt:
        Path(args.marker).touch()
        time.sleep(120)  # a Ctrl-C lands here
    raise RuntimeError(f"{what} failed")


class Digits(Dataset):
    def __len__(self):
        return 64 * BATCH

    def __getitem__(self, index):
        if args.fail == "dataset" and index == args.at * BATCH:
            if get_worker_info() is not None and not args.interrupt:
                # The batch before it, from the other worker, arrives first: torch re-raises a
                # worker's error from one of two lines, by whether its batch came in order
                # (torch/utils/data/dataloader.py _next_data), and a traceback of either is
                # the script's own.
                time.sleep(1.0)
            trouble("reading a sample")
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=generator), index % 4


class Clip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-3, 3)

    @staticmethod
    def backward(ctx, grad):
        if Clip.failing:
            trouble("the backward")
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x, step):
        x = F.relu(self.fc1(x))
        if args.fail == "forward" and step == args.at:
            trouble("the forward")
        return self.fc2(x)


def main():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Digits(), batch_size=BATCH, num_workers=args.workers)
    for step, (data, target) in enumerate(loader):
        if args.closure:  # Lightning's automatic optimization, LBFGS
            def closure():
                optimizer.zero_grad()
                output = model(data, step)
                Clip.failing = args.fail == "backward" and step == args.at
                loss = F.cross_entropy(Clip.apply(output), target)
                loss.backward()
                return loss

            optimizer.step(closure)
            continue
        optimizer.zero_grad()
        output = model(data, step)
        Clip.failing = args.fail == "backward" and step == args.at
        loss = F.cross_entropy(Clip.apply(output), target)
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
