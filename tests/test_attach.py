"""The attach API: one line in, exact restore out, options from code or environment."""

from __future__ import annotations

import re
import time
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tuneup.measure.syncs import HOST_READS

PATCHED = [
    (DataLoader, "__iter__"),
    (_BaseDataLoaderIter, "__next__"),
    (torch.Tensor, "backward"),
    (torch.optim.Optimizer, "zero_grad"),
    (nn.Module, "zero_grad"),
    (torch.amp.GradScaler, "scale"),
    (torch.amp.GradScaler, "step"),
    (torch.amp.GradScaler, "update"),
    (nn.Sequential, "forward"),  # the class of the model the tests train: roots are timed there
    *HOST_READS,
]
MISSING = object()


def state_of_patched():
    return {(owner, name): vars(owner).get(name, MISSING) for owner, name in PATCHED}


def global_hook_counts():
    return (
        len(optimizer_hooks._global_optimizer_pre_hooks),
        len(optimizer_hooks._global_optimizer_post_hooks),
        len(module_hooks._global_forward_pre_hooks),
        len(module_hooks._global_forward_hooks),
    )


def small_job():
    torch.manual_seed(0)
    model = mlp(hidden=32)
    return loader_for(SlowDataset(size=256)), model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_attach_twice_returns_the_same_agent(run_dir):
    first = tuneup.attach(run_dir=run_dir)
    try:
        assert tuneup.attach() is first
        assert tuneup.current() is first
    finally:
        first.detach()
    assert tuneup.current() is None
    second = tuneup.attach(run_dir=run_dir)
    try:
        assert second is not first
    finally:
        second.detach()


def test_context_manager_detaches(run_dir):
    loader, model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir) as agent:
        train(loader, model, optimizer, steps=5)
        assert agent.attached
    assert not agent.attached
    assert agent.snapshot()["totals"]["steps"] == 5


def test_detach_restores_every_patched_object_exactly(run_dir):
    before = state_of_patched()
    hooks_before = global_hook_counts()
    loader, model, optimizer = small_job()
    scaler = torch.amp.GradScaler("cpu")
    agent = tuneup.attach(run_dir=run_dir, sync_sample_every=1)
    # Stop inside a sampled step: the host-read wrappers are counting at this moment.
    train(loader, model, optimizer, steps=7, scaler=scaler, host_reads=1)
    assert agent.recorder.syncs.sampling
    assert "item" in vars(torch.Tensor), "host reads are wrapped while attached"
    assert vars(nn.Sequential)["forward"] is not before[(nn.Sequential, "forward")], "the root is timed"
    assert not model._forward_pre_hooks and "forward" not in vars(model), "nothing lands on the instance"
    agent.detach()
    assert state_of_patched() == before
    assert global_hook_counts() == hooks_before
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert "item" not in vars(torch.Tensor)


def test_options_come_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNEUP_RUN_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("TUNEUP_SYNC_SAMPLE_EVERY", "7")
    monkeypatch.setenv("TUNEUP_WINDOW_STEPS", "50")
    with tuneup.attach() as agent:
        assert agent.options.sync_sample_every == 7
        assert agent.options.window_steps == 50
        assert agent.outputs.run_log.path.parent == tmp_path / "from-env"
    assert (tmp_path / "from-env" / "events.jsonl").exists()


def test_keyword_beats_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNEUP_SYNC_SAMPLE_EVERY", "7")
    with tuneup.attach(run_dir=tmp_path, sync_sample_every=3) as agent:
        assert agent.options.sync_sample_every == 3


@pytest.mark.parametrize("variable, value, option, default, said", [
    ("TUNEUP_INTERVAL", "soon", "interval", 1.0, "1.0"),
    ("TUNEUP_CPU_BF16", "maybe", "cpu_bf16", None, "as the CPU reports"),  # None: read the CPU
    ("TUNEUP_DETAIL_EVERY", "0", "detail_every", None, "chosen from the step time"),
])
def test_bad_environment_variable_warns_once_and_keeps_the_default(monkeypatch, tmp_path, variable, value, option,
                                                                    default, said):
    monkeypatch.setenv(variable, value)
    with pytest.warns(tuneup.TuneupWarning, match=rf"{variable}='{value}'.*; using the default, {re.escape(said)}$") as caught:
        agent = tuneup.attach(run_dir=tmp_path)
    agent.detach()
    assert getattr(agent.options, option) == default
    assert len([w for w in caught if issubclass(w.category, tuneup.TuneupWarning)]) == 1


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mode": "turbo"}, r"mode='turbo'.*expected one of: advise"),
        ({"interval": -1}, r"interval=-1.*from 0.05 to 60"),
        ({"sync_sample_every": 2.5}, r"sync_sample_every=2.5.*whole number"),
        ({"colour": "red"}, r"unknown option 'colour'; valid options are"),
        ({"cpu_bf16": "maybe"}, r"cpu_bf16='maybe'.*expected auto, 1/0"),
        ({"silence": 5}, r"silence=5.*rule ids as a comma-separated string or a list of strings"),
        ({"actions": 5}, r"actions=5.*action ids as a comma-separated string"),
        ({"actions": ["amp", 3]}, r"actions=\['amp', 3\].*list of strings"),
        ({"host": " "}, r"host=' '.*empty would listen on every interface"),
        ({"nvml_module": "this"}, r"nvml_module='this'.*expected pynvml"),
    ],
)
def test_bad_keyword_raises_a_one_line_error(options, message):
    with pytest.raises(ValueError, match=message) as error:
        tuneup.attach(**options)
    assert "\n" not in str(error.value)
    assert tuneup.current() is None


@pytest.mark.parametrize("variable, value, option, safe, says", [
    # The default `actions` is every action: a typo must not allow AMP and the rest.
    ("TUNEUP_ACTIONS", "dataloder", "actions", (), "apply mode takes no action"),
    # Empty would bind every interface while the default is loopback.
    ("TUNEUP_HOST", "", "host", "127.0.0.1", "using the default"),
    # Refused by its name, before anything is imported (`this` prints the Zen of Python).
    ("TUNEUP_NVML_MODULE", "this", "nvml_module", "pynvml", "using the default"),
])
def test_a_bad_environment_value_falls_back_to_the_safe_choice(monkeypatch, tmp_path, capsys, variable, value, option,
                                                                safe, says):
    monkeypatch.setenv(variable, value)
    with pytest.warns(tuneup.TuneupWarning, match=rf"{variable}='{value}'.*; {says}"):
        agent = tuneup.attach(run_dir=tmp_path, mode="apply", serve=False)
    agent.detach()
    assert getattr(agent.options, option) == safe
    assert "Zen of Python" not in capsys.readouterr().out


def test_attaching_again_with_other_options_says_they_were_not_applied(tmp_path):
    with tuneup.attach(run_dir=tmp_path, serve=False) as agent:
        with pytest.warns(tuneup.TuneupWarning, match=r"already attached.*not applied: mode='apply' "
                                                       r"\(running: 'advise'\)"):
            again = tuneup.attach(mode="apply")
        assert again is agent and agent.options.mode == "advise"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same options: nothing to say
            assert tuneup.attach(run_dir=tmp_path, serve=False) is agent
        with pytest.raises(ValueError, match=r"interval=-1"):  # checked as on the first call
            tuneup.attach(interval=-1)


def test_a_plain_function_gets_the_decorator_fix():
    def train_step():
        pass

    with pytest.raises(TypeError, match=r"@tuneup.step_function"):
        tuneup.attach(train_step)
    with pytest.raises(TypeError, match=r"cannot measure a str: pass DataLoaders"):
        tuneup.attach("model.pt")


def test_disable_makes_an_inert_agent_that_patches_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNEUP_DISABLE", "1")
    before = state_of_patched()
    agent = tuneup.attach(run_dir=tmp_path)
    try:
        assert not agent.enabled
        assert state_of_patched() == before
        assert agent.snapshot() == {"enabled": False, "reason": "turned off by TUNEUP_DISABLE", "run": agent.run_info}
        assert tuneup.attach() is agent
        tuneup.step()  # harmless
    finally:
        agent.detach()
        tuneup.session._forget(agent)
    assert not list(tmp_path.iterdir()), "a disabled agent writes nothing"


def test_loader_created_after_attach_is_measured(run_dir):
    with tuneup.attach(run_dir=run_dir) as agent:
        loader, model, optimizer = small_job()  # everything is created after attach()
        truth = train(loader, model, optimizer, steps=10)
    totals = agent.snapshot()["totals"]
    assert totals["steps"] == 10
    assert totals["samples"] == truth.samples
    assert totals["data_wait_seconds"] > 0


def test_explicit_loader_narrows_loaders_only(run_dir):
    torch.manual_seed(0)
    model = mlp(hidden=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_loader = loader_for(SlowDataset(size=64), batch_size=8)
    validation_loader = loader_for(SlowDataset(size=64, latency=0.002), batch_size=8)
    with tuneup.attach(train_loader, run_dir=run_dir) as agent:
        train(train_loader, model, optimizer, steps=8)
        for _ in validation_loader:  # not named: must not count as data wait
            pass
    totals = agent.snapshot()["totals"]
    assert totals["steps"] == 8  # optimizers were not named: still found
    assert totals["samples"] == 64
    assert totals["data_wait_seconds"] < 0.1  # validation took > 128 ms of sleeps


def test_step_marker_measures_loops_without_an_optimizer(run_dir):
    @tuneup.step_function
    def inference_step(x):
        with torch.no_grad():
            return model(x)

    model = mlp(hidden=32)
    with tuneup.attach(run_dir=run_dir) as agent:
        for _ in range(6):
            inference_step(torch.randn(4, 64))
        for _ in range(4):
            model(torch.randn(4, 64))
            tuneup.step()
    window = agent.snapshot()["window"]
    assert window["steps"] == 10
    assert window["forward_seconds"]["mean"] > 0
    assert window["step_seconds"]["min"] > 0


def test_attach_inside_a_spawned_reimport_is_inert(tmp_path):
    from tests.conftest import run_program

    result = run_program("spawn_reimport.py", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert "main:enabled" in lines
    assert "child:inert" in lines



def test_attached_model_can_be_deep_copied_and_pickled(run_dir, tmp_path):
    """EMA copies (copy.deepcopy) and torch.save(model) must keep working mid-training."""
    import copy

    loader, model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir) as agent:
        train(loader, model, optimizer, steps=5)
        ema = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        restored = torch.load(tmp_path / "model.pt", weights_only=False)
        x = torch.randn(4, 64)
        assert torch.equal(ema(x), model(x)) and torch.equal(restored(x), model(x))
        train(loader, ema, torch.optim.SGD(ema.parameters(), lr=0.01), steps=3)
    assert agent.snapshot()["totals"]["steps"] == 8


def test_the_users_exception_passes_through_a_sampled_step_unchanged(run_dir):
    """Leaving `with tuneup.attach()` by an exception in the middle of a sampled step: the
    user's exception comes out, not one of tuneup's, and the agent is fully detached."""
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="the user's own error"):
        with tuneup.attach(run_dir=run_dir, sync_sample_every=1) as agent:
            for step in range(1, 10):
                optimizer.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                loss.item()  # counted on this sampled step...
                if step == 3:
                    raise ValueError("the user's own error")  # ...which never completes
    assert tuneup.current() is None and not agent.attached
    assert "item" not in vars(torch.Tensor)
    snapshot = agent.snapshot()
    assert snapshot["syncs"]["per_step"] == 1  # only complete sampled steps count
    assert snapshot["warnings"] == []


def test_a_failed_start_leaves_nothing_patched(run_dir, monkeypatch):
    import threading

    before = state_of_patched()
    hooks_before = global_hook_counts()

    def cannot_start(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.warns(tuneup.TuneupWarning, match="agent could not start.*training continues unmeasured"):
        agent = tuneup.attach(run_dir=run_dir)
    monkeypatch.undo()
    try:
        assert not agent.enabled
        assert state_of_patched() == before
        assert global_hook_counts() == hooks_before
    finally:
        tuneup.session._forget(agent)


def test_attached_objects_are_not_kept_alive(run_dir):
    """A hyper-parameter search in one process: each trial's model and optimizer are freed."""
    import gc
    import weakref

    refs = []
    with tuneup.attach(run_dir=run_dir):
        for _ in range(4):
            model = mlp(hidden=64)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            tuneup.attach(model, optimizer)  # the same agent, told about more objects
            model(torch.randn(2, 64)).sum().backward()
            optimizer.step()
            refs.append((weakref.ref(model), weakref.ref(optimizer)))
            del model, optimizer
        gc.collect()
        assert [(m(), o()) for m, o in refs] == [(None, None)] * 4


def test_a_step_function_does_not_switch_off_automatic_boundaries(run_dir):
    @tuneup.step_function
    def evaluate(model):
        with torch.no_grad():
            model(torch.randn(8, 64))

    loader, model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir) as agent:
        for _ in range(2):  # two epochs of 16 steps, an evaluation after each
            train(loader, model, optimizer, steps=16, epochs=1)
            evaluate(model)
    window = agent.snapshot()["window"]
    assert window["steps"] == 2 * 16 + 2
    assert window["optimizer_steps"] == 32
    assert agent.recorder.timeline.group == []


def test_forked_child_does_not_hang_when_the_sampler_held_its_lock(run_dir):
    """fork() can happen while the sampler thread holds its Event's lock (it does, briefly,
    every interval): the child must not touch that lock."""
    import os

    agent = tuneup.attach(run_dir=run_dir)
    try:
        with agent.ticker.stopping._cond:  # held, as the sampler thread holds it inside Event.wait()
            pid = os.fork()
            if pid == 0:  # the child: tuneup's at-fork handler has already run
                os._exit(0 if not agent.attached else 3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            pytest.fail("the forked child hung in tuneup's at-fork handler")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        agent.detach()


def test_a_cpu_job_never_asks_cuda_whether_it_is_available(run_dir, monkeypatch):
    """torch.cuda.is_available() initializes the CUDA driver on a GPU host (and breaks
    fork afterwards): a job that does not use CUDA must not have tuneup call it."""

    def forbidden():
        raise AssertionError("tuneup called torch.cuda.is_available()")

    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    loader, model, optimizer = small_job()
    with tuneup.attach(run_dir=run_dir, interval=0.05, sync_sample_every=1) as agent:
        train(loader, model, optimizer, steps=70, host_reads=1)
        time.sleep(0.2)
    assert agent.snapshot()["warnings"] == []


def test_compiled_models_get_no_graph_breaks_from_the_agent(run_dir):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    model = mlp(hidden=16)
    model.compile(backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, detail_every=1) as agent:
            train(loader_for(SlowDataset(size=512), batch_size=8), model, optimizer, steps=10, host_reads=1)
    assert dict(counters["graph_break"]) == {}
    assert not [w for w in caught if "Dynamo does not know how to trace" in str(w.message)]
    snapshot = agent.snapshot()
    assert snapshot["syncs"]["per_step"] == 1  # the loop's own .item(), outside compiled code
    # model.compile() in place: the model is found as itself and its compiled call timed,
    # from outside the compiled code (ModelProbe.timed_compiled).
    assert [model["class"] for model in snapshot["config"]["models"]] == ["Sequential"]
    assert snapshot["window"]["forward_seconds"]["median"] > 0
    assert snapshot["window"]["backward_seconds"]["median"] > 0
    torch._dynamo.reset()


def test_every_option_is_documented_in_attach_and_the_readme():
    import re

    from tests.conftest import ROOT

    documented = set(re.findall(r"[a-z_0-9]+", tuneup.attach.__doc__.split("Options", 1)[1]))
    readme = (ROOT / "README.md").read_text()
    for name, variable in tuneup.ENVIRONMENT_VARIABLES.items():
        assert name in documented, f"attach()'s docstring does not name the option {name!r}"
        assert f"| `{name}` | `{variable}` |" in readme, f"the README's option table has no row for {name!r}"


def test_the_agents_own_cost_is_kept_by_part(run_dir):
    # Ground truth: a CPU loop of ~1 s with the agent ticking every 50 ms on a fake NVML (two
    # GPUs): each tick drains the steps, samples the host, the GPUs and the allocator, and
    # emits; its thread's CPU is split among those parts and adds up to the total.
    from tests import fake_nvml

    fake_nvml.reset()
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir, interval=0.05, nvml_module="tests.fake_nvml") as agent:
        began = time.monotonic()
        while time.monotonic() - began < 1.0:
            optimizer.zero_grad()
            model(torch.randn(16, 8)).sum().backward()
            optimizer.step()
        ticks = agent.ticker.ticks
    cost = agent.snapshot()["agent_cost"]
    parts = cost["parts"]
    assert {"steps", "host", "gpu", "memory", "outputs"} <= set(parts), parts
    assert parts["gpu"]["calls"] >= min(ticks, 5) and parts["steps"]["calls"] >= min(ticks, 5)
    assert cost["cpu_seconds"] == pytest.approx(sum(part["cpu_seconds"] for part in parts.values()))
    assert 0 < cost["cpu_share"] < 1 and cost["seconds"] >= 1.0
    assert all(part["wall_seconds"] > 0 for part in parts.values())
