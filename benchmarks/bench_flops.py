"""What counting a step's FLOPs costs (measure/flops.py), against the step it counts.

    python benchmarks/bench_flops.py [--rounds 7]

The count runs once per input shape, at a step close on the training thread: one forward and
backward of the model on meta tensors under torch's FlopCounterMode (no data, no arithmetic:
Python dispatch only). For three models (an MLP, a conv net, a 6-block transformer) this
prints, over interleaved rounds, the median of the plain training step (SGD, one intra-op
thread) and the median of one count, their ratio, and the count's FLOPs. On ordinary steps
nothing of the count runs (it is scheduled at the recorder's lifecycle closes, every 64 steps,
and after the first count only every RECHECK_STEPS): bench_instructions.py measures the
per-step path, which this change does not touch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tuneup.measure.flops import FlopCount  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(mixed.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, blocks: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def workloads() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "MLP 1024-wide, batch 256": (nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                                   nn.Linear(1024, 10)),
                                     torch.randn(256, 256), torch.randint(0, 10, (256,))),
        "conv net, batch 32 of 3x32x32": (nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                                                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)),
                                          torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))),
        "transformer 6x128, 8 x 128 tokens": (Transformer(), torch.randint(0, 512, (8, 128)),
                                              torch.randint(0, 512, (8 * 128,))),
    }


class Probe:
    on = True  # the model probe the count turns off while it runs


def step_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    began = time.perf_counter()
    optimizer.zero_grad()
    out = model(x)
    nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y).backward()
    optimizer.step()
    return time.perf_counter() - began


def count_seconds(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    counter = FlopCount(Probe())
    meta = torch.empty_like(x, device="meta")
    began = time.perf_counter()
    found = counter._count(model, (meta,), {})
    return time.perf_counter() - began, found["flops"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 intra-op thread, {args.rounds} interleaved rounds (medians)")
    print(f"{'model':<36} {'step':>9} {'count':>9} {'count/step':>10} {'FLOPs counted':>14}")
    for name, (model, x, y) in workloads().items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):  # warm-up: first calls, allocator, dispatch caches
            step_seconds(model, x, y, optimizer)
            count_seconds(model, x)
        steps, counts, flops = [], [], 0.0
        for _ in range(args.rounds):
            steps.append(statistics.median(step_seconds(model, x, y, optimizer) for _ in range(5)))
            seconds, flops = count_seconds(model, x)
            counts.append(seconds)
        step, count = statistics.median(steps), statistics.median(counts)
        print(f"{name:<36} {step * 1e3:>7.2f}ms {count * 1e3:>7.2f}ms {count / step:>9.2f}x {flops:>14,.0f}")


if __name__ == "__main__":
    main()
