"""GPU sampling through NVML: the real backend on a fake driver, and on a real one (gpu)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tests import fake_nvml
from tuneup.measure.gpu import NoGpus, NvmlGpus, open_gpus, own_pids

FAKE = "tests.fake_nvml"


@pytest.fixture(autouse=True)
def fresh_fake():
    fake_nvml.reset()
    yield
    fake_nvml.reset()


def test_samples_are_in_base_units():
    gpus = open_gpus(FAKE)
    assert isinstance(gpus, NvmlGpus)
    assert [d["name"] for d in gpus.devices] == ["Fake H100 80GB HBM3"] * 2
    first = gpus.sample()[0]
    assert first["utilization_ratio"] == pytest.approx(0.37)
    assert first["memory_used_bytes"] == 20 * 2**30 and first["memory_total_bytes"] == 80 * 2**30
    assert first["power_watts"] == 350.0 and first["power_limit_watts"] == 700.0
    assert first["sm_clock_hz"] == 1755e6 and first["sm_clock_max_hz"] == 1980e6
    assert first["temperature_celsius"] == 61
    assert first["throttle_reasons"] == ["sw_power_cap", "hw_thermal"]
    assert first["pcie_rx_bytes_per_second"] == 2048 * 1024
    assert first["process_memory_bytes"] == fake_nvml.own_pid_memory


@pytest.mark.parametrize("visible, expected", [("1", [1]), ("1,0", [1, 0]), ("GPU-fake-0001", [1]), ("0,7,1", [0]), ("", [])])
def test_cuda_visible_devices_picks_the_gpus(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = open_gpus(FAKE)
    if not expected:
        assert isinstance(gpus, NoGpus) and "no GPU visible" in gpus.reason
    else:
        # Labelled as CUDA numbers them in this process (cuda:0, cuda:1, ...), NVML's index beside.
        assert [d["nvml_index"] for d in gpus.devices] == expected
        assert [s["gpu"] for s in gpus.sample()] == list(range(len(expected)))


def test_unsupported_fields_are_none_without_a_warning():
    fake_nvml.reset(no_power=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sample = open_gpus(FAKE).sample()[0]
    assert sample["power_watts"] is None and sample["power_limit_watts"] is None
    assert sample["utilization_ratio"] is not None


def test_no_driver_and_no_binding_say_why():
    if not torch.cuda.is_available():
        assert open_gpus("pynvml").reason.startswith("no NVIDIA driver: NVML did not start")
    missing = open_gpus("tuneup_no_such_nvml_binding")
    assert isinstance(missing, NoGpus) and "could not be imported" in missing.reason
    assert open_gpus(FAKE, enabled=False).reason == "GPU sampling turned off (TUNEUP_GPU=0)"


def test_agent_reports_gpu_samples_from_nvml(run_dir):
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, nvml_module=FAKE, interval=0.05) as agent:
        train(loader_for(SlowDataset(size=256, latency=0.001)), model, optimizer, steps=10)
    gpu = agent.snapshot()["system"]["gpu"]
    assert gpu["available"] is True
    assert len(gpu["samples"]) == 2
    assert agent.snapshot()["probes"]["gpu"] == "on"


def test_nvml_failing_mid_run_turns_the_probe_off_with_one_warning(run_dir):
    fake_nvml.reset(fail_after=3)
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, nvml_module=FAKE, interval=0.05) as agent:
            truth = train(loader_for(SlowDataset(size=4096, latency=0.0005)), model, optimizer, steps=40)
    ours = [w for w in caught if issubclass(w.category, tuneup.TuneupWarning)]
    assert len(ours) == 1
    assert "gpu probe turned off" in str(ours[0].message) and "GPU is lost" in str(ours[0].message)
    snapshot = agent.snapshot()
    assert snapshot["probes"]["gpu"] == "off"
    assert snapshot["system"]["gpu"]["available"] is False
    assert snapshot["totals"]["steps"] == truth.steps == 40


def test_no_gpu_section_says_so_and_everything_else_works(run_dir):
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuneup.TuneupWarning)
        with tuneup.attach(run_dir=run_dir, nvml_module="tuneup_missing_pynvml") as agent:
            train(loader_for(SlowDataset(size=256)), model, optimizer, steps=5)
    snapshot = agent.snapshot()
    assert snapshot["system"]["gpu"]["available"] is False
    assert "could not be imported" in snapshot["system"]["gpu"]["reason"]
    assert snapshot["totals"]["steps"] == 5
    assert snapshot["system"]["memory"]["available"] is torch.cuda.is_initialized()


@pytest.mark.gpu
def test_real_nvml_samples_this_gpu():
    gpus = open_gpus("pynvml")
    assert isinstance(gpus, NvmlGpus), getattr(gpus, "reason", "")
    sample = gpus.sample()[0]
    assert 0 <= sample["utilization_ratio"] <= 1
    assert sample["memory_total_bytes"] > 2**30
    assert sample["sm_clock_max_hz"] > 0
    x = torch.ones(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    # In a container the driver may list this process under another pid: unknown (None), never 0.
    assert all(s["process_memory_bytes"] is None or s["process_memory_bytes"] > 0 for s in gpus.sample())
    del x


def test_the_agents_snapshot_is_the_rules_input_gpu_history_included(run_dir):
    """One definition of the snapshot: evaluate(agent.snapshot()) checks the GPU rules with the
    NVML history (it used to carry no gpu_history, and the GPU rules were silently skipped)."""
    from tuneup.diagnose import evaluate

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, nvml_module=FAKE, interval=0.05) as agent:
        train(loader_for(SlowDataset(size=512)), model, optimizer, steps=30)
        agent.ticker.tick()  # a system sample inside the window, whatever the machine's speed
        live = agent.snapshot()
    devices = live["gpu_history"]["devices"]
    assert [device["gpu"] for device in devices] == [0, 1]  # the fake driver's two GPUs
    assert devices[0]["utilization_ratio"] == pytest.approx(0.37)
    from tuneup.diagnose.rule import Facts

    assert Facts(live, ()).gpus == devices  # the GPU rules' input: present, not Missing
    from_history = agent.state.history.snapshot(agent.options.window_steps)
    # The same GPUs and figures as the history's snapshot (its window is whole intervals, the
    # live one the exact last steps: they may hold a sample more or less).
    assert [device["gpu"] for device in from_history["gpu_history"]["devices"]] == [0, 1]
    # The GPU rules judge both alike (the others read step timings, which a busy machine moves
    # across their thresholds between two windows).
    from tuneup.diagnose.rule import RULES

    gpu_rules = {rule.id for rule in RULES.values() if rule.check.__module__.endswith("rules.gpu")}
    assert {f.rule for f in evaluate(live).findings} & gpu_rules
    assert ({f.rule for f in evaluate(live).findings} & gpu_rules) == \
        ({f.rule for f in evaluate(from_history).findings} & gpu_rules)


def test_a_driver_older_than_the_binding_loses_fields_not_the_probe():
    # Missing symbols (the v3 process list before driver 510, the renamed clock-event reasons)
    # and an unknown struct version: those fields are absent, every other one is read.
    fake_nvml.reset(old_driver=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpus = open_gpus(FAKE)
        assert isinstance(gpus, NvmlGpus)
        first, again = gpus.sample()[0], gpus.sample()[0]
    for sample in (first, again):
        assert sample["throttle_reasons"] is None and sample["temperature_celsius"] is None
        assert sample["process_memory_bytes"] is None
        assert sample["utilization_ratio"] == pytest.approx(0.37) and sample["memory_used_bytes"] == 20 * 2**30


def test_a_binding_without_a_function_loses_that_field(monkeypatch):
    monkeypatch.delattr(fake_nvml, "nvmlDeviceGetCurrentClocksEventReasons")  # an old nvidia-ml-py
    monkeypatch.delattr(fake_nvml, "nvmlDeviceGetPcieThroughput")
    gpus = open_gpus(FAKE)
    assert isinstance(gpus, NvmlGpus), getattr(gpus, "reason", "")
    sample = gpus.sample()[0]
    assert sample["throttle_reasons"] is None and sample["pcie_rx_bytes_per_second"] is None
    assert sample["power_watts"] == 350.0


def test_in_a_container_the_process_memory_is_unknown_unless_a_pid_matches(tmp_path):
    # The driver lists the job under its host pid (48213); the container's /proc/self/status
    # shows only the inner pid, so the figure is unknown (None), not 0 ...
    fake_nvml.reset(pids=(48213,))
    gpus = open_gpus(FAKE)
    assert gpus.sample()[0]["process_memory_bytes"] is None
    # ... and where /proc shows the outer namespace too (NSpid: outer first), it is matched.
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nPid:\t17\nNSpid:\t48213\t17\nPPid:\t1\n")
    assert own_pids(str(status)) == {48213, 17, os.getpid()}
    gpus.pids = own_pids(str(status))
    assert gpus.sample()[0]["process_memory_bytes"] == fake_nvml.own_pid_memory
    assert os.getpid() in own_pids()  # this machine's own status file parses


def test_mig_instances_are_reported_not_no_gpu_visible(monkeypatch):
    fake_nvml.reset(mig={1: 2})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-fake-0001-1")
    gpus = open_gpus(FAKE)
    assert isinstance(gpus, NvmlGpus), getattr(gpus, "reason", "")
    (device,) = gpus.devices
    assert device["mig"] is True and device["nvml_index"] == 1 and device["uuid"] == "MIG-fake-0001-1"
    (sample,) = gpus.sample()
    assert sample["gpu"] == 0 and sample["memory_total_bytes"] == 80 * 2**30
    assert sample["utilization_ratio"] is None  # not per instance


def test_devices_are_labelled_as_cuda_numbers_them(monkeypatch):
    # CUDA_DEVICE_ORDER=FASTEST_FIRST on a machine of two kinds: CUDA's cuda:0 is NVML's 1.
    gpus = open_gpus(FAKE)
    gpus.match_cuda(["fake-0001", "fake-0000"])  # torch's UUIDs by ordinal (no GPU- prefix)
    assert [(d["nvml_index"], d["gpu"]) for d in gpus.devices] == [(0, 1), (1, 0)]
    assert [s["gpu"] for s in gpus.sample()] == [1, 0]
    assert [s["utilization_ratio"] for s in gpus.sample()] == [pytest.approx(0.37), pytest.approx(0.38)]


@pytest.mark.gpu
def test_nvml_devices_carry_the_cuda_ordinal_of_this_process(run_dir):
    from tuneup.measure.gpu import cuda_uuids

    model = torch.nn.Linear(64, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, interval=0.05) as agent:
        for _ in range(20):
            optimizer.zero_grad()
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            optimizer.step()
        agent.ticker.tick()
    snapshot = agent.snapshot()
    uuids = cuda_uuids()
    for device in snapshot["system"]["gpu"]["devices"]:
        assert device["uuid"].lower().removeprefix("gpu-").removeprefix("mig-") == uuids[device["gpu"]].lower()
    allocator = {d["device"] for d in snapshot["system"]["memory"]["devices"]}
    assert allocator <= {d["gpu"] for d in snapshot["system"]["gpu"]["devices"]}
    own = [s["process_memory_bytes"] for s in snapshot["system"]["gpu"]["samples"]]
    assert all(value is None or value > 0 for value in own)  # unknown in a container, never 0
