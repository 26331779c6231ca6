"""The CUDA paths: real syncs counted, none added, device values read asynchronously.

Run on a GPU machine: `python -m pytest -m gpu`. Skipped where CUDA is absent.
"""

from __future__ import annotations

import inspect
import re
import time

import pytest
import torch
from torch import nn

import tuneup
from tuneup.measure.device_values import DeviceValues

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
READ_MARKS = ("# one real sync per step", "# and another")  # the lines test_real_syncs_... reads on


def cuda_job(hidden: int = 256):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(DEVICE)
    x = torch.randn(128, 64, device=DEVICE)
    y = torch.randn(128, 1, device=DEVICE)
    return model, x, y


def settle(agent) -> None:
    """Let in-flight async reads land (the test may sync; the agent never does)."""
    torch.cuda.synchronize()
    agent.recorder.values.poll()


def test_device_values_are_read_without_a_sync():
    values = DeviceValues()
    got = []
    tensor = torch.tensor(3.5, device=DEVICE)
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        values.read(tensor, got.append)
        values.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    values.poll()
    assert got == [3.5]


def test_the_agent_adds_no_sync_to_a_cuda_loop(run_dir):
    model, x, y = cuda_job()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # fused: GradScaler never syncs
    scaler = torch.amp.GradScaler(DEVICE)
    with tuneup.attach(run_dir=run_dir, sync_sample_every=0, detail_every=1, interval=0.05) as agent:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(50):
                optimizer.zero_grad()
                with torch.autocast(DEVICE, dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        time.sleep(0.2)  # background sampling (NVML, allocator) ran meanwhile
        settle(agent)
    snapshot = agent.snapshot()
    assert snapshot["totals"]["steps"] == 50
    assert snapshot["totals"]["losses_read"] >= 45  # read asynchronously, none lost to a sync
    assert snapshot["scaler"]["scale"] is not None
    assert snapshot["window"]["gpu_seconds"]["median"] > 0
    assert snapshot["warnings"] == []


def test_real_syncs_are_counted_at_their_source_line(run_dir):
    model, x, y = cuda_job()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
        for _ in range(30):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()  # one real sync per step
            _ = (loss > 0).item()  # and another
    syncs = agent.snapshot()["syncs"]
    assert syncs["backend"] == "cuda"
    assert syncs["per_step"] == 2
    lines = {source["location"].rsplit(":", 1)[1] for source in syncs["top_sources"]}
    source_lines, first = inspect.getsourcelines(test_real_syncs_are_counted_at_their_source_line)
    expected = {str(first + i) for i, line in enumerate(source_lines) if line.rstrip().endswith(READ_MARKS)}
    assert expected <= lines
    assert torch.cuda.get_sync_debug_mode() == 0  # switched back after every sampled step


@pytest.mark.parametrize("fused", [False, True], ids=["skip-by-not-stepping", "fused-found-inf"])
def test_grad_scaler_skips_are_exact_on_cuda(run_dir, fused):
    model, x, y = cuda_job()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=5)
    overflow = {4, 9, 10, 30}
    with tuneup.attach(run_dir=run_dir) as agent:
        for step in range(1, 41):
            optimizer.zero_grad()
            with torch.autocast(DEVICE, dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if step in overflow:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        settle(agent)
    summary = agent.snapshot()["scaler"]
    assert summary["skipped_steps"] == len(overflow)
    assert summary["backoff_events"] == len(overflow)
    assert summary["scale"] == scaler.get_scale()


def test_allocator_and_nvml_on_a_real_gpu(run_dir):
    model, x, y = cuda_job(hidden=4096)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tuneup.attach(run_dir=run_dir, interval=0.05) as agent:
        for _ in range(20):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        time.sleep(0.2)
    system = agent.snapshot()["system"]
    (device,) = system["memory"]["devices"]
    assert device["allocated_bytes"] > 4096 * 64 * 4
    assert device["total_bytes"] > device["reserved_bytes"] > 0
    assert system["gpu"]["available"] is True
    assert system["gpu"]["samples"][0]["memory_total_bytes"] > 0


def test_advise_mode_keeps_cuda_numerics_bit_identical(run_dir):
    def run(with_agent: bool):
        model, x, y = cuda_job()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []

        def loop():
            for _ in range(20):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())

        if with_agent:
            with tuneup.attach(run_dir=run_dir, sync_sample_every=1):
                loop()
        else:
            loop()
        return losses

    first, second = run(False), run(False)
    if first != second:
        pytest.skip("this GPU's kernels are not deterministic run to run")
    assert run(True) == first


class _StarvingBatches(torch.utils.data.Dataset):
    """Each batch takes 30 ms to make on the host: the GPU idles between steps."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, index: int):
        time.sleep(0.03)
        return torch.randn(128, 64), torch.randn(128, 1)


def test_gpu_time_excludes_the_wait_for_data(run_dir):
    # Ground truth: 30 steps, each waiting 30 ms for a batch; the step's GPU work (a small MLP
    # on 128 rows) takes well under a millisecond. GPU time per step must not hold the wait.
    model, _, _ = cuda_job()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_StarvingBatches(), batch_size=None)
    with tuneup.attach(run_dir=run_dir, detail_every=1) as agent:
        for x, y in loader:
            x, y = x.to(DEVICE), y.to(DEVICE)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        settle(agent)
    snapshot = agent.snapshot()
    window = snapshot["window"]
    assert window["step_seconds"]["median"] >= 0.03
    assert window["gpu_seconds"]["median"] < 0.01  # was ≈ the whole step while the end event followed the wait
    from tuneup.report.summary import gpu_work_line

    assert gpu_work_line(snapshot).startswith("GPU work: the step's kernels span ")  # in every report format


def test_explicit_synchronize_calls_are_counted(run_dir):
    model, x, y = cuda_job()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    stream = torch.cuda.current_stream()
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
        for _ in range(30):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            torch.cuda.synchronize()  # sync: device
            done = torch.cuda.Event()
            done.record()
            done.synchronize()  # sync: event
            stream.synchronize()  # sync: stream
    syncs = agent.snapshot()["syncs"]
    assert syncs["per_step"] == 3
    assert set(syncs["by_kind"]) == {"cuda.synchronize", "Event.synchronize", "Stream.synchronize"}
    source_lines, first = inspect.getsourcelines(test_explicit_synchronize_calls_are_counted)
    expected = {str(first + i) for i, line in enumerate(source_lines) if re.search(r"# sync: \w+$", line.rstrip())}
    assert {source["location"].rsplit(":", 1)[1] for source in syncs["top_sources"]} == expected


def test_blocking_copies_are_their_own_kind(run_dir):
    # Ground truth: per step two pageable host-to-device copies without non_blocking (x, y) and
    # one real read (loss.item()): 2 blocking copies, 1 host sync.
    model, _, _ = cuda_job()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x_host, y_host = torch.randn(128, 64), torch.randn(128, 1)
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
        for _ in range(30):
            x, y = x_host.to(DEVICE), y_host.cuda()
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()
    snapshot = agent.snapshot()
    by_kind = snapshot["syncs"]["by_kind"]
    assert by_kind.get("blocking_copy") == 2
    assert snapshot["syncs"]["per_step"] - by_kind["blocking_copy"] == 1
    findings = {finding["rule"]: finding for finding in agent.findings()}
    assert findings["host-syncs"]["evidence"]["syncs_per_step"] == 1
    assert findings["pageable-copies"]["evidence"]["blocking_copies_per_step"] == 2
