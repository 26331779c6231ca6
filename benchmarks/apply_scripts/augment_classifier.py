"""An image classifier with CPU augmentation in the Dataset, shaped like the CIFAR/ImageNet
tutorials: each sample is decoded (here: made from its index), randomly cropped, flipped,
jittered and normalized in `__getitem__` with torch ops drawing from torch's global RNG (as
torchvision's transforms do); a small CNN, SGD with momentum; `DataLoader(shuffle=True)` with
its own generator, as reproducible scripts write it; `--workers` workers (default 0).

Ground truth, from this source: each step loads 32 samples in the main process (workers=0):
an 80x80 image made, cropped to 64, resized to 28, flipped, jittered, blurred (5x5) and
normalized, then a forward/backward of a small CNN on the batch.
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


class Images(Dataset):
    def __len__(self):
        return 50_000

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)  # the "decoded file"
        image = torch.randint(0, 256, (3, 80, 80), generator=generator, dtype=torch.uint8).float() / 255
        top, left = torch.randint(0, 17, (2,)).tolist()  # random crop
        image = image[:, top:top + 64, left:left + 64]
        image = F.interpolate(image[None], size=28, mode="bilinear", align_corners=False)[0]
        if torch.rand(()) < 0.5:  # random horizontal flip
            image = image.flip(-1)
        image = image * (0.8 + 0.4 * torch.rand(3, 1, 1))  # colour jitter
        sigma = 0.1 + 1.9 * torch.rand(())  # random Gaussian blur, 5x5, per channel
        taps = torch.exp(-(torch.arange(5.0) - 2) ** 2 / (2 * sigma ** 2))
        kernel = (taps[:, None] * taps[None, :] / taps.sum() ** 2).expand(3, 1, 5, 5)
        image = F.conv2d(image[None], kernel, padding=2, groups=3)[0]
        image = (image - 0.5) / 0.25
        return image, index % 10


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                      nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = DataLoader(Images(), batch_size=32, shuffle=True, num_workers=args.workers,
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
