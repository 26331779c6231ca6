"""FLOPs per step, achieved FLOP/s and MFU (issue 22): the count on the model's shapes equals
the analytic count written here from the layer shapes, forward and backward; counting leaves
the job's results bit-identical; it says why where it cannot run; MFU is stated only against a
known peak.

The analytic counts follow torch's counter's convention (torch/utils/flop_counter.py): a
matmul of (m, k) by (k, n) is 2·m·k·n; a convolution 2·(output elements)·(input channels per
group)·(kernel elements); backward computes the input's gradient where it is needed and the
weight's, each as many FLOPs as the forward; elementwise ops, norms and softmax count nothing.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request

import pytest
import torch
from torch import nn

import tuneup
from tuneup.measure import flops as flops_module
from tuneup.measure.config import tf32_allowed
from tuneup.measure.utilization import peak, utilization


def train(model, batches, steps, *, accumulate=1, lr=0.01, agent_options=None):
    """A plain loop (SGD, cross-entropy on the model's output); returns its losses, and the
    agent when one was attached."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []

    def loop():
        for step in range(steps):
            optimizer.zero_grad()
            for micro in range(accumulate):
                x, y = batches(step * accumulate + micro)
                loss = nn.functional.cross_entropy(model(x), y) / accumulate
                loss.backward()
                losses.append(loss.item())
            optimizer.step()

    if agent_options is None:
        loop()
        return losses, None
    with tuneup.attach(**agent_options) as agent:
        loop()
    return losses, agent


def fixed(shape, classes=10):
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(*shape, generator=generator), torch.randint(0, classes, (shape[0],), generator=generator)
    return lambda step: (x, y)


def counted(agent):
    found = agent.snapshot()["habits"]["flops"]
    assert found and not found.get("skipped"), found
    return found


class Block(nn.Module):
    """A pre-norm transformer block, attention written out (as nanoGPT's), and a classifier head."""

    def __init__(self, dim=64, heads=4, length=16, classes=10):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim * length, classes)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attention = (q @ k.transpose(-2, -1)) * (dim // self.heads) ** -0.5
        mixed = (attention.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.proj(mixed)
        x = x + self.mlp(self.norm2(x))
        return self.head(x.flatten(1))


def linear(rows, inputs, outputs):
    return 2 * rows * inputs * outputs


@pytest.mark.parametrize("case", ["mlp", "conv", "transformer"])
def test_the_count_equals_the_analytic_count_forward_and_backward(case, run_dir):
    if case == "mlp":
        # x (32, 128) -> Linear 256 -> ReLU -> Linear 10. The first layer's input needs no gradient.
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
        batches = fixed((32, 128))
        forward = linear(32, 128, 256) + linear(32, 256, 10)
        backward = linear(32, 128, 256) + 2 * linear(32, 256, 10)
    elif case == "conv":
        # x (8, 3, 16, 16) -> Conv 3->8 3x3 pad 1 -> ReLU -> Conv 8->16 3x3 pad 1 -> flatten -> Linear 10.
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                              nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
        batches = fixed((8, 3, 16, 16))
        conv1, conv2 = 2 * (8 * 8 * 16 * 16) * 3 * 9, 2 * (8 * 16 * 16 * 16) * 8 * 9
        head = linear(8, 16 * 16 * 16, 10)
        forward = conv1 + conv2 + head
        backward = conv1 + 2 * conv2 + 2 * head
    else:
        # x (4, 16, 64): qkv 64->192, scores and mixing 2·B·T²·D each, proj 64->64, MLP 64->256->64,
        # head 1024->10; every layer's input needs a gradient (the residual stream's norms have weights).
        batch, length, dim = 4, 16, 64
        model = Block(dim=dim, length=length)
        batches = fixed((batch, length, dim))
        rows = batch * length
        attention = 2 * (2 * batch * length * length * dim)
        forward = (linear(rows, dim, 3 * dim) + attention + linear(rows, dim, dim) + linear(rows, dim, 4 * dim)
                   + linear(rows, 4 * dim, dim) + linear(batch, dim * length, 10))
        backward = 2 * forward
    _, agent = train(model, batches, 80, agent_options=dict(run_dir=run_dir, port=0))
    found = counted(agent)
    assert found["forward_flops"] == pytest.approx(forward, rel=0.02)
    assert found["backward_flops"] == pytest.approx(backward, rel=0.02)
    assert found["flops"] == found["forward_flops"] + found["backward_flops"]
    assert found["batch"] == batches(0)[0].shape[0]
    # Per step: one forward and backward a step here.
    assert agent.snapshot()["flops"]["flops_per_step"] == pytest.approx(forward + backward, rel=0.02)


def test_the_modules_that_do_the_flops_are_named_and_repeated_layers_grouped(run_dir):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)], nn.Linear(64, 10))
    _, agent = train(model, fixed((16, 64)), 80, agent_options=dict(run_dir=run_dir, port=0))
    top = counted(agent)["top_modules"]
    # Ground truth: three 64x64 layers (grouped: the same layer in each block) and a 64x10 head.
    assert [(m["module"], m["class"], m["count"]) for m in top] == [("Sequential.*.0", "Linear", 3),
                                                                    ("Sequential.3", "Linear", 1)]
    assert sum(m["share"] for m in top) == pytest.approx(1.0)
    assert top[0]["share"] > top[1]["share"]


def test_modules_that_return_their_input_are_not_credited_with_their_neighbours_backward(run_dir):
    """Ground truth from the code: a 2-layer nn.TransformerEncoder with dropout=0.0, as small
    language-model scripts build it, over a (4, 16, 32) batch, then a classifier head, in a
    Sequential. Each layer's FLOPs are its attention (q/k/v and out projections, scores and
    mixing) and its two MLP Linears; its three Dropout(p=0) modules return their input and do
    none (forward 0, so backward 0). torch's ModuleTracker credited them with every backward
    FLOP after theirs: 70% of the model. The layers group by their index in the encoder's
    ModuleList, not by the encoder's in the Sequential."""
    batch, length, dim, ffn = 4, 16, 32, 64
    layer = nn.TransformerEncoderLayer(dim, 4, ffn, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Flatten(),
                          nn.Linear(length * dim, 10))
    _, agent = train(model, fixed((batch, length, dim)), 80, agent_options=dict(run_dir=run_dir, port=0))
    found = counted(agent)
    rows = batch * length
    per_layer = {"self_attn": linear(rows, dim, 3 * dim) + 2 * (2 * batch * length * length * dim) + linear(rows, dim, dim),
                 "linear1": linear(rows, dim, ffn), "linear2": linear(rows, ffn, dim)}
    head = linear(batch, length * dim, 10)
    assert found["forward_flops"] == pytest.approx(2 * sum(per_layer.values()) + head, rel=0.02)
    top = {m["module"]: m for m in found["top_modules"]}
    assert not [name for name in top if "dropout" in name], found["top_modules"]
    expected = {f"Sequential.0.layers.*.{name}": 2 * flops for name, flops in per_layer.items()}
    expected["Sequential.2"] = head
    assert set(top) == set(expected), found["top_modules"]
    assert all(top[name]["count"] == 2 for name in expected if "*" in name)
    assert sum(m["share"] for m in top.values()) == pytest.approx(1.0)
    # Forward + backward is about 3x each module's forward (a little less for the first layer's
    # input projection, whose input needs no gradient): the shares follow the forward's.
    for name, flops in expected.items():
        assert top[name]["share"] == pytest.approx(flops / sum(expected.values()), abs=0.04), (name, top[name])


def test_counting_leaves_the_job_bit_identical(run_dir):
    # Dropout draws from the global RNG: a count that touched it would change every loss after it.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.ReLU(), nn.Linear(64, 10))

    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
            for _ in range(8)]
    plain, _ = train(model(), lambda step: data[step % 8], 150)
    measured_model = model()
    measured, agent = train(measured_model, lambda step: data[step % 8], 150,
                            agent_options=dict(run_dir=run_dir, port=0))
    assert counted(agent)["counts"] == 1  # the count ran (at step 65)
    assert measured == plain


def test_gradient_accumulation_multiplies_the_count_by_the_batches_a_step_runs(run_dir):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    _, agent = train(model, fixed((16, 32)), 80, accumulate=4, agent_options=dict(run_dir=run_dir, port=0))
    found = counted(agent)
    assert agent.snapshot()["window"]["backward_passes_per_step"] == pytest.approx(4, abs=0.5)
    assert agent.snapshot()["flops"]["flops_per_step"] == 4 * found["flops"]


def test_a_new_input_shape_is_counted_again_and_the_figure_says_it_varies(run_dir, monkeypatch):
    monkeypatch.setattr(flops_module, "RECHECK_STEPS", 1)  # a look at every lifecycle check (64 steps)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    small, large = fixed((16, 32)), fixed((48, 32))
    _, agent = train(model, lambda step: small(step) if step < 100 else large(step), 300,
                     agent_options=dict(run_dir=run_dir, port=0))
    found = counted(agent)
    assert found["counts"] == 2
    # Forward and the weight's gradient for the first layer (its input needs none), forward and
    # both gradients for the second; the median of the two shapes' counts is reported.
    per_batch = lambda rows: 2 * linear(rows, 32, 64) + 3 * linear(rows, 64, 10)  # noqa: E731
    assert found["flops"] == pytest.approx((per_batch(16) + per_batch(48)) / 2, rel=0.02)
    assert agent.snapshot()["flops"]["estimate"] is True


def test_a_capture_started_again_before_its_step_closed_waits_for_a_new_training_forward(run_dir):
    """The count took a training forward, and is started again before that step closed (the
    run's own schedule never does; a test that started it by hand did, in CI): it waits for
    the next training forward, not for any call of the forward. jit.trace checks its trace by
    calling the model's Python forward under no_grad (torch/jit/_trace.py, _check_trace is
    decorated @torch.no_grad()): with the old input still held, that call was taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = fixed((16, 32))(0)

    def forward_backward():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()

    with tuneup.attach(run_dir=run_dir, port=0, interval=60, detail_every=1) as agent:
        for _ in range(8):
            forward_backward()
            optimizer.step()
        flops = agent.recorder.flops
        flops.capture([model])
        forward_backward()  # a training forward on a detail step: taken, its step still open
        assert flops.state == "captured"
        flops.capture([model])
        assert flops.state == "capturing"
        with torch.no_grad():
            model(x)
        torch.jit.trace(model, x)
        assert flops.state == "capturing"
        optimizer.step()
        forward_backward()  # the next training forward
        assert flops.state == "captured"
        optimizer.step()
        forward_backward()
    assert counted(agent)["flops"] == pytest.approx(2 * linear(16, 32, 64) + 3 * linear(16, 64, 10), rel=0.02)


def test_a_forward_that_needs_its_data_is_not_counted_and_says_why(run_dir):
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(32, 10)

        def forward(self, x):
            out = self.layer(x)
            return out * (out > 0).float() if out[0, 0].item() > -1e9 else out  # a host read of the data

    _, agent = train(Masked(), fixed((16, 32)), 80, agent_options=dict(run_dir=run_dir, port=0))
    found = agent.snapshot()["habits"]["flops"]
    assert "cannot run on shapes alone" in found["skipped"] and "item" in found["skipped"].lower(), found
    assert agent.snapshot()["flops"] == {"skipped": found["skipped"]}
    assert not [w for w in agent.snapshot()["warnings"] if "flops" in w["message"]]  # a reason, not a failure


def loop_clock(starts, window):
    """The loop's own wall time over the steps `window` holds (tuneup's step n is the loop's
    iteration n - 1; `starts` holds each iteration's start and the loop's end), and how far
    tuneup's sum may be from it: its step boundaries are not the loop's iteration starts (the
    optimizer's step, a backward's end), at most a step off at each end of the window, so two
    of the longest steps about it, as a share of the sum."""
    durations = [after - before for before, after in zip(starts, starts[1:])]
    first, last = window["first_step"] - 1, window["last_step"]
    seconds = sum(durations[first:last])
    return seconds, 2 * max(durations[max(0, first - 1):last + 1]) / seconds


def test_cpu_states_achieved_flops_and_no_mfu_in_the_report_and_the_metrics(run_dir):
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    starts = []
    # A window of the last 100 steps: past the count (at step 65), whose time is tuneup's own,
    # kept out of its step times and not out of the loop's clock.
    with tuneup.attach(run_dir=run_dir, port=0, window_steps=100) as agent:
        torch.manual_seed(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))
        for _ in range(240):
            starts.append(time.perf_counter())
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        starts.append(time.perf_counter())
        with urllib.request.urlopen(f"{agent.server.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        snapshot = agent.snapshot()
    figures = snapshot["flops"]
    assert figures["mfu"] is None and figures["peak_flops_per_second"] is None
    # Ground truth: the layer shapes' FLOPs (the first layer's forward and weight gradient, the
    # second's forward and both gradients) over the loop's own clock on the window's steps.
    step_flops = 2 * linear(32, 128, 256) + 3 * linear(32, 256, 10)
    assert figures["flops_per_step"] == step_flops
    window = snapshot["window"]
    seconds, tolerance = loop_clock(starts, window)
    assert window["steps"] == window["last_step"] - window["first_step"] + 1 >= 90
    assert figures["achieved_flops_per_second"] == pytest.approx(step_flops * window["steps"] / seconds, rel=tolerance)
    gauge = [line for line in metrics.splitlines() if line.startswith("tuneup_step_flops{")]
    assert len(gauge) == 1 and float(gauge[0].split()[-1]) == step_flops
    assert "tuneup_achieved_flops_per_second{" in metrics
    assert "tuneup_model_flops_utilization" not in metrics  # no peak for a CPU
    from tuneup.report.summary import compute_lines

    [line, modules] = compute_lines(figures, snapshot["habits"]["flops"])
    assert "FLOP/s achieved; MFU: unknown peak for cpu (float32)" in line
    # The first layer: forward and its weight's gradient, 2 x 2.1 MFLOP; the second 3 x 164 kFLOP.
    assert modules.strip() == "FLOPs by module: Sequential.0 (Linear) 90%, Sequential.2 (Linear) 10%"
    text = json.dumps(snapshot["habits"]["flops"])
    assert "NaN" not in text


def test_mfu_is_achieved_over_the_datasheet_peak_for_the_precision():
    # A recorded count of a bf16 step on an H100 SXM (its name as torch gives it).
    counted_step = {"flops": 2.0e12, "dtype": "bfloat16", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
                    "counts": 1}
    window = {"steps_per_second": 100.0, "backward_passes_per_step": 1.0}
    figures = utilization(counted_step, window)
    assert figures["achieved_flops_per_second"] == 2.0e14
    assert figures["peak_flops_per_second"] == pytest.approx(989.4e12)
    assert figures["mfu"] == pytest.approx(2.0e14 / 989.4e12)
    assert "h100" in figures["peak_source"].lower()
    # PCIe and NVL parts are told apart from SXM; TF32 and fp32 have their own peaks; unknown is None.
    assert peak("NVIDIA H100 PCIe", "bfloat16")["flops_per_second"] == pytest.approx(756.5e12)
    assert peak("NVIDIA A100-SXM4-80GB", "tf32")["flops_per_second"] == pytest.approx(156e12)
    assert peak("NVIDIA A100-SXM4-80GB", "float32")["flops_per_second"] == pytest.approx(19.5e12)
    assert peak("Tesla T4", "bfloat16") is None  # no bf16 on Turing
    assert peak("Some Future GPU", "bfloat16") is None
    assert utilization(dict(counted_step, device_name="Some Future GPU"), window)["mfu"] is None


# --- energy per step (NVML) ----------------------------------------------------------------------

FAKE = "tests.fake_nvml"


@pytest.fixture
def fake_gpus():
    from tests import fake_nvml

    fake_nvml.reset(own_gpu=0)
    yield fake_nvml
    fake_nvml.reset()


def energy_run(run_dir, **options):
    """A CPU loop of 30 ms steps (a sleep) with GPU samples every 50 ms: the snapshot, and the
    loop's own clock (each iteration's start, and its end)."""
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    starts = []
    with tuneup.attach(run_dir=run_dir, interval=0.05, port=0, **options) as agent:
        for _ in range(40):
            starts.append(time.perf_counter())
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            time.sleep(0.03)
        starts.append(time.perf_counter())
    return agent.snapshot(), starts


def test_energy_per_step_comes_from_the_energy_counter(run_dir, fake_gpus):
    snapshot, starts = energy_run(run_dir, nvml_module=FAKE)
    spent = snapshot["energy"]
    # Ground truth: the fake counter rises 350 J a second on each GPU (the job holds memory on
    # GPU 0 only), over the loop's own time per step; its batch is 4.
    assert spent["source"] == "NVML energy counter" and spent["gpus"] == 1
    assert spent["watts"] == pytest.approx(350, rel=0.01)
    window = snapshot["window"]
    seconds, tolerance = loop_clock(starts, window)
    assert spent["joules_per_step"] == pytest.approx(350 * seconds / window["steps"], rel=tolerance + 0.01)
    assert spent["joules_per_sample"] == pytest.approx(350 * seconds / window["steps"] / 4, rel=tolerance + 0.01)
    from tuneup.report.summary import energy_line

    line = energy_line(spent)
    assert line.startswith(f"Energy: {spent['joules_per_step']:.3g} J a step") and line.endswith(
        f"(1 GPU at {spent['watts']:.0f} W, NVML energy counter)")


def test_without_the_counter_energy_is_power_times_time_and_says_so(run_dir, fake_gpus):
    fake_gpus.reset(no_energy=True)
    snapshot, _ = energy_run(run_dir, nvml_module=FAKE)
    spent = snapshot["energy"]
    # Ground truth: the job holds memory on both fake GPUs, each drawing 350 W.
    assert spent["source"] == "power draw x time (an estimate)" and spent["gpus"] == 2
    assert spent["watts"] == pytest.approx(700)


def test_without_nvml_there_is_no_energy_figure(run_dir):
    snapshot, _ = energy_run(run_dir, nvml_module="tuneup_missing_pynvml")
    assert snapshot["energy"] is None


@pytest.mark.gpu
def test_mfu_of_a_bf16_transformer_block_on_cuda_matches_the_figure_by_hand(run_dir):
    import time

    batch, length, dim = 32, 256, 1024
    model = Block(dim=dim, heads=16, length=length).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, length, dim, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    steps = 300
    with tuneup.attach(run_dir=run_dir, port=0) as agent:
        for step in range(steps):
            if step == steps - 200:
                torch.cuda.synchronize()
                began = time.perf_counter()
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - began) / 200
        snapshot = agent.snapshot()
    rows = batch * length
    forward = (linear(rows, dim, 3 * dim) + 2 * (2 * batch * length * length * dim) + linear(rows, dim, dim)
               + linear(rows, dim, 4 * dim) + linear(rows, 4 * dim, dim) + linear(batch, dim * length, 10))
    by_hand_flops = 3 * forward
    figures = snapshot["flops"]
    assert figures["precision"] == "bfloat16", figures
    assert figures["flops_per_step"] == pytest.approx(by_hand_flops, rel=0.02)
    device_peak = peak(torch.cuda.get_device_name(), "bfloat16")
    if device_peak is None:
        pytest.skip(f"no peak for {torch.cuda.get_device_name()}: MFU unknown (achieved FLOP/s only)")
    by_hand = by_hand_flops / seconds / device_peak["flops_per_second"]
    print(f"\nfigure: MFU on {torch.cuda.get_device_name()}: tuneup {figures['mfu']:.1%}, by hand {by_hand:.1%} "
          f"({by_hand_flops / 1e9:.1f} GFLOP a step, {seconds * 1e3:.2f} ms a step)")
    assert figures["mfu"] == pytest.approx(by_hand, rel=0.15)


def test_the_gpu_work_line_says_the_span_and_what_nvml_saw_run():
    # Recorded on an H100: a launch-bound transformer's kernels spanned 20.8 ms of a 21.7 ms
    # step while NVML saw a kernel running 32% of the time.
    from tuneup.report.summary import gpu_work_line, work_lines

    step = {"median": 0.0217}
    snapshot = {"window": {"gpu_seconds": {"median": 0.0208}, "step_seconds": step},
                "gpu_history": {"devices": [{"gpu": 0, "samples": 30, "utilization_ratio": 0.32}]}}
    line = gpu_work_line(snapshot)
    assert line == ("GPU work: the step's kernels span 20.8 ms of a 21.7 ms step (96%); NVML saw a kernel running "
                    "32% of the time: the rest of the span is the GPU waiting for the host (launches, syncs)")
    assert line in work_lines(snapshot)
    snapshot["gpu_history"]["devices"][0]["utilization_ratio"] = 0.93  # busy by both: no gaps said
    assert gpu_work_line(snapshot).endswith("NVML saw a kernel running 93% of the time")
    assert gpu_work_line({"window": {"step_seconds": step}}) is None  # a CPU job: no line


# --- the precision read off the live step --------------------------------------------------------

def precision_switch_run(run_dir, switch):
    """A loop whose precision changes at step 100 (`switch(model)` returns the autocast to enter
    from then on, or None), the input's shapes never: snapshots before and after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(8 * 32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (16, 8), generator=generator), torch.randint(0, 10, (16,), generator=generator)
    snapshots, context = [], None
    with tuneup.attach(run_dir=run_dir, port=0) as agent:
        for step in range(300):
            if step == 100:
                snapshots.append(agent.snapshot())
                context = switch(model)
            optimizer.zero_grad()
            with context if context is not None else contextlib.nullcontext():
                logits = model(tokens)
            nn.functional.cross_entropy(logits.float(), labels).backward()
            optimizer.step()
        snapshots.append(agent.snapshot())
    return snapshots


@pytest.mark.parametrize("switch", ["autocast", "parameters"])
def test_a_precision_turned_on_mid_run_is_the_one_reported_without_a_recount(switch, run_dir):
    # Ground truth: the loop's own switch at step 100, bf16 autocast around the forward or the
    # model's parameters cast to bf16 (its token input unchanged: the same signature).
    if switch == "autocast":
        turn_on = lambda model: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    else:
        turn_on = lambda model: model.to(torch.bfloat16) and None  # noqa: E731
    before, after = precision_switch_run(run_dir, turn_on)
    assert before["habits"]["flops"]["dtype"] == "float32" and before["flops"]["precision"] == "float32"
    found = after["habits"]["flops"]
    assert found["dtype"] == "bfloat16" and after["flops"]["precision"] == "bfloat16", found
    assert found["counts"] == 1  # the shapes never changed: the FLOPs are not counted again
    assert after["flops"]["flops_per_step"] == before["flops"]["flops_per_step"]


# --- precision by kind of FLOP: TF32 for matmuls and convolutions, fp8 ----------------------------

def test_convolutions_and_matmuls_are_counted_apart(run_dir):
    # The conv net of the analytic test: its two convolutions' FLOPs (forward, the second's
    # input gradient, both weights') and its Linear head's, from the layer shapes.
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                          nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    _, agent = train(model, fixed((8, 3, 16, 16)), 80, agent_options=dict(run_dir=run_dir, port=0))
    found = counted(agent)
    conv1, conv2 = 2 * (8 * 8 * 16 * 16) * 3 * 9, 2 * (8 * 16 * 16 * 16) * 8 * 9
    head = linear(8, 16 * 16 * 16, 10)
    assert found["flops_by_kind"]["conv"] == pytest.approx(2 * conv1 + 3 * conv2, rel=0.02)
    assert found["flops_by_kind"]["matmul"] == pytest.approx(3 * head, rel=0.02)
    assert sum(found["flops_by_kind"].values()) == found["flops"]
    assert found["precisions"] == {"conv": "float32", "matmul": "float32"}  # a CPU: no TF32


def test_tf32_is_read_per_kind_from_torchs_own_flags():
    # torch's defaults (torch/backends/cudnn/__init__.py: allow_tf32=True; the matmul precision
    # "highest"): fp32 convolutions may use TF32, fp32 matmuls may not. The flags are global and
    # readable on a CPU build; each is set back.
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.conv.fp32_precision
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        assert (tf32_allowed("matmul"), tf32_allowed("conv")) == (False, True)
        torch.set_float32_matmul_precision("high")  # the legacy API: matmul's fp32_precision "tf32"
        torch.backends.cudnn.allow_tf32 = False  # the legacy API: conv's "none", inherited IEEE
        assert (tf32_allowed("matmul"), tf32_allowed("conv")) == (True, False)
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # the new API
        assert tf32_allowed("conv") is True
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.conv.fp32_precision = conv


def test_mfu_divides_by_the_flop_weighted_peak_of_the_kinds():
    # A recorded count on an A100: fp32 matmuls (TF32 disallowed for them) beside TF32
    # convolutions, 1 and 3 TFLOP a step; 10 steps a second. Ground truth: the datasheet's
    # 19.5 TF FP32 and 156 TF TF32; the time the FLOPs take at those peaks.
    counted_step = {"flops": 4.0e12, "flops_by_kind": {"matmul": 1.0e12, "conv": 3.0e12},
                    "precisions": {"matmul": "float32", "conv": "tf32"}, "dtype": "tf32+float32",
                    "device": "cuda", "device_name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0], "counts": 1}
    figures = utilization(counted_step, {"steps_per_second": 10.0, "backward_passes_per_step": 1.0})
    seconds_at_peak = 1.0e12 / 19.5e12 + 3.0e12 / 156e12
    assert figures["peak_flops_per_second"] == pytest.approx(4.0e12 / seconds_at_peak)
    assert figures["mfu"] == pytest.approx(4.0e13 * seconds_at_peak / 4.0e12)
    from tuneup.report.summary import compute_lines

    [line] = compute_lines(figures, {})
    assert line.endswith("dense tf32+float32 peak (FLOP-weighted: convolutions tf32 75%, matmuls float32 25%)"), line
    # One kind's peak unknown (no fp8 on an A100): the step's is unknown, not the others' alone.
    fp8 = dict(counted_step, flops_by_kind={"matmul": 1.0e12, "fp8": 3.0e12}, precisions={"matmul": "bfloat16", "fp8": "fp8"})
    assert utilization(fp8, {"steps_per_second": 10.0})["mfu"] is None


def test_tf32_on_a_device_without_tf32_is_its_fp32_peak():
    # V100 and T4 (compute capability 7.0, 7.5) have no TF32 units: fp32 with TF32 allowed runs
    # in FP32 (the datasheets' 15.7 and 8.1 TF single precision).
    assert peak("Tesla V100-SXM2-16GB", "tf32", (7, 0))["flops_per_second"] == pytest.approx(15.7e12)
    assert peak("Tesla T4", "tf32", (7, 5))["flops_per_second"] == pytest.approx(8.1e12)
    assert peak("Tesla T4", "tf32")["flops_per_second"] == pytest.approx(8.1e12)  # a record without one
    assert peak("NVIDIA A100-SXM4-80GB", "tf32", (8, 0))["flops_per_second"] == pytest.approx(156e12)


class Float8Linear(nn.Module):
    """A Linear whose matmuls run in fp8 (as torchao's Float8Linear): operands cast to float8
    with unit scales, torch._scaled_mm forward and for both gradients (e4m3 operands, e5m2 for
    the gradient), bf16 out."""

    class _Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(x, weight)
            one = torch.ones((), device=x.device)
            a, b = x.to(torch.float8_e4m3fn), weight.to(torch.float8_e4m3fn)
            return torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16).float()

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            one = torch.ones((), device=x.device)
            g = grad.to(torch.float8_e5m2)
            w = weight.to(torch.float8_e4m3fn).t().contiguous().t()
            grad_x = torch._scaled_mm(g, w, one, one, out_dtype=torch.bfloat16).float()
            xt = x.to(torch.float8_e4m3fn).t().contiguous()
            grad_w = torch._scaled_mm(g.t().contiguous(), xt.t(), one, one, out_dtype=torch.bfloat16).float()
            return grad_x, grad_w

    def __init__(self, inputs, outputs):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs ** 0.5)

    def forward(self, x):
        return self._Matmul.apply(x, self.weight)


def test_fp8_matmuls_are_told_apart_and_take_the_fp8_peak(run_dir):
    # x (32, 64) -> fp8 Linear 64->128 -> ReLU -> Linear 128->10 in fp32: the fp8 layer's
    # forward and both gradients are 3 fp8 matmuls of 2*32*64*128; the head's forward and its
    # two gradients fp32 matmuls.
    model = nn.Sequential(Float8Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    _, agent = train(model, fixed((32, 64)), 80, agent_options=dict(run_dir=run_dir, port=0))
    found = counted(agent)
    assert found["flops_by_kind"]["fp8"] == pytest.approx(3 * linear(32, 64, 128), rel=0.02)
    assert found["flops_by_kind"]["matmul"] == pytest.approx(3 * linear(32, 128, 10), rel=0.02)
    assert found["precisions"] == {"fp8": "fp8", "matmul": "float32"} and found["dtype"] == "fp8+float32"
    # The same count on an H100 SXM: fp8 matmuls at the whitepaper's 1978.9 TF, the rest at 66.9 TF FP32.
    on_h100 = dict(found, device="cuda", device_name="NVIDIA H100 80GB HBM3", capability=[9, 0])
    kinds = found["flops_by_kind"]
    expected = sum(kinds.values()) / (kinds["fp8"] / 1978.9e12 + kinds["matmul"] / 66.9e12)
    assert utilization(on_h100, {"steps_per_second": 1.0})["peak_flops_per_second"] == pytest.approx(expected)


def test_the_peak_table_matches_name_and_compute_capability_and_cites_each_rows_source():
    from tuneup.measure.utilization import PEAKS

    # The V100S (its own row, NVIDIA's V100 specifications: 16.4 TF single precision, 130 TF
    # tensor), not the V100 PCIe's 14 and 112 its name also fits.
    assert peak("Tesla V100S-PCIE-32GB", "float32", (7, 0))["flops_per_second"] == pytest.approx(16.4e12)
    assert peak("Tesla V100S-PCIE-32GB", "float16", (7, 0))["flops_per_second"] == pytest.approx(130e12)
    assert peak("Tesla V100-PCIE-16GB", "float16", (7, 0))["flops_per_second"] == pytest.approx(112e12)
    # A name that fits a row of another architecture is not given that row's peak.
    assert peak("NVIDIA A100-SXM4-80GB", "bfloat16", (9, 0)) is None
    assert peak("NVIDIA A100-SXM4-80GB", "bfloat16", (8, 0))["flops_per_second"] == pytest.approx(312e12)
    # Every row carries a capability; the H100 SXM row's figures are the Hopper whitepaper's
    # (66.9/494.7/989.4/1978.9), cited as such, and the H200's its datasheet's halved sparse ones.
    assert all(len(capability) == 2 for _, capability, _, _ in PEAKS)
    h100 = peak("NVIDIA H100 80GB HBM3", "tf32", (9, 0))
    assert h100["flops_per_second"] == pytest.approx(494.7e12) and "whitepaper" in h100["source"].lower()
    h200 = peak("NVIDIA H200", "fp8", (9, 0))
    assert h200["flops_per_second"] == pytest.approx(3958e12 / 2) and "h200" in h200["source"].lower()
    for name, precision in (("NVIDIA H100 PCIe", "fp8"), ("NVIDIA H100 NVL", "bfloat16"), ("NVIDIA H200 NVL", "tf32")):
        assert "datasheet" in peak(name, precision, (9, 0))["source"]


# --- every report format and /metrics, from real runs ----------------------------------------------

REPORTED_JOB = """
import json, sys, time
import torch
from torch import nn
import tuneup

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))
starts = []
with tuneup.attach():
    for _ in range(150):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        time.sleep(0.02)
    starts.append(time.perf_counter())
with open(sys.argv[1], "w") as out:
    json.dump(starts, out)
"""


@pytest.fixture(scope="module", params=["counter", "no counter"])
def reported_run(request, tmp_path_factory):
    """A finished job's run directory and its loop's own clock: the MLP of the CPU test, 20 ms
    steps, on the fake NVML (the job's memory on GPU 0), whose GPU has an energy counter or not."""
    import subprocess
    import sys

    from tests.conftest import child_env

    folder = tmp_path_factory.mktemp("reported")
    (folder / "job.py").write_text(REPORTED_JOB)
    env = child_env(TUNEUP_RUN_DIR=str(folder / "run"), TUNEUP_INTERVAL="0.1", TUNEUP_NVML_MODULE=FAKE,
                    FAKE_NVML_OWN_GPU="0", FAKE_NVML_NO_ENERGY="1" if request.param == "no counter" else None)
    result = subprocess.run([sys.executable, str(folder / "job.py"), str(folder / "starts.json")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return request.param, folder / "run", json.loads((folder / "starts.json").read_text())


def test_every_report_format_states_the_flops_achieved_flops_mfu_and_energy(reported_run, tmp_path):
    import html

    from tests.test_cli import tuneup as cli
    from tuneup.format import flops as flop_text

    counter, run_dir, starts = reported_run
    result = cli("report", str(run_dir), "--format", "json")
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)["runs"][0]["snapshot"]
    # Ground truth: the layer shapes' FLOPs, the loop's own clock over the report's window, the
    # fake GPU's 350 W (its counter's rise, or its power draw), the batch of 32.
    forward = linear(32, 128, 256) + linear(32, 256, 10)
    backward = linear(32, 128, 256) + 2 * linear(32, 256, 10)
    window = snapshot["window"]
    seconds, tolerance = loop_clock(starts, window)
    figures, spent = snapshot["flops"], snapshot["energy"]
    assert figures["flops_per_step"] == forward + backward
    assert figures["achieved_flops_per_second"] == pytest.approx((forward + backward) * window["steps"] / seconds,
                                                                 rel=tolerance)
    assert figures["mfu"] is None and figures["peak_flops_per_second"] is None
    source = "NVML energy counter" if counter == "counter" else "power draw x time (an estimate)"
    assert spent["source"] == source and spent["gpus"] == 1 and spent["watts"] == pytest.approx(350, rel=0.01)
    assert spent["joules_per_step"] == pytest.approx(350 * seconds / window["steps"], rel=tolerance + 0.01)
    assert spent["joules_per_sample"] == pytest.approx(spent["joules_per_step"] / 32)
    compute = (f"Compute: {flop_text(forward + backward)} a step (forward {flop_text(forward)} + backward "
               f"{flop_text(backward)} a batch of 32, counted on Sequential's shapes), "
               f"{flop_text(figures['achieved_flops_per_second'], 'FLOP/s')} achieved; MFU: unknown peak for cpu (float32)")
    modules = "FLOPs by module: Sequential.0 (Linear) 90%, Sequential.2 (Linear) 10%"
    energy = (f"Energy: {spent['joules_per_step']:.3g} J a step, {spent['joules_per_sample']:.3g} J a sample "
              f"(1 GPU at {spent['watts']:.0f} W, {source})")  # (350 W within 1%, above: 349 W in a full suite)
    text = cli("report", str(run_dir))
    markdown = cli("report", str(run_dir), "--format", "markdown")
    output = tmp_path / "report.html"
    page = cli("report", str(run_dir), "--format", "html", "-o", str(output))
    assert text.returncode == markdown.returncode == page.returncode == 0, (text.stderr, markdown.stderr, page.stderr)
    flat = " ".join(text.stdout.split())  # the text report wraps its lines
    for line in (compute, modules, energy):
        assert line in flat, (line, text.stdout)
        assert f"- {line}\n" in markdown.stdout, (line, markdown.stdout)
        assert html.escape(line) in output.read_text(), line


def test_metrics_state_the_flops_mfu_and_each_gpus_energy_counter_and_pass_promtool(run_dir, fake_gpus, monkeypatch):
    """Two fake GPUs the job holds memory on, GPU 0 with an energy counter, GPU 1 without (a
    node that mixes them). There is no CUDA device here: the count is said to be on an H100
    and the step in bf16 (torch.cuda's name and the forward's precision stood in, as
    tests/programs/export_job.py --fake-device does), so the MFU gauge has a peak."""
    import shutil
    import subprocess

    from tuneup.export.metrics import COMPUTE_WINDOW

    fake_gpus.reset(no_energy={1})
    counted = flops_module.FlopCount._count
    monkeypatch.setattr(flops_module.FlopCount, "_count", lambda self, *args: dict(
        counted(self, *args), device="cuda", device_name="NVIDIA H100 80GB HBM3", capability=[9, 0]))
    monkeypatch.setattr(flops_module, "_step_precision", lambda module, parameter: {"matmul": "bfloat16",
                                                                                      "conv": "bfloat16"})
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))
    starts = []
    with tuneup.attach(run_dir=run_dir, interval=0.05, port=0, nvml_module=FAKE) as agent:
        for _ in range(400):  # the gauges' window (COMPUTE_WINDOW steps) past the count at step 65
            starts.append(time.perf_counter())
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            time.sleep(0.003)
        starts.append(time.perf_counter())
        time.sleep(0.2)  # a few samples after the last step
        began = time.monotonic()
        with urllib.request.urlopen(f"{agent.server.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        ended = time.monotonic()
        window = agent.recorder.window(COMPUTE_WINDOW)
        spent = agent.snapshot()["energy"]

    def value(name, **labels):
        found = [line for line in metrics.splitlines() if line.startswith(name + "{")
                 and all(f'{key}="{wanted}"' in line for key, wanted in labels.items())]
        assert len(found) <= 1, found
        return float(found[0].split()[-1]) if found else None

    step_flops = 2 * linear(32, 128, 256) + 3 * linear(32, 256, 10)
    seconds, tolerance = loop_clock(starts, window)
    assert value("tuneup_step_flops") == step_flops
    achieved = value("tuneup_achieved_flops_per_second")
    assert achieved == pytest.approx(step_flops * window["steps"] / seconds, rel=tolerance)
    # The Hopper whitepaper's 989.4 TF dense bf16 for the H100 SXM.
    assert value("tuneup_model_flops_utilization", precision="bfloat16") == pytest.approx(achieved / 989.4e12)
    # GPU 0's counter: the fake's millijoules since its driver loaded (9e9 + 350 W x monotonic
    # time) as joules, read by a sample of the last second before the scrape; GPU 1 has none
    # (absent, not 0), though its power is read.
    joules = value("tuneup_gpu_energy_joules_total", gpu="0")
    assert 9e6 + 350 * (began - 1.0) <= joules <= 9e6 + 350 * ended
    assert value("tuneup_gpu_energy_joules_total", gpu="1") is None
    assert value("tuneup_gpu_power_watts", gpu="1") == 350
    # The figure over both: GPU 0's counter and GPU 1's power draw, an estimate as one of them is.
    assert spent["gpus"] == 2 and spent["watts"] == pytest.approx(700, rel=0.01)
    assert spent["source"] == "power draw x time (an estimate)"
    if shutil.which("promtool"):
        checked = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_is_not_counted_and_the_report_says_why(how, run_dir):
    # Its graphs run the step, not its forward (recorder.py _lifecycle): no count, a reason.
    from tuneup.report.summary import compute_lines

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    if how == "torch.compile(model)":
        model = torch.compile(model, backend="eager")
    else:
        model.compile(backend="eager")
    losses, agent = train(model, fixed((16, 32)), 80, agent_options=dict(run_dir=run_dir, port=0))
    torch._dynamo.reset()
    assert len(losses) == 80  # it trained, compiled
    reason = "the model is compiled (its graphs run the step, not its forward)"
    assert agent.snapshot()["habits"]["flops"] == {"skipped": reason}
    assert agent.snapshot()["flops"] == {"skipped": reason}
    assert compute_lines(agent.snapshot()["flops"], agent.snapshot()["habits"]["flops"]) == [
        f"Compute: FLOPs not counted: {reason}"]


def test_a_large_models_count_is_a_run_log_record_readers_keep(run_dir):
    """A 7B-parameter language model's step on 32,768 tokens is about 6 x 7e9 x 32,768 = 1.4e15
    FLOPs (2 a parameter a token forward, 4 backward): over the run log's 1e15 bound for amounts
    (records.LIMIT: "larger is damage"), which dropped the whole steps record holding it."""
    from tuneup import records

    _, agent = train(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), fixed((16, 32)), 80,
                     agent_options=dict(run_dir=run_dir, port=0))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["event"] == "steps" and ((e.get("habits") or {}).get("flops") or {}).get("flops")][-1:]
    assert records.problem(event) is None
    found = event["habits"]["flops"]
    scale = 6 * 7e9 * 32768 / found["flops"]
    for key in ("forward_flops", "backward_flops", "flops"):
        found[key] *= scale
    found["flops_by_kind"] = {kind: flops * scale for kind, flops in found["flops_by_kind"].items()}
    for module in found["top_modules"]:
        module["flops"] *= scale
    assert found["flops"] > records.LIMIT
    assert records.problem(event) is None
