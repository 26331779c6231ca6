"""A hand-written Trainer class with callbacks, shaped like the small trainer frameworks people
write and copy (fit/train_epoch/validate methods, a callback list with on_batch_end and
on_epoch_end hooks, a logger callback and an early-stopping callback): a small CNN classifies
28x28 images generated per sample with CPU augmentation in the Dataset's __getitem__ (random
shift and noise), loaded by a DataLoader with 2 worker processes (persistent, pinned off: a
CPU job), SGD with momentum and a StepLR scheduler stepped each epoch.

Ground truth, from this source (seeded): 3 epochs of 40 batches (640 samples, batch 16, the
last batch dropped): 120 optimizer steps. Host reads: the logger reads `loss.item()` every 10
batches (READ-LOG, a read on some steps only); validation after each epoch (eval(), no_grad,
its reads its own: READ-VAL). Workers make the batches in parallel with the training (each
batch a few milliseconds of augmentation against a few milliseconds of step): whatever the
machine's load, a wait for batches is possible, most of it at each epoch's start
(persistent workers are started once, but the first batches of an epoch are still made while
the loop waits). Findings the truth calls for: none; allowed: data-stall (a real wait where
the machine is slow), cpu-oversubscribed about the machine.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Shapes(Dataset):
    """Images of one of 4 classes (a bright square in a class-given quadrant), shifted and noised."""

    def __init__(self, size, seed):
        self.size, self.seed = size, seed

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(self.seed * 100_000 + index)
        label = index % 4
        image = torch.zeros(1, 28, 28)
        row, col = 4 + 12 * (label // 2), 4 + 12 * (label % 2)
        image[:, row:row + 8, col:col + 8] = 1.0
        shift = torch.randint(-2, 3, (2,), generator=generator)
        image = torch.roll(image, shifts=(int(shift[0]), int(shift[1])), dims=(1, 2))
        for _ in range(4):  # augmentation: blur passes and noise, the per-sample CPU work
            image = F.avg_pool2d(F.pad(image, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
        image = image + 0.1 * torch.randn(image.shape, generator=generator)
        return image, label


class Callback:
    def on_batch_end(self, trainer, batch, loss):
        pass

    def on_epoch_end(self, trainer, epoch, val_loss):
        pass


class Logger(Callback):
    def __init__(self, every):
        self.every = every

    def on_batch_end(self, trainer, batch, loss):
        if (batch + 1) % self.every == 0:
            print(f"batch {batch + 1} loss {loss.item():.4f}")  # READ-LOG

    def on_epoch_end(self, trainer, epoch, val_loss):
        print(f"epoch {epoch} val_loss {val_loss:.4f}")


class EarlyStopping(Callback):
    def __init__(self, patience):
        self.patience, self.best, self.bad = patience, float("inf"), 0

    def on_epoch_end(self, trainer, epoch, val_loss):
        if val_loss < self.best:
            self.best, self.bad = val_loss, 0
        else:
            self.bad += 1
            trainer.stop = self.bad >= self.patience


class Trainer:
    def __init__(self, model, optimizer, scheduler, callbacks):
        self.model, self.optimizer, self.scheduler, self.callbacks = model, optimizer, scheduler, callbacks
        self.stop = False
        self.steps = 0

    def train_epoch(self, loader):
        self.model.train()
        for batch, (images, labels) in enumerate(loader):
            loss = F.cross_entropy(self.model(images), labels)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.steps += 1
            for callback in self.callbacks:
                callback.on_batch_end(self, batch, loss)

    @torch.no_grad()
    def validate(self, loader):
        self.model.eval()
        total = 0.0
        for images, labels in loader:
            total += F.cross_entropy(self.model(images), labels).item()  # READ-VAL
        return total / len(loader)

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.train_epoch(train_loader)
            self.scheduler.step()
            val_loss = self.validate(val_loader)
            for callback in self.callbacks:
                callback.on_epoch_end(self, epoch, val_loss)
            if self.stop:
                break


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                          nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 7 * 7, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    train_loader = DataLoader(Shapes(650, seed=1), batch_size=16, shuffle=True, num_workers=2,
                              persistent_workers=True, drop_last=True)
    val_loader = DataLoader(Shapes(64, seed=2), batch_size=32)
    trainer = Trainer(model, optimizer, scheduler, [Logger(every=10), EarlyStopping(patience=2)])
    trainer.fit(train_loader, val_loader, epochs=3)
    print(f"steps {trainer.steps}")


if __name__ == "__main__":
    main()
