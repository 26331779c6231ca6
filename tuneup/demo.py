"""`tuneup demo`: a small image classifier with the bottlenecks real jobs have.

- The dataset decodes each sample slowly (a stand-in for JPEG decode from network storage)
  and the DataLoader runs with num_workers=0, so the GPU/CPU waits for data.
- The loop reads values back to the host three times per step (`.item()` for the running
  loss, the accuracy and the gradient norm): each one is a host-device sync on a GPU.
- A few records were written without normalization (values near 1e36): the scaled loss
  and gradients overflow (on some the loss itself does), so GradScaler skips those steps.

This module is user code as far as tuneup's advice is concerned (it points at its lines).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch import nn

HOST_READS = 3  # .item() calls per step in train()
from torch.utils.data import DataLoader, Dataset

IMAGE = (3, 24, 24)
CLASSES = 10
CORRUPT_EVERY = 701  # one record in 701 was stored unnormalized


class SlowImages(Dataset):
    """Synthetic labelled images; every sample costs `decode_seconds` to produce."""

    def __init__(self, size: int = 8192, decode_seconds: float = 0.0004) -> None:
        self.size = size
        self.decode_seconds = decode_seconds

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        deadline = time.perf_counter() + self.decode_seconds
        generator = torch.Generator().manual_seed(index)
        label = index % CLASSES
        image = torch.randn(IMAGE, generator=generator)
        image[label % 3] += 0.1 + 0.4 * label / CLASSES  # learnable, slowly: the class tints a channel
        if index % CORRUPT_EVERY == CORRUPT_EVERY - 1:
            image = image * 1e36  # a record written without normalization
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # waiting on storage: releases the GIL, like real I/O
        return image, label


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 30, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(30, 60, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(60, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def train(
    steps: int = 400,
    *,
    num_workers: int = 0,
    batch_size: int = 32,
    decode_seconds: float = 0.0004,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """Run the demo job for `steps` optimizer steps; returns the loop's own view."""
    torch.manual_seed(0)
    model = SmallConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=50)
    loader = DataLoader(
        SlowImages(decode_seconds=decode_seconds),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),
    )
    loss_fn = nn.CrossEntropyLoss()
    running_loss = 0.0
    step = 0
    started = time.perf_counter()
    while step < steps:
        for images, labels in loader:
            optimizer.zero_grad()
            logits = model(images)
            loss = loss_fn(logits, labels)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e38)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            # The habits that cost a sync per call on a GPU:
            value = loss.item()
            if math.isfinite(value) and value < 1e6:
                running_loss = 0.9 * running_loss + 0.1 * value if step > 1 else value
            accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
            norm = grad_norm.item()
            if progress is not None:
                progress(step, running_loss)
            if step >= steps:
                break
    return {
        "steps": step,
        "seconds": time.perf_counter() - started,
        "loss": running_loss,
        "accuracy": accuracy,
        "grad_norm": norm,
    }
