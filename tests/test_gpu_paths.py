"""The GPU paths' logic, on a machine without a GPU: the parts that do not need the device run
for real, the device is replaced by objects with torch.cuda's interface (events, streams), and
the real path has its `gpu`-marked twin in test_cuda.py."""

from __future__ import annotations

import inspect
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup
from tuneup.measure import syncs as syncs_module
from tuneup.measure.copies import is_blocking_copy
from tuneup.measure.gpu_time import CudaStepTimer
from tuneup.measure.syncs import past_warnings, user_frame


class HostClockEvent:
    """torch.cuda.Event's interface for a device that keeps up with the host: work queued on a
    stream is done when the host queues the next thing, so an event completes when recorded
    (as a CUDA event on an idle stream does)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: "HostClockEvent") -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.at - self.at) * 1000.0


class SlowBatches(Dataset):
    """Each batch takes `wait` seconds to make: the GPU starves between steps."""

    def __init__(self, wait: float) -> None:
        self.wait = wait

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        time.sleep(self.wait)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(32, 64, generator=generator), torch.randn(32, 1, generator=generator)


def test_gpu_time_per_step_ends_at_the_update_not_after_the_data_wait(run_dir):
    # Ground truth, from the loop below: 24 steps; each waits 30 ms for its batch in next(),
    # then runs forward, backward and the update (a few ms on this CPU). The "GPU" finishes
    # each piece of work as it is queued, so its busy time per step is the host's time from
    # the forward to the end of opt.step(): measured by the loop itself as `work`.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(SlowBatches(0.03), batch_size=None)
    work = []
    with tuneup.attach(run_dir=run_dir, detail_every=1) as agent:
        agent.recorder.time_gpu(CudaStepTimer(agent.recorder.timeline, None, event=HostClockEvent,
                                              stream=lambda device: None, capturing=lambda: False))
        for x, y in loader:
            began = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            work.append(time.perf_counter() - began)
    window = agent.snapshot()["window"]
    gpu, step = window["gpu_seconds"], window["step_seconds"]
    assert gpu is not None
    # Every step has its GPU time, the last one too (its events completed before detach: the
    # final drain does not wait for them, the flush collects them).
    columns = agent.recorder.timeline.ring.columns(1, 24)
    assert len(columns["step"]) == 24 and min(columns["gpu_seconds"]) >= 0.0, columns["gpu_seconds"]
    # Each step holds one whole wait of at least 30 ms (a sleep); the GPU's time must hold none
    # of it: gpu_i <= step_i - 0.03 for every step. Before the end event moved to the update's
    # end, the figure held the wait: gpu ≈ step. (Bounds from the loop's own sleep, not from
    # how fast this machine runs the work.) Over the same steps, so their medians too: before
    # the flush collected the last step's time, the GPU median was over 23 steps and the step
    # median over 24, and a busy machine's 6 ms between two middle steps broke it.
    pairs = list(zip(columns["gpu_seconds"], columns["step_seconds"]))
    assert all(g <= s - 0.03 for g, s in pairs), pairs
    assert gpu["max"] <= step["max"] - 0.03
    assert gpu["median"] <= step["median"] - 0.03
    # And it holds the work: the end event comes after the update, a few µs before the loop's
    # clock reads `work`'s end (so not at the forward, where an early end would put it). Over
    # the window's own steps (past the warm-up): the full suite's other process once made the
    # first steps' work 40 ms and the last ones' 1-5 ms, and all 24 steps' median was 23 ms.
    assert gpu["median"] >= 0.5 * statistics.median(work[window["first_step"] - 1:window["last_step"]])


def test_events_that_cannot_be_compared_drop_that_step_only(run_dir):
    class OtherStreamEvent(HostClockEvent):
        def elapsed_time(self, end):
            raise RuntimeError("start and end events were recorded on different streams")

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tuneup.attach(run_dir=run_dir, detail_every=1) as agent:
        timer = CudaStepTimer(agent.recorder.timeline, None, event=OtherStreamEvent,
                              stream=lambda device: None, capturing=lambda: False)
        agent.recorder.time_gpu(timer)
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    snapshot = agent.snapshot()
    assert snapshot["totals"]["steps"] == 20
    assert timer.dropped >= 15  # every detail step's pair, each on its own
    assert snapshot["window"]["gpu_seconds"] is None
    assert any(name == "gpu_time" for name, _ in agent.recorder.timeline.on_close)  # still listening
    assert snapshot["warnings"] == []


def test_no_event_is_recorded_or_queried_while_a_graph_is_captured(run_dir):
    recorded = []

    class Counted(HostClockEvent):
        def record(self, stream=None):
            recorded.append(self)
            super().record(stream)

        def query(self):
            assert not capturing[0], "query() while capturing invalidates the capture"
            return super().query()

    capturing = [True]
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tuneup.attach(run_dir=run_dir, detail_every=1) as agent:
        agent.recorder.time_gpu(CudaStepTimer(agent.recorder.timeline, None, event=Counted,
                                              stream=lambda device: None, capturing=lambda: capturing[0]))
        for step in range(20):
            if step == 10:
                assert recorded == []
                capturing[0] = False
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert recorded  # timed again once the capture ended
    assert agent.snapshot()["window"]["gpu_seconds"]["median"] >= 0


# --- explicit synchronize calls (sync debug mode never reports them) ---------------------------

def test_explicit_synchronize_calls_are_counted_at_their_line(run_dir, monkeypatch):
    # Ground truth: 30 steps, each calling torch.cuda.synchronize() once (the line marked
    # below) after its update, as timing code in public training scripts does. Without a GPU
    # the call itself is replaced by a Python function of the same signature (torch's own is
    # a Python function too: torch/cuda/__init__.py), installed before attach. tuneup replaces
    # nothing: the call watch notes the calls of that function's code on its watched steps.
    calls = []
    namespace = {"__name__": "torch.cuda", "calls": calls}  # torch's module, as the real one's frame says
    exec("def synchronize(device=None):\n    calls.append(device)\n", namespace)
    monkeypatch.setattr(torch.cuda, "synchronize", namespace["synchronize"])
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
        for _ in range(30):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            torch.cuda.synchronize()  # the sync
    assert len(calls) == 30  # every call reached it: nothing stood in between
    assert torch.cuda.synchronize.__code__ is not None and agent.recorder.calls.watched_steps >= 3
    syncs = agent.snapshot()["syncs"]
    assert syncs["by_kind"] == {"cuda.synchronize": 1.0}  # per watched step
    (source,) = syncs["top_sources"]
    lines, first = inspect.getsourcelines(test_explicit_synchronize_calls_are_counted_at_their_line)
    expected = first + next(i for i, line in enumerate(lines) if "# the sync" in line)
    assert source["location"].endswith(f"test_gpu_paths.py:{expected}")


# --- blocking host-to-device copies, told from the line -----------------------------------------

class Copyable:
    """Stands for a tensor in the lines below: its copy methods report what is_blocking_copy
    says of the line that called them, as the sync debug mode's warning would be seen there."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def to(self, *args, **kwargs):
        return is_blocking_copy(sys._getframe(1))

    cuda = copy_ = to


def test_copies_to_the_device_are_told_from_reads_to_the_host():
    device = "cuda"
    x, y = Copyable(), Copyable()
    on_device = Copyable("cuda")
    batch = {"input_ids": Copyable(), "labels": Copyable()}
    assert x.to(device) and y.cuda()
    assert (x.to(device, non_blocking=False), y.to(device=device)) == (True, True)
    assert all([value.to(device) for value in batch.values()])
    assert x.copy_(
        y)  # a call over two lines
    assert not on_device.to("cpu")
    assert not on_device.to(device="cpu")
    assert not on_device.to(torch.device("cpu"))
    assert not on_device.to(device)  # the receiver is on the device already: a device-to-host read
    assert not is_blocking_copy(None)


# --- the warnings machinery, wherever it lives (Python 3.14: _py_warnings) -----------------------

def _frame(module: str, filename: str, back=None, name: str = "f"):
    return SimpleNamespace(f_globals={"__name__": module}, f_code=SimpleNamespace(co_filename=filename, co_name=name),
                           f_back=back, f_lineno=1)


def test_syncs_are_attributed_past_the_warnings_machinery_of_any_python():
    # A recorded Python 3.14 stack at showwarning's caller: warnings._showwarnmsg lives in
    # _py_warnings (the C warn calls it), under it the user's line or GradScaler's.
    user = _frame("__main__", "/job/train.py", name="train")
    scaler = _frame("torch.amp.grad_scaler", "/torch/amp/grad_scaler.py", back=user, name="_maybe_opt_step")
    for below in (user, scaler):
        machinery = _frame("_py_warnings", "/usr/lib/python3.14/_py_warnings.py", name="_showwarnmsg", back=below)
        assert past_warnings(machinery) is below
        assert user_frame(machinery) is user
    assert syncs_module._inherent_kind(past_warnings(
        _frame("_py_warnings", "/usr/lib/python3.14/_py_warnings.py", back=scaler))) == "grad_scaler"
    # This interpreter's own machinery, by file whatever its module name says.
    here = _frame("not-warnings", warnings._showwarnmsg.__code__.co_filename, back=user)
    assert past_warnings(here) is user


# --- bf16 where the GPU runs it, not where it is emulated ------------------------------------------

def test_bf16_is_chosen_by_compute_capability_not_by_emulation(monkeypatch):
    # torch.cuda.is_bf16_supported() says True on a T4 (sm_75: emulated bf16); apply mode must
    # then take fp16 with a GradScaler, and the hardware record must say no bf16.
    from tuneup.act.actions import amp
    from tuneup.measure import config

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    for capability, native in (((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        assert config.cuda_bf16(0) is native
        assert amp.bf16_supported("cuda", 0) is native
    assert amp.bf16_supported("cpu")


def test_the_gpu_proof_says_it_needs_a_gpu_and_runs_nothing_without_one():
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the proof itself runs there")
    done = subprocess.run([sys.executable, "benchmarks/gpu_proof.py", "--out", "/nonexistent/x.md"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["gpu_proof: no CUDA GPU here; nothing run (run it on a GPU machine)"]


# --- the torch the package declares at its floor (2.3): autocast read without a device argument ----

def test_autocast_is_read_on_torch_2_3s_api(monkeypatch):
    # torch 2.3 has torch.is_autocast_enabled() without arguments (CUDA's) and no
    # get_autocast_dtype; the CPU's state has functions of its own. Stand-ins with 2.3's
    # signatures, over this torch's state.
    from tuneup.measure.model import read_autocast

    cuda_enabled = torch.is_autocast_enabled

    def is_autocast_enabled():  # 2.3: CUDA's autocast only
        return cuda_enabled("cuda")

    def read_as_on_2_3():
        with monkeypatch.context() as patched:  # only while reading: torch.autocast itself uses this torch's API
            patched.setattr(torch, "is_autocast_enabled", is_autocast_enabled)
            patched.delattr(torch, "get_autocast_dtype")
            return read_autocast()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # this torch deprecates the 2.3 names
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert read_as_on_2_3() == {"cpu": "bfloat16", "cuda": None}
        assert read_as_on_2_3() == {"cpu": None, "cuda": None}


# --- cudnn.benchmark: set at start, where it works -------------------------------------------------

class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


def conv_run(run_dir, monkeypatch, sizes, steps=40):
    """A conv net trained in apply mode (cudnn-benchmark only), its parameters standing for a
    GPU's (no GPU here: the flag is a flag either way). Returns (agent, benchmark seen by the
    first convolution, benchmark after detach)."""
    from tuneup.act.actions import cudnn_benchmark

    monkeypatch.setattr(cudnn_benchmark, "_on_cuda", lambda model: True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    model = ConvNet()
    seen = []
    model.conv.register_forward_pre_hook(lambda module, args: seen.append(torch.backends.cudnn.benchmark))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(4, 3, sizes[i % len(sizes)], sizes[i % len(sizes)]), torch.zeros(4, dtype=torch.long))
               for i in range(steps)]
    loader = DataLoader(batches, batch_size=None)  # images of these sizes, in turn
    with tuneup.attach(mode="apply", run_dir=run_dir, actions=("cudnn-benchmark",), detail_every=1) as agent:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return agent, seen[0], torch.backends.cudnn.benchmark


def test_cudnn_benchmark_is_set_before_the_first_convolution_and_kept_for_static_shapes(run_dir, monkeypatch):
    agent, first, after = conv_run(run_dir, monkeypatch, sizes=[16])
    assert first is True  # the first convolution already ran with the autotuner on
    (record,) = [r for r in agent.actions() if r["action"] == "cudnn-benchmark"]
    assert record["decision"] == "set at start" and record["applied_step"] == 1
    assert record["after"] == {"cudnn.benchmark": True}
    assert "first time it runs" in record["reason"]
    assert after is False  # detach put the job's setting back


def test_cudnn_benchmark_is_rolled_back_when_the_shapes_vary(run_dir, monkeypatch):
    agent, first, after = conv_run(run_dir, monkeypatch, sizes=[8, 12, 16, 20, 24], steps=60)
    assert first is True
    (record,) = [r for r in agent.actions() if r["action"] == "cudnn-benchmark"]
    assert record["decision"] == "rolled back"
    assert "input shapes vary" in record["reason"]
    assert after is False


def test_cudnn_benchmark_mid_run_is_not_tried_and_says_why():
    # The finding means convolutions already ran with it off: a trial would change nothing.
    from tuneup.act.actions.cudnn_benchmark import CudnnBenchmark

    action = CudnnBenchmark()
    job = SimpleNamespace(finding=lambda *rules: {"rule": "cudnn-benchmark-off"})
    assert action.propose(job, None) is None
    assert action.done and "changes nothing" in action.not_applicable and "first convolution" in action.not_applicable
