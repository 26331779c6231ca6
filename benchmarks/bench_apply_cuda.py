"""Apply mode on real CUDA jobs: a small conv net and a small transformer, each written the
way a first version usually is (fp32, cudnn.benchmark off, a DataLoader with num_workers=0
and pageable memory). Prints every change apply mode tried, its decision and the measured
speed-up, and the throughput with no tuneup against the last steps under apply mode.

    python benchmarks/bench_apply_cuda.py [--steps 1500]

Needs a CUDA GPU (tests/test_apply_cuda.py runs the same jobs, marked `gpu`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402

DEVICE = "cuda"


class Images(Dataset):
    """Synthetic labelled images made on the CPU per sample, as a decoder would."""

    def __len__(self) -> int:
        return 50_000

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, 64, 64, generator=generator), index % 10


class Tokens(Dataset):
    def __len__(self) -> int:
        return 50_000

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, 8192, (129,), generator=generator)
        return tokens[:-1], tokens[1:]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers, width = [], 3
        for out in (64, 128, 256, 256):
            layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(256, 10)

    def forward(self, images):
        return self.head(self.features(images).mean((2, 3)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8192, 512)
        layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 6)
        self.head = nn.Linear(512, 8192)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


JOBS = {
    "conv net": (ConvNet, Images, 128, lambda logits, y: nn.functional.cross_entropy(logits, y)),
    "transformer": (TinyLM, Tokens, 32,
                    lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())),
}


def run_job(name: str, steps: int, mode: str | None, run_dir: Path | None = None, on_step=None):
    """Train job `name` for `steps` steps; returns (step end times, apply records, model)."""
    model_class, data_class, batch, loss_fn = JOBS[name]
    torch.manual_seed(0)
    model = model_class().to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(data_class(), batch_size=batch, shuffle=True)
    agent = tuneup.attach(mode=mode, run_dir=run_dir, interval=0.5) if mode else None
    ends: list[float] = []
    try:
        while len(ends) < steps:
            for x, y in loader:
                x, y = x.to(DEVICE), y.to(DEVICE)
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                if on_step is not None:
                    loss = on_step(len(ends) + 1, loss, model, agent)
                loss.backward()
                optimizer.step()
                ends.append(time.perf_counter())
                if len(ends) >= steps:
                    break
    finally:
        torch.cuda.synchronize()
        if agent is not None:
            agent.detach()
    return ends, (agent.actions() if agent is not None else []), model


def rate(ends: list[float], last: int) -> float:
    return last / (ends[-1] - ends[-last - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in JOBS:
            plain, _, _ = run_job(name, args.steps, None)
            applied, records, model = run_job(name, args.steps, "apply", Path(scratch) / name.replace(" ", "-"))
            last = min(300, args.steps // 4)
            print(f"\n{name}: no tuneup {rate(plain, last):.1f} steps/s; apply mode, last {last} steps: "
                  f"{rate(applied, last):.1f} steps/s ({rate(applied, last) / rate(plain, last):.2f}x); "
                  f"parameters finite: {all(torch.isfinite(p).all() for p in model.parameters())}")
            for record in records:
                base, trial = record.get("baseline") or {}, record.get("trial") or {}
                timing = (f"step {base['step_seconds'] * 1e3:.2f} -> {trial['step_seconds'] * 1e3:.2f} ms, "
                          if base.get("step_seconds") and trial.get("step_seconds") else "")
                print(f"  {record['action']:<16} {record['decision']:<15} {record.get('change', '')}: {timing}"
                      f"{record['reason']}")


if __name__ == "__main__":
    main()
