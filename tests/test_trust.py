"""What a report says, checked against what the loop really did (issue: trust): new rules for
problems the catalog missed (a float64 model, files written inside the step, training
forwards whose graph no backward uses), the batch size
as the job set it, several optimizers told apart, and what could not be checked said as such.
Each loop is written the way public scripts write it; its ground truth is in the comments."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tuneup
from tests.conftest import busy_processes
from tuneup.diagnose.rules.code import FILE_WRITE_SHARE


def attach(run_dir, **options):
    """On a CPU taken as one without bf16 units unless said (amp-off is a hardware finding)."""
    return tuneup.attach(run_dir=str(run_dir), **{"interval": 0.05, "cpu_bf16": False, **options})


def rules(agent):
    return {f["rule"]: f for f in agent.findings()}


def test_a_model_trained_in_float64_is_found_and_amp_is_not_advised_for_it(run_dir):
    # Ground truth: a regression script that keeps NumPy's float64 (torch.from_numpy, .double()):
    # every parameter of the model is float64; 120 steps.
    torch.manual_seed(0)
    features = torch.from_numpy(np.random.default_rng(0).normal(size=(512, 64)))  # float64
    target = features.sum(dim=1, keepdim=True)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with attach(run_dir, cpu_bf16=True) as agent:  # a CPU with bf16 units: amp-off would apply to fp32
        for step in range(120):
            batch = slice(step % 16 * 32, step % 16 * 32 + 32)
            loss = nn.functional.mse_loss(model(features[batch]), target[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    found = rules(agent)  # after detach: evaluated on the whole run
    finding = found["float64-model"]
    assert "Sequential (8,449 float64 parameters) trains in float64" in finding["observed"]
    assert "model.float()" in finding["fix"] and finding["gain"] is not None
    assert "amp-off" not in found  # float32 first: autocast does not touch float64 layers


def test_files_written_inside_the_step_are_found_with_their_line(run_dir, tmp_path):
    # Ground truth: a loop that checkpoints its 4 MB model with torch.save on every step (line
    # marked below) and one that never writes: the first's writes are most of its step.
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 1024), torch.randn(8, 1)

    def train(checkpoint: bool) -> None:
        for _ in range(80):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if checkpoint:
                torch.save(model.state_dict(), tmp_path / "checkpoint.pt")  # the write

    with attach(run_dir / "writes") as writer:
        train(checkpoint=True)
    found, habits = rules(writer), writer.snapshot()["habits"]
    finding = found["file-writes-in-step"]
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# the write"))
    assert f"test_trust.py:{line} (torch.save)" in finding["observed"]
    assert habits["file_writes_per_step"] == 1.0  # one write on every watched step
    assert finding["gain"] >= FILE_WRITE_SHARE
    with attach(run_dir / "quiet") as quiet:
        train(checkpoint=False)
    assert "file-writes-in-step" not in rules(quiet)
    assert quiet.snapshot()["habits"]["file_writes"] == 0


def test_the_batch_size_is_the_loaders_and_two_optimizers_are_told_apart(run_dir):
    # Ground truth: a GAN-shaped loop; 100 samples in batches of 16 (the last of each epoch has
    # 4, so the mean per batch is 14.3); one Adam trains the generator, one the discriminator,
    # which steps first (numbered in the order they first step).
    generator, discriminator = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    g_opt = torch.optim.Adam(generator.parameters(), lr=2e-4)
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=2e-4)
    loader = DataLoader(TensorDataset(torch.randn(100, 8)), batch_size=16)
    with attach(run_dir) as agent:
        for _ in range(6):
            for (real,) in loader:
                fake = generator(torch.randn(len(real), 8))
                d_loss = discriminator(real).mean() - discriminator(fake.detach()).mean()
                d_opt.zero_grad()
                d_loss.backward()
                d_opt.step()
                g_loss = -discriminator(fake).mean()
                g_opt.zero_grad()
                g_loss.backward()
                g_opt.step()
        text = agent.report()
    assert "(batch 16)" in text
    assert "Optimizer 1: Adam (for-loop) for Sequential, 161 parameters" in text
    assert "Optimizer 2: Adam (for-loop) for Linear, 72 parameters" in text


def test_a_report_asked_for_while_attached_covers_every_step_closed_so_far(run_dir):
    """Ground truth from the loop: 30 optimizer steps of batches of 16, then the report, while
    attached, with the background thread's first tick a minute away (interval=60): the report
    reads what the background thread drained, so the steps must be drained for it. (In the full
    suite a busy machine once left a GAN loop's 42 steps undrained: "no optimizer.step() seen".)"""
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(480, 8)), batch_size=16)
    with attach(run_dir, interval=60.0) as agent:
        for (x,) in loader:
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        assert agent.ticker.ticks == 0  # the premise: nothing drained by the background thread
        document = agent.document()
        text = agent.report()
    assert "(batch 16)" in text and "no optimizer.step()" not in text
    steps = document["runs"][0]["snapshot"]["totals"]["steps"]
    assert steps >= 29, steps  # the 30th closes at the next fetch or at detach


def test_with_no_step_the_report_says_what_it_could_not_check(run_dir):
    # Ground truth: the script builds its model and stops before its first step.
    model = nn.Linear(4, 1)
    torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(run_dir) as agent:
        model(torch.randn(2, 4))
    line = next(line for line in agent.report("markdown").splitlines() if "could not be checked" in line)
    assert line.startswith("No findings: no training step was measured, so ")
    assert "rules could not be checked" in line and "checked the job's settings alone and passed" in line


@pytest.fixture
def two_busy_processes():
    """Two processes spinning on the CPU, as other jobs on a shared machine (this one has 2 cores)."""
    with busy_processes(2) as hogs:
        yield hogs


def test_a_machine_busy_with_other_work_is_said_so_and_the_idle_workers_are_not_blamed(run_dir, two_busy_processes):
    # Ground truth: the job sleeps 5 ms a step (its own CPU is low), its 2 loader workers hand
    # out ready tensors (idle); two other processes spin on the cores.
    cores = len(os.sched_getaffinity(0))
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1)), batch_size=8, num_workers=2,
                        persistent_workers=True)
    with attach(run_dir) as agent:
        for x, y in loader:
            time.sleep(0.005)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if agent.snapshot()["totals"]["steps"] >= 150:
                break
    host = agent.snapshot()["system"]["host"]
    found = rules(agent)
    if cores > 2:
        pytest.skip("two spinning processes keep only a 2-core machine busy")
    finding = found["cpu-oversubscribed"]
    assert finding["observed"].startswith("the machine is busy with other work")
    assert "set_num_threads" not in finding["fix"]
    assert finding["evidence"]["other_cores"] >= 0.5 and host["workers_cpu_ratio"] < 0.5


DCGAN = os.path.join(os.path.dirname(__file__), "programs", "dcgan_two_optimizers.py")


def run_dcgan(run_dir, *args):
    """tests/programs/dcgan_two_optimizers.py under `tuneup run`, every step a detail step (so
    every forward is watched and the count is exact); its findings and its last habits."""
    import json

    from tests.conftest import child_env

    env = child_env(TUNEUP_RUN_DIR=str(run_dir), TUNEUP_PORT="0", TUNEUP_DETAIL_EVERY="1", TUNEUP_CPU_BF16="0")
    job = subprocess.run([sys.executable, "-m", "tuneup", "run", DCGAN, "--workers", "0", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-2000:]
    report = subprocess.run([sys.executable, "-m", "tuneup", "report", str(run_dir), "--format", "json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    habits = [e["habits"] for e in events if "habits" in e][-1]
    return {f["rule"]: f for f in json.loads(report.stdout)["findings"]}, habits


def test_a_generator_sampled_without_no_grad_is_found_and_the_gan_step_itself_is_not(tmp_path):
    # Ground truth (the program's docstring): 6 epochs of 6 iterations, one step each (36);
    # every step runs netD 3 times and netG once, every graph used by a backward; with
    # --sample-every 2, iterations 0, 2 and 4 of each epoch also run netG(fixed_noise) in
    # train() mode with autograd on and only detach its output: 18 unused graphs, all netG's.
    found, habits = run_dcgan(tmp_path / "sampled", "--niter", "6", "--sample-every", "2")
    # Not watched: the first steps' forwards while tuneup finds the models (one step for netD,
    # then one for netG once its optimizer stepped) and those of the run's last step, which
    # is decided once a next step closed: 16 to 18 of the 18 samples, 4 x 33 of the rest at least.
    assert habits["unused_forward_models"] == {"Generator": habits["training_forwards_unused"]}
    assert 16 <= habits["training_forwards_unused"] <= 18
    assert habits["training_forwards_watched"] >= 33 * 4 + 16
    finding = found["unused-forward-graph"]
    assert "Generator" in finding["observed"] and "with torch.no_grad():" in finding["fix"]
    # The same GAN without sampling: every forward's graph is used (fake.detach() included).
    found, habits = run_dcgan(tmp_path / "plain", "--niter", "6")
    assert habits["training_forwards_unused"] == 0 and habits["training_forwards_watched"] >= 33 * 4
    assert "unused-forward-graph" not in found
