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
from benchmarks.bench_compile_action import Pointwise
from tuneup.options import parse_actions


def train(steps: int, options: dict | None = None, *, hook: bool = False, compiled: bool = False, after=None):
    """A loop over in-memory batches; returns (losses, model, agent). `after(step, agent, model)`
    runs after each step; the loop ends early when it returns True."""
    torch.manual_seed(0)
    model = Pointwise()
    if hook:
        model.register_forward_hook(lambda module, args, output: None)
    trained = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
