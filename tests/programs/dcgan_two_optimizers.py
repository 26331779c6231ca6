"""A GAN trained the way pytorch/examples' dcgan/main.py trains one: a DataLoader with
worker processes; per iteration netD.zero_grad(), D on real then on fake.detach(), two
backwards, optimizerD.step(); then netG.zero_grad(), D on fake, backward,
optimizerG.step(); five host reads per iteration (`output.mean().item()` three times,
`errD.item()` and `errG.item()` in the progress line). The images are random tensors of
8x8 (nothing is downloaded) and the networks small convolutions.

Ground truth, from this source (defaults: 2 epochs of 96 images, batch 16, 2 workers):
- steps: 12 (6 iterations per epoch; one iteration steps both optimizers: one step);
- host reads: 5 per step, on the lines marked READ-DX, READ-DGZ1, READ-DGZ2 and READ-PRINT
  (two on that one);
- forward passes: 3 per step (D real, D fake, D on fake for G) plus G once; backward: 3;
- input: a TensorDataset in memory behind 2 workers: no stall expected;
- every graph a forward records is used by a backward: fake's by errG.backward() (D on
  fake.detach() records a graph of its own, used by errD_fake.backward()). With
  --sample-every N, iterations i = 0, N, 2N ... of each epoch also run netG(fixed_noise) as
  dcgan/main.py does for its sample images (there every 100): netG in train() mode, autograd
  on, the output only detached: ceil(6 / N) graphs per epoch that no backward uses.
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--batchSize", type=int, default=16)
parser.add_argument("--niter", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--sample-every", type=int, default=0, help="sample netG(fixed_noise) every N iterations")
opt = parser.parse_args()

torch.manual_seed(999)
torch.set_num_threads(1)
nz, ngf, ndf = 8, 8, 8
dataset = TensorDataset(torch.rand(96, 1, 8, 8) * 2 - 1, torch.zeros(96))
dataloader = DataLoader(dataset, batch_size=opt.batchSize, shuffle=True, num_workers=opt.workers,
                        generator=torch.Generator().manual_seed(0))


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, 1, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


netG, netD = Generator(), Discriminator()
criterion = nn.BCELoss()
fixed_noise = torch.randn(opt.batchSize, nz, 1, 1)
real_label, fake_label = 1, 0
optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

steps = 0
samples = []
for epoch in range(opt.niter):
    for i, data in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()  # READ-DX
        noise = torch.randn(batch_size, nz, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()  # READ-DGZ1
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()  # READ-DGZ2
        optimizerG.step()
        if opt.sample_every and i % opt.sample_every == 0:
            fake = netG(fixed_noise)  # as dcgan/main.py samples: train() mode, autograd on, no backward
            samples.append(fake.detach())
        steps += 1
        print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
              % (epoch, opt.niter, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))  # READ-PRINT
print(f"steps {steps}")
