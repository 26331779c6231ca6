"""Sine-wave sequence prediction with LBFGS, shaped like pytorch/examples'
time_sequence_prediction/train.py: an LSTMCell model stepped through time in Python, a
closure that zeroes the gradients, runs the model, prints `loss.item()` and calls backward,
`optimizer.step(closure)`, then a no_grad prediction with its own `loss.item()`.

Ground truth, from this source (defaults: 6 steps): steps: 6, one per `optimizer.step(closure)`;
the closure runs several times inside each step (LBFGS re-evaluates the model: the script
prints the total, `closure passes N`); host reads: one per closure pass (READ-CLOSURE, inside
the optimizer's step) and one per step in the prediction (READ-TEST); input: tensors built
once before the loop: no stall.
"""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
opt = parser.parse_args()


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 16)
        self.linear = nn.Linear(16, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 16, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 16, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            output = self.linear(h_t)
            outputs += [output]
        for i in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            output = self.linear(h_t)
            outputs += [output]
        return torch.cat(outputs, dim=1)


np.random.seed(2)
torch.manual_seed(0)
torch.set_num_threads(1)
T, L, N = 20, 40, 12
x = np.empty((N, L), "int64")
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype("float64")
input = torch.from_numpy(data[3:, :-1])
target = torch.from_numpy(data[3:, 1:])
test_input = torch.from_numpy(data[:3, :-1])
test_target = torch.from_numpy(data[:3, 1:])

seq = Sequence().double()
criterion = nn.MSELoss()
optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=5)
passes = 0
for i in range(opt.steps):
    print("STEP: ", i)

    def closure():
        global passes
        passes += 1
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        print("loss:", loss.item())  # READ-CLOSURE
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        future = 10
        pred = seq(test_input, future=future)
        loss = criterion(pred[:, :-future], test_target)
        print("test loss:", loss.item())  # READ-TEST
print(f"closure passes {passes}")
