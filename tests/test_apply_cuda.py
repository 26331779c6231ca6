"""Apply mode on real CUDA jobs: AMP, pin_memory and cudnn.benchmark decided by measurement,
and the AMP guard's rollback with no update applied, on the GPU.

Run on a GPU machine: `python -m pytest -m gpu`. Skipped where CUDA is absent.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_apply_cuda import run_job

pytestmark = pytest.mark.gpu
DECIDED = {"kept", "reverted", "rolled back", "set at start"}


def decisions(records, action):
    return [record for record in records if record["action"] == action and record["decision"] in DECIDED]


def keep_agent(agents):
    def on_step(step, loss, model, agent):
        if not agents:
            agents.append(agent)
        return loss

    return on_step


def amp_decided_or_measured_not_worth_it(records, agent) -> None:
    """AMP is tried where the amp-off rule found autocast measurably faster on the job's model
    (measure/precision.py); where it did not (on an H100 this conv net ran 0.99x in bf16: its
    fp32 convolutions already use TF32), no trial, but a measured reason."""
    if decisions(records, "amp"):
        return
    assert "amp-off" not in {f["rule"] for f in agent.findings()}, records
    trial = agent.snapshot()["habits"]["amp_trial"]
    assert trial and trial.get("fp32_seconds") and trial.get("pairs"), trial


def test_a_conv_net_gets_amp_pinned_memory_and_cudnn_benchmark_decided(run_dir):
    torch.backends.cudnn.benchmark = False
    agents = []
    _, records, model = run_job("conv net", 1500, "apply", run_dir, on_step=keep_agent(agents))
    assert not [r for r in records if r["decision"] == "failed"], records
    assert decisions(records, "cudnn-benchmark"), records
    amp_decided_or_measured_not_worth_it(records, agents[0])
    pinned = [r for r in decisions(records, "dataloader") if r["after"].get("pin_memory")]
    assert pinned, records
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.backends.cudnn.benchmark is False  # detach put the job's setting back


def test_each_decided_change_states_the_gpus_energy_a_step_from_nvml(run_dir):
    """On a GPU with NVML's energy counter (Volta and newer): every change judged on its windows
    says what a step cost in joules before and after, at a power the GPU can draw."""
    pytest.importorskip("pynvml")
    _, records, _ = run_job("conv net", 1500, "apply", run_dir)
    judged = [r for r in records if r.get("trial") and r.get("baseline")]
    assert judged, records
    for record in judged:
        energy = record.get("energy")
        assert energy, record
        assert 10 < energy["before_watts"] < 2000 and 10 < energy["after_watts"] < 2000, energy
        for side, window in (("before", record["baseline"]), ("after", record["trial"])):
            assert energy[f"{side}_joules_per_step"] == pytest.approx(
                energy[f"{side}_watts"] * window["mean_step_seconds"], rel=0.3), (energy, window)


def test_a_transformer_gets_bf16_autocast_decided_by_measurement(run_dir):
    _, records, model = run_job("transformer", 800, "apply", run_dir)
    [amp] = decisions(records, "amp")
    assert amp["after"]["autocast"] == "cuda bfloat16"
    assert amp["speedup"] > 0 and amp["baseline"]["step_seconds"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nonfinite_loss_under_amp_on_cuda_skips_that_update_and_rolls_back(run_dir):
    state = {}

    def poison(step, loss, model, agent):
        trying = [r for r in agent.actions() if r["action"] == "amp" and r["decision"] == "trying"]
        if trying and "step" not in state and step > trying[0]["applied_step"] + 2:
            state["step"] = step
            state["params"] = [p.detach().clone() for p in model.parameters()]
            return loss * float("nan")
        if state.get("step") == step - 1:
            state["after"] = [p.detach().clone() for p in model.parameters()]
        return loss

    _, records, model = run_job("transformer", 600, "apply", run_dir, on_step=poison)
    [amp] = [r for r in records if r["action"] == "amp"]
    assert amp["decision"] == "rolled back" and "update was skipped" in amp["reason"], amp
    assert all(torch.equal(a, b) for a, b in zip(state["params"], state["after"]))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_amp_guards_read_is_not_blamed_on_the_users_optimizer_step(run_dir):
    # The loop (bench_apply_cuda.run_job) reads nothing on the host; during AMP's guard period
    # tuneup checks the gradients are finite (one device read per update): tuneup's, not a sync
    # of the `optimizer.step()` line.
    import inspect

    from benchmarks import bench_apply_cuda

    agents = []

    def keep(step, loss, model, agent):
        if not agents:
            agents.append(agent)
        return loss

    _, records, _ = run_job("transformer", 800, "apply", run_dir, on_step=keep)
    assert decisions(records, "amp"), records
    lines, first = inspect.getsourcelines(bench_apply_cuda.run_job)
    step_line = first + next(i for i, line in enumerate(lines) if "optimizer.step()" in line)
    sources = agents[0].snapshot()["syncs"]["top_sources"]
    assert not [s for s in sources if s["location"].endswith(f"bench_apply_cuda.py:{step_line}")], sources


def test_cudnn_benchmark_is_set_before_the_first_convolution_on_the_gpu(run_dir):
    torch.backends.cudnn.benchmark = False
    seen = []

    def first_conv(step, loss, model, agent):
        if not seen:
            seen.append(torch.backends.cudnn.benchmark)
        return loss

    _, records, _ = run_job("conv net", 200, "apply", run_dir, on_step=first_conv)
    [cudnn] = [r for r in records if r["action"] == "cudnn-benchmark"]
    assert cudnn["decision"] == "set at start" and cudnn["applied_step"] == 1, records
    assert seen == [True]  # on during the first step's convolutions
    assert torch.backends.cudnn.benchmark is False  # detach put the job's setting back
