"""The export on a real GPU and driver: NVML and allocator series from a CUDA training loop,
the node daemon's NVML series, and a clean promtool check. Run on a GPU machine:
`python -m pytest -m gpu tests/test_export_gpu.py`."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import tuneup
from tuneup.export.daemon import NodeDaemon

pytestmark = pytest.mark.gpu


def series(text, name):
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_a_cuda_job_exports_nvml_and_allocator_series(run_dir):
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(256, 1024, device="cuda")
    with tuneup.attach(run_dir=run_dir, interval=0.2) as agent:
        for _ in range(300):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        torch.cuda.synchronize()
        time.sleep(1.5)  # two samples of NVML and the allocator after the loop
        with urllib.request.urlopen(agent.server.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    gpus = {s.labels["gpu"] for s in series(text, "tuneup_gpu_utilization_ratio")}
    assert gpus, "no NVML series"
    assert all(s.value > 0 for s in series(text, "tuneup_gpu_memory_total_bytes"))
    assert any(s.value > 0 for s in series(text, "tuneup_gpu_process_memory_bytes"))
    allocated = series(text, "tuneup_cuda_memory_allocated_bytes")
    assert allocated and allocated[0].labels["gpu"] == str(torch.cuda.current_device()) and allocated[0].value > 0
    assert series(text, "tuneup_cuda_memory_reserved_peak_bytes")[0].value >= allocated[0].value
    assert series(text, "tuneup_grad_scaler_steps_total")[0].value > 0
    assert series(text, "tuneup_syncs_total"), "the GradScaler's found-inf read counts as a CUDA sync"
    if shutil.which("promtool"):
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_daemon_exports_every_gpu_of_the_node(tmp_path):
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    node = NodeDaemon(tmp_path / "agents")
    url = node.start("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        node.stop()
    assert len(series(text, "tuneup_node_gpu_memory_total_bytes")) == count
    assert {s.labels["uuid"].startswith("GPU-") for s in series(text, "tuneup_node_gpu_info")} == {True}
