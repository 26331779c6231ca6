"""REINFORCE on a cart-pole, shaped like pytorch/examples' reinforcement_learning/reinforce.py:
a two-layer policy with dropout, `select_action` sampling a Categorical and returning
`action.item()` for the environment, the episode's discounted returns normalized, one Adam
step per episode on `-log_prob * return`, a running reward printed every 10 episodes. The
environment is the classic cart-pole written out (gym's equations, Euler steps), so nothing
is downloaded.

Ground truth, from this source (seeded): one optimizer step per episode, 60 episodes: 60
steps. Three host reads per environment step, so a variable number per step (as many as the
episode lasts): `action.item()` (READ-ACTION), and two inside torch.distributions, which
validates by default: `Categorical(probs)` checks that probs lie on the simplex and
`log_prob(action)` that the action is in the support, each ending in `if not
torch._is_all_true(valid): raise` (Distribution.__init__ and _validate_sample,
torch/distributions/distribution.py): a read of the device's answer each (READ-VALIDATE,
READ-SAMPLE; a sync apiece on a GPU, gone with validate_args=False). No DataLoader (the batch is the episode). The policy-gradient loss is a sum of
`-log_prob x normalized return`: it sits near zero and changes sign from episode to episode;
the gradient norm moves with it, never an order of magnitude (computed after each
backward in a copy of this script: 5.5 to 37, under 7x apart; the loss changed sign 33 times
in 60 episodes). No scheduler: Adam at a constant
1e-2, as the original. Findings the truth calls for: host-syncs (a read per action, the
original's own pattern); allowed: no-lr-schedule (a constant rate, deliberate here).
"""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical

GAMMA = 0.99
torch.manual_seed(543)
torch.set_num_threads(1)
rng = np.random.default_rng(543)


class CartPole:
    """gym's CartPole-v1 dynamics: reward 1 a step until the pole falls or 500 steps."""

    def reset(self):
        self.state = rng.uniform(-0.05, 0.05, size=4)
        self.steps = 0
        return self.state.astype(np.float32)

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = np.array([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                               theta_dot + 0.02 * theta_acc])
        self.steps += 1
        done = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 0.2095 or self.steps >= 500
        return self.state.astype(np.float32), 1.0, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


policy = Policy()
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
eps = np.finfo(np.float32).eps.item()
env = CartPole()


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0)
    probs = policy(state)
    m = Categorical(probs)  # READ-VALIDATE
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))  # READ-SAMPLE
    return action.item()  # READ-ACTION


def finish_episode():
    R = 0
    policy_loss = []
    returns = []
    for r in policy.rewards[::-1]:
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for log_prob, R in zip(policy.saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]


running_reward = 10
for i_episode in range(1, 61):
    state, ep_reward = env.reset(), 0
    for t in range(1, 500):
        action = select_action(state)
        state, reward, done = env.step(action)
        policy.rewards.append(reward)
        ep_reward += reward
        if done:
            break
    running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
    finish_episode()
    if i_episode % 10 == 0:
        print(f"Episode {i_episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}")
print(f"episodes {i_episode}")
