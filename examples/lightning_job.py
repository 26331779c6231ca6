"""A PyTorch Lightning job with tuneup (CPU, ~20 s): `pip install tuneup[lightning]`.

    python examples/lightning_job.py [--steps 300] [--workers 0] [--run-dir DIR] [--gpu]

--gpu trains on CUDA with precision="16-mixed" (autocast + Lightning's GradScaler).

`tuneup.attach(trainer)` gives the Trainer tuneup's callback: when training starts it measures
the LightningModule, its optimizer and its training DataLoader (the validation loader is left
out) and records the trainer's precision and accumulation. Same slow loader as
plain_loop.py, so the report ranks the same data stall first.
"""

import argparse
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup


class SlowImages(Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        time.sleep(0.001)  # a slow decode
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, 32, 32, generator=generator), index % 10


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                 nn.Linear(256, 10))

    def training_step(self, batch, _):
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    def validation_step(self, batch, _):
        images, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(images), labels))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--gpu", action="store_true", help="CUDA with 16-bit mixed precision")
    args = parser.parse_args()

    train = DataLoader(SlowImages(2048), batch_size=16, shuffle=True, num_workers=args.workers)
    val = DataLoader(SlowImages(64), batch_size=16, num_workers=args.workers)
    device = {"accelerator": "gpu", "precision": "16-mixed"} if args.gpu else {"accelerator": "cpu"}
    trainer = L.Trainer(max_steps=args.steps, devices=1, logger=False, **device,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        val_check_interval=100)
    agent = tuneup.attach(trainer, run_dir=args.run_dir)
    trainer.fit(Classifier(), train, val)
    agent.detach()
    print(agent.report())


if __name__ == "__main__":
    main()
