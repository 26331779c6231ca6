"""The live configuration is read from the job's objects, not from defaults."""

from __future__ import annotations

import torch
from torch import nn

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tuneup.measure.host import cgroup_cpu_limit, usable_cores


class ConvNet(nn.Module):
    """Declared out of order: the BatchNorm follows conv_b when the model runs."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm2d(8)
        self.conv_a = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.conv_b = nn.Conv2d(6, 8, 3, padding=1)  # bias, then BatchNorm: the bias is wasted
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.conv_b(torch.relu(self.conv_a(x)))
        x = self.norm(x)
        return self.head(x.mean(dim=(2, 3)))


def test_configuration_comes_from_the_live_objects(run_dir):
    model = ConvNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=100)
    loader = loader_for(SlowDataset(size=64), batch_size=4, num_workers=1, persistent_workers=True,
                        prefetch_factor=3)
    torch.backends.cudnn.benchmark = True
    try:
        with tuneup.attach(run_dir=run_dir) as agent, torch.autograd.set_detect_anomaly(True):
            for step, _ in enumerate(loader):
                optimizer.zero_grad(set_to_none=False)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(4, 3, 8, 8)).float().pow(2).mean()
                loss.backward()
                optimizer.step()
                scheduler.step()
                if step == 5:
                    break
            config = agent.snapshot()["config"]
    finally:
        torch.backends.cudnn.benchmark = False
    assert config["backends"]["cudnn_benchmark"] is True
    assert config["debug"]["anomaly_detection"] is True
    assert config["autocast"]["cpu"] == "bfloat16"
    assert config["zero_grad_set_to_none"] is False
    (loader_config,) = config["loaders"]
    assert loader_config == {
        "dataset": "SlowDataset", "iterable_dataset": False, "batch_size": 4, "num_workers": 1,
        "pin_memory": False, "persistent_workers": True, "prefetch_factor": 3, "drop_last": False,
        "multiprocessing_context": None, "worker_init_fn": False,
    }
    (optimizer_config,) = config["optimizers"]
    assert optimizer_config["class"] == "AdamW"
    assert optimizer_config["implementation"] == "for-loop"
    assert optimizer_config["lr_scheduler"] is True
    (model_config,) = config["models"]
    assert model_config["class"] == "ConvNet"
    assert model_config["module_order"] == "execution"
    assert model_config["conv_bias_before_batchnorm"] == ["conv_b"]
    assert model_config["convolutions"] == 2
    misaligned = {entry["module"] for entry in model_config["not_multiple_of_8"]}
    assert misaligned == {"conv_a", "conv_b", "head"}  # 3→6, 6→8 and 8→10; BatchNorm is not sized
    assert model_config["dtypes"] == {"float32": sum(p.numel() for p in model.parameters())}
    assert model_config["memory_format"] == "contiguous"
    assert model_config["parallel"] is None and model_config["compiled"] is False


def test_defaults_are_reported_as_they_are(run_dir):
    model = mlp(hidden=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tuneup.attach(run_dir=run_dir) as agent:
        train(loader_for(SlowDataset(size=256)), model, optimizer, steps=4)
    config = agent.snapshot()["config"]
    assert config["autocast"] == {"cpu": None, "cuda": None}
    assert config["zero_grad_set_to_none"] is True
    assert config["debug"]["anomaly_detection"] is False
    assert config["optimizers"][0]["lr_scheduler"] is False
    assert config["models"][0]["not_multiple_of_8_count"] == 1  # the final Linear(32, 1)
    assert config["grad_scaler"] == {"present": False, "enabled": None}


def test_worker_processes_are_measured(run_dir):
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = loader_for(SlowDataset(size=100_000, latency=0.001), batch_size=8, num_workers=2,
                        persistent_workers=True)
    with tuneup.attach(run_dir=run_dir, interval=0.1) as agent:
        train(loader, model, optimizer, steps=60)
        host = agent.snapshot()["system"]["host"]
        for _ in range(50):  # the latest sample may predate the workers
            if host.get("workers", 0) == 2:
                break
            agent.ticker.tick()
            host = agent.snapshot()["system"]["host"]
    assert host["workers"] == 2
    assert host["workers_rss_bytes"] > 10 * 2**20
    assert host["rss_bytes"] > host["workers_rss_bytes"] / 2
    assert host["usable_cores"] == usable_cores() >= 1
    assert host["torch_threads"] == torch.get_num_threads()


def test_workers_that_start_and_end_between_two_samples_are_measured(tmp_path):
    """tests/programs/augment_workers.py: 8 steps an epoch, two new workers each epoch doing
    all the augmentation, epochs far shorter than the 1 s sampling interval. Ground truth: the
    script's own RUSAGE_CHILDREN over its loop (every child of it is one of those workers),
    over the loop's wall time. tuneup's reading, averaged over its window, is that (a sample
    asking psutil for the CPU use of workers it had never seen read 0.0 cores and 0 B)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import child_env

    program = Path(__file__).parent / "programs" / "augment_workers.py"
    run_dir = tmp_path / "run"
    env = child_env(PYTHONPATH=None, TUNEUP_RUN_DIR=str(run_dir), TUNEUP_PORT="0")
    result = subprocess.run([sys.executable, "-m", "tuneup", "run", str(program), "--epochs", "30"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    truth = json.loads(result.stdout.strip().splitlines()[-1])
    cores = truth["workers_cpu_seconds"] / truth["seconds"]
    report = subprocess.run([sys.executable, "-m", "tuneup", "report", str(run_dir), "--format", "json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    host = json.loads(report.stdout)["runs"][0]["snapshot"]["system"]["host"]
    assert truth["steps"] == 240 and cores > 0.05, truth
    assert host["workers"] == 2, host
    # The window's samples against the whole loop's mean: the same rate, read over a part of it.
    assert 0.65 * cores <= host["workers_cpu_ratio"] <= 1.35 * cores + 0.05, (host, truth)
    assert host["workers_rss_bytes"] > 10 * 2**20, host


def test_cgroup_quota_caps_usable_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_a_short_job_leaves_its_configuration_after_its_objects_are_gone(run_dir, monkeypatch):
    """The configuration is read as soon as the probes see new objects, not only every N
    ticks: a job that ends (and drops its loader, optimizer and model) before the next
    periodic read must still leave its configuration behind."""
    import gc
    import time

    from tuneup.measure import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "CONFIG_EVERY_TICKS", 10**9)  # no periodic re-read

    def short_job():
        model = mlp(hidden=16)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        loader = loader_for(SlowDataset(size=4096, latency=0.0003), batch_size=8, num_workers=0)
        train(loader, model, optimizer, steps=60)

    with tuneup.attach(run_dir=run_dir, interval=0.05) as agent:
        time.sleep(0.15)  # the first ticks find nothing yet, like a slow start-up
        short_job()
        gc.collect()
    config = agent.snapshot()["config"]
    assert [entry["class"] for entry in config["optimizers"]] == ["Adam"]
    assert [entry["num_workers"] for entry in config["loaders"]] == [0]
    assert [entry["class"] for entry in config["models"]] == ["Sequential"]


def _hardware_after_a_few_steps(run_dir, **options) -> dict:
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, **options) as agent:
        for _ in range(8):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
    return agent.snapshot()["config"]["hardware"]


def test_the_cpu_bf16_capability_is_torchs_reading_unless_pinned(run_dir, monkeypatch):
    monkeypatch.delenv("TUNEUP_CPU_BF16", raising=False)
    # What torch's own cpuinfo reports for this CPU: the expectation comes from the machine
    # the test runs on, not the one it was written on.
    detected = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    auto = _hardware_after_a_few_steps(run_dir / "auto")
    assert (auto["cpu_bf16"], auto["cpu_bf16_detected"], auto["cpu_bf16_source"]) == (detected, detected, "detected")
    for value in (True, False):
        monkeypatch.setenv("TUNEUP_CPU_BF16", "1" if value else "0")
        pinned = _hardware_after_a_few_steps(run_dir / f"env-{value}")
        assert (pinned["cpu_bf16"], pinned["cpu_bf16_detected"]) == (value, detected)
        assert "TUNEUP_CPU_BF16" in pinned["cpu_bf16_source"]
        keyword = _hardware_after_a_few_steps(run_dir / f"keyword-{value}", cpu_bf16=not value)  # keywords win
        assert keyword["cpu_bf16"] is (not value)
    monkeypatch.setenv("TUNEUP_CPU_BF16", "auto")
    assert _hardware_after_a_few_steps(run_dir / "env-auto")["cpu_bf16_source"] == "detected"


def test_a_job_on_torchs_new_tf32_api_has_its_configuration_read(tmp_path):
    """torch >= 2.9's per-backend precision (`torch.backends.cuda.matmul.fp32_precision =
    "tf32"`, what torch's notes now recommend) makes the legacy getters raise RuntimeError
    (`matmul.allow_tf32`, torch.get_float32_matmul_precision(): "a mix of the legacy and new
    APIs"); the whole configuration went unread, with no warning. In a fresh interpreter: the
    setting is global and the mixed state outlives setting it back."""
    import json
    import subprocess
    import sys

    from tests.conftest import child_env

    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        import pytest

        pytest.skip("a torch without the per-backend fp32_precision API")
    script = f"""
import json, warnings, torch, tuneup
from torch import nn
torch.backends.cuda.matmul.fp32_precision = "tf32"
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with tuneup.attach(run_dir={str(tmp_path / "run")!r}, port=0, interval=0.1) as agent:
        for _ in range(200):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
print(json.dumps({{"backends": (agent.snapshot()["config"] or {{}}).get("backends"),
                  "warnings": [str(w.message) for w in caught]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["backends"] is not None, seen
    assert seen["backends"]["matmul_allow_tf32"] is True and seen["backends"]["float32_matmul_precision"] == "high"
    assert seen["backends"]["cudnn_allow_tf32"] is True  # torch's default for convolutions
    assert not seen["warnings"], seen
