"""The Prometheus export of one agent: the metric catalog read from a real training loop, the
exposition format (promtool), a busy port, the Pushgateway (the real one, where installed)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
import urllib.request
import warnings

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup
from tests.conftest import ROOT, free_port, start_pushgateway
from tuneup import TuneupWarning

DOCS = (ROOT / "docs" / "metrics.md").read_text()


class Slow(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, index):
        time.sleep(0.0004)
        return torch.full((8,), float(index % 7)), torch.tensor([1.0])


def train(steps, skip_every=0, workers=0):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    done = 0
    while done < steps:
        for x, y in DataLoader(Slow(), batch_size=8, num_workers=workers):
            loss = nn.functional.mse_loss(model(x), y)
            if skip_every and done % skip_every == 0:
                loss = loss * float("inf")
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss.item()  # a host read: a sync on a GPU
            done += 1
            if done == steps:
                break


def scrape(url):
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        return response.read().decode()


def families(text):
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(found, sample_name, **labels):
    for family in found.values():
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {sample_name} {labels}")


def drained(agent, steps):
    """Wait until the background thread has summed every step (it does so every interval)."""
    deadline = time.monotonic() + 10
    while agent.state.totals.sums["steps"] < steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.state.totals.sums["steps"] == steps


@pytest.fixture
def exposition(run_dir):
    """A real loop (GradScaler, skipped steps, a stalling loader, host reads) on a fake NVML
    with two GPUs; the agent's /metrics after every step was drained."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's CPU GradScaler notes
        with tuneup.attach(run_dir=run_dir, interval=0.1, nvml_module="tests.fake_nvml") as agent:
            train(96, skip_every=8)
            time.sleep(0.3)  # one more tick: the last steps' device values
            # A step closes when the next one begins: the 96th is still open while attached.
            drained(agent, 95)
            agent.diagnosis.run()
            text = scrape(agent.server.url)
            sums = dict(agent.state.totals.sums)  # what the scrape read: no step closed since
    return agent, text, sums


def test_the_catalog_counts_what_the_loop_did(exposition):
    agent, text, sums = exposition
    found = families(text)
    base = {"rank": "0", "local_rank": "0"}
    assert value(found, "tuneup_step_seconds_count", **base) == 95
    assert value(found, "tuneup_optimizer_steps_total", **base) == 95 - 12  # updates applied
    assert value(found, "tuneup_samples_total", **base) == 95 * 8
    assert value(found, "tuneup_grad_scaler_steps_total", **base) == 96  # the scaler's own count: live
    assert value(found, "tuneup_grad_scaler_skipped_steps_total", **base) == 12  # every 8th loss is infinite
    assert value(found, "tuneup_grad_scaler_backoffs_total", **base) == 12
    assert value(found, "tuneup_grad_scaler_scale", **base) == pytest.approx(65536.0 * 0.5 ** 12)
    assert value(found, "tuneup_step_seconds_sum", **base) == pytest.approx(sums["seconds"])
    assert value(found, "tuneup_data_wait_seconds_total", **base) == pytest.approx(sums["data_wait_seconds"])
    # A stalling loader (8 samples x 0.4 ms): the wait is most of the step.
    assert value(found, "tuneup_data_wait_seconds_total", **base) / value(found, "tuneup_step_seconds_sum", **base) > 0.3
    # Histogram buckets are cumulative and end at the count.
    buckets = [s for s in found["tuneup_step_seconds"].samples if s.name.endswith("_bucket")]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf" and counts[-1] == 95
    # Phases: the detail steps' time, and they add up to the detail steps' whole time.
    phases = {s.labels["phase"]: s.value for s in found["tuneup_step_phase_seconds"].samples}
    assert set(phases) == {"data_wait", "input", "forward", "backward", "optimizer", "other"}
    assert value(found, "tuneup_detail_steps_total", **base) == sums["detailed_steps"]
    assert sum(phases.values()) == pytest.approx(sums["detailed_seconds"], rel=1e-6)
    # Syncs: the loop's .item() on every sampled step.
    assert value(found, "tuneup_syncs_total", kind="item", **base) == value(found, "tuneup_sync_sampled_steps_total")
    # Losses: read on detail steps; the infinite ones counted.
    assert value(found, "tuneup_losses_read_total", **base) == sums["losses_read"] > 0
    assert value(found, "tuneup_nonfinite_losses_total", **base) == sums["nonfinite_losses"] > 0
    # The fake NVML's two GPUs, by index; the run's identity.
    assert value(found, "tuneup_gpu_utilization_ratio", gpu="1", **base) == pytest.approx(0.38)
    assert value(found, "tuneup_gpu_throttled", gpu="0", reason="hw_thermal", **base) == 1
    assert value(found, "tuneup_gpu_throttled", gpu="0", reason="hw_slowdown", **base) == 0
    assert value(found, "tuneup_run_info", run_id=agent.run_info["run_id"], mode="advise", **base) == 1
    assert 0 < time.time() - value(found, "tuneup_last_step_time_seconds", **base) < 30
    # The job's threads' wait for a CPU per step (Linux): no more than all its threads waiting
    # through every step.
    waited = value(found, "tuneup_cpu_wait_seconds_per_step", **base)
    assert 0 <= waited and waited * 95 <= sums["seconds"] * agent.state.system["host"]["threads"]
    # Findings as series: the stall.
    assert value(found, "tuneup_finding_active", rule="data-stall", **base) == 1
    assert 0 < value(found, "tuneup_finding_gain_ratio", rule="data-stall", **base) <= 1
    assert value(found, "tuneup_probe_up", probe="dataloader", **base) == 1
    # prometheus-client's own collectors, reused.
    assert value(found, "process_resident_memory_bytes") > 0
    assert "python_info" in found


def test_every_exported_family_is_documented(exposition):
    _, text, _ = exposition
    documented = set(re.findall(r"`(tuneup_[a-z_]+)`", DOCS))
    exported = {sample.name for family in families(text).values() for sample in family.samples
                if sample.name.startswith("tuneup_")}
    undocumented = {name for name in exported
                    if name not in documented and re.sub(r"_(bucket|sum|count)$", "", name) not in documented}
    assert not undocumented


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_the_exposition(exposition):
    _, text, _ = exposition
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "" and checked.stderr.strip() == ""


def test_a_scrape_during_training_reads_growing_counters(run_dir):
    """Scrapes from another thread while the loop trains (workers are real processes)."""
    import threading

    seen = []
    with tuneup.attach(run_dir=run_dir, interval=0.05) as agent:
        stop = threading.Event()

        def scraper():
            while not stop.is_set():
                found = families(scrape(agent.server.url))
                seen.append(value(found, "tuneup_step_seconds_count"))
                time.sleep(0.05)

        thread = threading.Thread(target=scraper)
        thread.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            train(200, workers=2)
        drained(agent, 199)  # the 200th step closes when the next would begin
        time.sleep(0.2)
        stop.set()
        thread.join()
    assert seen == sorted(seen) and seen[-1] == 199 and len(set(seen)) > 2


def test_a_busy_port_is_one_warning_and_the_job_goes_on(run_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tuneup.attach(run_dir=run_dir, port=port, interval=0.1) as agent:
                train(20)
                served = agent.server.url
                text = scrape(served)
        ours = [w for w in caught if issubclass(w.category, TuneupWarning)]
    assert len(ours) == 1 and f"port {port}" in str(ours[0].message) and "in use" in str(ours[0].message)
    assert not served.endswith(f":{port}")
    assert "tuneup_step_seconds_count" in text
    assert agent.snapshot()["totals"]["steps"] == 20


def test_an_unwritable_registry_is_one_warning_and_the_job_goes_on(run_dir, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("TUNEUP_REGISTRY_DIR", str(blocked / "agents"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, interval=0.1) as agent:
            train(20)
    ours = [str(w.message) for w in caught if issubclass(w.category, TuneupWarning)]
    assert len(ours) == 1 and "cannot announce" in ours[0] and "TUNEUP_REGISTRY_DIR" in ours[0]
    assert agent.snapshot()["totals"]["steps"] == 20


@pytest.fixture
def pushgateway(tmp_path):
    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        pytest.skip("prometheus-pushgateway (Debian package) not installed")
    process, url = start_pushgateway(binary, tmp_path)
    yield url
    process.terminate()
    process.wait(10)


def test_a_short_job_pushes_its_final_counters_to_a_real_pushgateway(run_dir, pushgateway):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, serve=False, push_gateway=pushgateway.removeprefix("http://"),
                           push_interval=60, push_job="nightly") as agent:
            train(30)
    assert not [w for w in caught if issubclass(w.category, TuneupWarning)]
    assert agent.server is None and agent.outputs.pusher.pushes == 1  # the one at detach: shorter than an interval
    found = families(urllib.request.urlopen(pushgateway + "/metrics", timeout=5).read().decode())
    assert value(found, "tuneup_step_seconds_count", job="nightly", rank="0") == 30
    assert value(found, "tuneup_samples_total", job="nightly", rank="0") == 240


def test_an_unreachable_pushgateway_is_one_warning_and_the_job_goes_on(run_dir):
    port = free_port()  # nothing listens there
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, push_gateway=f"127.0.0.1:{port}", push_interval=1) as agent:
            train(30)
            time.sleep(2.5)  # a few periodic pushes fail too
    ours = [str(w.message) for w in caught if issubclass(w.category, TuneupWarning)]
    assert len(ours) == 1 and "Pushgateway" in ours[0] and "training goes on" in ours[0]
    assert agent.outputs.pusher.failures >= 3 and agent.outputs.pusher.pushes == 0
    assert time.monotonic() - began < 10
    assert agent.snapshot()["totals"]["steps"] == 30


@pytest.mark.parametrize("address, message", [("ftp://gateway:9091", "Pushgateway address"),
                                              ("http://:9091", "Pushgateway address"),
                                              ("gateway:notaport", "Pushgateway address")])
def test_a_bad_pushgateway_address_is_a_one_line_error(address, message):
    with pytest.raises(ValueError, match=message):
        tuneup.attach(push_gateway=address)


def test_scrapes_closer_than_the_sampling_interval_reuse_one_rendering():
    """The figures change once per interval: a scraper asking more often gets the same bytes
    and the collectors run once (per exposition format asked for)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from tuneup.export.server import AgentServer

    calls = []

    class Counting:
        def collect(self):
            calls.append(time.monotonic())
            yield GaugeMetricFamily("tuneup_test_renders", "renders so far", value=len(calls))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Counting())
    server = AgentServer(lambda: {}, lambda: registry, fresh_for=0.5)
    server.start("127.0.0.1", 0)
    try:
        first = [scrape(server.url) for _ in range(5)]
        openmetrics = urllib.request.Request(server.url + "/metrics",
                                             headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(openmetrics, timeout=5) as response:
            assert response.read().decode().rstrip().endswith("# EOF")
        time.sleep(0.6)
        later = scrape(server.url)
    finally:
        server.stop()
    assert len(set(first)) == 1 and "tuneup_test_renders 1.0" in first[0]
    assert len(calls) == 3  # the text format once, OpenMetrics once, the text format again after 0.5 s
    assert "tuneup_test_renders 3.0" in later


def test_however_hard_it_is_polled_the_agent_answers_at_most_twenty_times_a_second(run_dir):
    from tuneup.export.server import ANSWER_GAP

    with tuneup.attach(run_dir=run_dir, interval=0.1) as agent:
        train(10)
        began = time.monotonic()
        for _ in range(21):
            scrape(agent.server.url)
        took = time.monotonic() - began
    assert ANSWER_GAP == 0.05 and took >= 20 * ANSWER_GAP * 0.95
