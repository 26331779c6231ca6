"""A Lightning job as Lightning's docs write one, with no tuneup in it: a LightningModule with
training_step, validation_step and configure_optimizers, a training loader and a validation
loader, `Trainer(max_steps=..., val_check_interval=...)`, `trainer.fit(...)`, and code after
the fit (a parameter digest: host reads).

Ground truth from the code: 120 training steps; the training loader holds tensors (no wait of
its own); a validation every 30 steps (4 in all) of 4 batches from a loader that sleeps 2 ms a
sample (16 a batch: at least 128 ms a validation); after fit, one .item() per parameter (4).
Prints the digest and, with --attach, attaches as `tuneup.attach(trainer)`.
"""

import argparse
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--attach", action="store_true")
parser.add_argument("--run-dir")
args = parser.parse_args()
warnings.filterwarnings("ignore")


class SlowValidation(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        time.sleep(0.002)  # a decoded sample
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=generator), torch.randn(1, generator=generator)


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
train = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
model = Regressor()
trainer = L.Trainer(max_steps=120, val_check_interval=30, limit_val_batches=4, num_sanity_val_steps=0,
                    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
if args.attach:
    import tuneup

    tuneup.attach(trainer, run_dir=args.run_dir)
trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(SlowValidation(), batch_size=16))
digest = [round(p.sum().item(), 6) for p in model.parameters()]
print("digest", digest)
