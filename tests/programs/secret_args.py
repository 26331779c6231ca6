"""A training script started the way people start them, with a credential on its command line:

    python train.py --secs 8 --api-key=SECRET123 --token SECRET456 --data https://user:SECRET789@example.com/x

It takes whatever options it is given (parse_known_args), trains a small MLP from a DataLoader
for --secs seconds, and prints "done <steps>" at the end.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--secs", type=float, default=8.0)
args, _ = parser.parse_known_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(512, 16), torch.randn(512, 1)), batch_size=16, shuffle=True)
steps = 0
end = time.monotonic() + args.secs
while time.monotonic() < end:
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        steps += 1
        time.sleep(0.002)
        if time.monotonic() >= end:
            break
print(f"done {steps}")
