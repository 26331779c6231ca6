"""Apply mode's compile action (opt-in): model.compile() in place as a measured experiment,
refused where it is not safe, rolled back (the job never seeing it) when compiling fails."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tuneup
from tuneup.act.actions import DEFAULT_ACTIONS
from tuneup.act.actions.compile import CompileChange
from tuneup.act.judge import MIN_SPEEDUP
from benchmarks.bench_compile_action import Pointwise
from tuneup.options import parse_actions


def train(steps: int, options: dict | None = None, *, hook: bool = False, compiled: bool = False, wrap=None,
          after=None):
    """A loop over in-memory batches; returns (losses, model, agent). `wrap(model)`: the module
    the loop trains instead (a DDP or TorchScript one). `after(step, agent, model)` runs after
    each step; the loop ends early when it returns True."""
    torch.manual_seed(0)
    model = Pointwise()
    if hook:
        model.register_forward_hook(lambda module, args, output: None)
    trained = torch.compile(model) if compiled else wrap(model) if wrap is not None else model
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    data = [(torch.randn(64, 256), torch.randn(64, 1)) for _ in range(8)]
    agent = tuneup.attach(**options) if options is not None else None
    losses = []
    try:
        for step in range(steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(trained(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if after is not None and after(step, agent, model):
                break
    finally:
        if agent is not None:
            agent.detach()
    return losses, model, agent


def apply_options(run_dir, **extra):
    return dict(mode="apply", run_dir=run_dir, interval=0.2, cpu_bf16=False, actions=["compile"], **extra)


def compile_records(agent):
    return [r for r in agent.actions() if r["action"] == "compile"]


def decided(step, agent, model):
    """Ends the loop once the compile action has a verdict: when it starts depends on the live
    findings (evaluated every `interval` seconds) and its trial on the step time."""
    return any(r["decision"] != "trying" for r in compile_records(agent))


def test_compile_is_taken_only_by_name():
    assert "compile" not in DEFAULT_ACTIONS and "compile" not in parse_actions("all")
    assert parse_actions("all,compile") == DEFAULT_ACTIONS + ("compile",)
    with pytest.raises(ValueError, match="only by name: compile"):
        parse_actions("compiler")


def test_a_failing_compile_rolls_back_and_the_job_runs_as_eager(run_dir, monkeypatch):
    """A backend that fails (a missing C compiler, an unsupported op): that call and every one
    after run eagerly, so the losses are exactly the eager job's, and the change is rolled back."""
    def broken(graph_module, example_inputs):
        raise RuntimeError("no C compiler on this machine")

    monkeypatch.setattr(CompileChange, "backend", staticmethod(broken))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, model, agent = train(6000, apply_options(run_dir), after=decided)
    plain, _, _ = train(len(losses))
    [record] = compile_records(agent)
    assert record["decision"] == "rolled back", record
    assert "torch.compile failed" in record["reason"] and "no C compiler" in record["reason"]
    assert losses == plain
    assert getattr(model, "_compiled_call_impl", None) is None


class MultiTask(nn.Module):
    """One trunk and a head per task, the task named by the loop at each call (multi-task
    fine-tuning: `model(x, task)`, a ModuleDict of heads). Compiled, each new name is a new
    guard (`task == 'task3'`): a string is never made dynamic, so every task recompiles the
    forward, up to torch._dynamo.config.recompile_limit (8) compilations of it."""

    def __init__(self, tasks: int) -> None:
        super().__init__()
        self.trunk = Pointwise(depth=2)
        self.heads = nn.ModuleDict({f"task{index}": nn.Linear(1, 1) for index in range(tasks)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def test_a_model_that_keeps_recompiling_once_compiled_is_rolled_back(run_dir, monkeypatch):
    """Ground truth from the loop: 12 tasks in turn, one a step, so once apply mode compiles
    the model each of its next steps names a task its graphs have not seen: the forward
    recompiles at every step until dynamo's recompile_limit, each compile with its backward's.
    That is more than MAX_COMPILES compilations in the trial: rolled back with that reason,
    the model eager again. (aot_eager: dynamo's and AOTAutograd's compilations, forward and
    backward, without inductor's C++ builds, which take seconds each on a busy machine.)"""
    from tuneup.act.actions.compile import MAX_COMPILES

    monkeypatch.setattr(CompileChange, "backend", "aot_eager")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MultiTask(12)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    agent = tuneup.attach(**apply_options(run_dir))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's recompile_limit warning
            for step in range(6000):
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x, f"task{step % 12}"), y).backward()
                optimizer.step()
                if decided(step, agent, model):
                    break
    finally:
        agent.detach()
        torch._dynamo.reset()
    [record] = compile_records(agent)
    assert record["decision"] == "rolled back", record
    compiles = int(record["reason"].split("compiled ", 1)[1].split(" times", 1)[0])
    assert compiles > MAX_COMPILES and "during its trial: something the graph depends on keeps changing" \
        in record["reason"], record
    assert getattr(model, "_compiled_call_impl", None) is None


def test_compile_is_judged_and_leaves_nothing_when_undone(run_dir):
    """Compiled for real (inductor): decided on the judge's terms, its compile steps out of the
    trial; after detach the model runs eagerly again, as torch's own. The trial lasts about a
    second of steps (up to 1,200 of this ~0.3 ms step on an idle machine, fewer on a busy one),
    so the job trains until the record is decided."""
    state = {}

    def watch(step, agent, model):
        if getattr(model, "_compiled_call_impl", None) is not None:
            state.setdefault("compiled_at", step)
        return decided(step, agent, model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, model, agent = train(6000, apply_options(run_dir), after=watch)
    [record] = compile_records(agent)
    assert "compiled_at" in state, record
    assert record["decision"] in ("kept", "reverted") and "trial" in record, {k: v for k, v in record.items() if k != "baseline"}
    # The decision is the measured speed-up's, on the judge's terms (act/judge.py: a faster
    # change is kept only where p_faster < the look's alpha and the speed-up >= MIN_SPEEDUP;
    # the loss in band, as fused kernels round differently), whichever it came out here.
    faster = record["speedup"] >= MIN_SPEEDUP and record["p_faster"] < record["alpha"]
    in_band = "loss" not in record["reason"]
    assert (record["decision"] == "kept") == (faster and in_band), record
    assert record["reason"].startswith(f"{record['speedup']:.2f}x") or not in_band, record
    assert record["trial"]["steps"] >= 12 and record["applied_step"] + 5 < record["trial"]["first_step"], record
    assert getattr(model, "_compiled_call_impl", None) is None  # detach undid it (kept or not)
    x = torch.randn(4, 256)
    with torch.no_grad():
        assert torch.equal(model(x), Pointwise.forward(model, x))  # eager, torch's own call


@pytest.mark.parametrize("case, reason", [
    ("hook", "module hooks the job registered"),
    ("compiled", "compiled already"),
])
def test_compile_is_refused_where_it_is_not_safe(run_dir, case, reason):
    _, _, agent = train(6000, apply_options(run_dir), after=decided, **{case: True})
    [record] = compile_records(agent)
    assert record["decision"] == "not applicable" and reason in record["reason"], record


@pytest.mark.parametrize("wrapper, reason", [
    # A distributed job: each rank would keep or roll back on its own (why_not asks this first).
    ("DistributedDataParallel", "a distributed job"),
    # nn.DataParallel in one process (on a CPU it calls the module it wraps).
    ("DataParallel", "DataParallel is a distributed wrapper"),
])
def test_compile_is_refused_for_wrappers_it_does_not_understand(run_dir, request, wrapper, reason):
    """Ground truth: the loop trains the wrapper (DDP on a one-rank gloo group, DataParallel),
    which tuneup finds as the trained model; the compile action refuses it with its one-line
    reason, and nothing is compiled."""
    if wrapper == "DistributedDataParallel":
        request.getfixturevalue("one_rank")
    wrap = {"DistributedDataParallel": nn.parallel.DistributedDataParallel, "DataParallel": nn.DataParallel}[wrapper]
    _, model, agent = train(6000, apply_options(run_dir), wrap=wrap, after=decided)
    [record] = compile_records(agent)
    assert record["decision"] == "not applicable" and reason in record["reason"], record
    assert getattr(model, "_compiled_call_impl", None) is None


def test_a_torchscript_model_is_never_compiled(run_dir):
    """Ground truth: the loop trains `torch.jit.script(model)`. tuneup never takes a ScriptModule
    for a model of its own (measure/model.py ModelProbe._hook_root: no Python wrapper reaches
    its forward and its class refuses module hooks), so the compile action has no model to
    propose: once the rules have run five times (every 0.2 s, each giving apply mode its turn),
    and 60 steps at least, no record and nothing compiled by dynamo (600 fixed steps took 71 s
    of the suite on a slow CPU). (Losses are not compared with a plain run: TorchScript's
    profiling executor, shared by the scripted instances of a class, makes two plain runs in
    one process differ from their third step on.)"""
    from torch._dynamo.utils import counters

    counters.clear()
    losses, model, agent = train(5000, apply_options(run_dir), wrap=torch.jit.script,
                                 after=lambda step, agent, model: step >= 59 and agent.ticker.ticks >= 5)
    assert agent.ticker.ticks >= 5 and agent.snapshot()["totals"]["steps"] == len(losses) >= 60
    assert compile_records(agent) == [] and not counters["frames"], agent.actions()
    assert getattr(model, "_compiled_call_impl", None) is None
