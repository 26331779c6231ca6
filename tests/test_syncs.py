"""Host-device syncs per step: exact on sampled steps, with the source lines that cause them."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch.utils.data import DataLoader

import tuneup
from benchmarks import scenarios
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tests.conftest import fresh_dynamo, pre_hook_in_place
from tuneup.measure.syncs import HOST_READS


def line_of(function, text: str) -> str:
    lines, first = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if text in line:
            return f"{first + offset}"
    raise AssertionError(f"{text!r} not in {function.__name__}")


def job(optimizer_class=torch.optim.SGD, **loader_kwargs):
    torch.manual_seed(0)
    model = mlp(hidden=32)
    loader = loader_for(SlowDataset(size=2048), batch_size=8, **loader_kwargs)
    return loader, model, optimizer_class(model.parameters(), lr=0.01)


@pytest.mark.parametrize("reads", [0, 1, 3])
def test_syncs_per_step_counted_exactly(run_dir, reads):
    loader, model, optimizer = job(torch.optim.Adam)  # Adam reads CPU step counters: not syncs
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
        train(loader, model, optimizer, steps=30, host_reads=reads)
    syncs = agent.snapshot()["syncs"]
    assert syncs["sampled_steps"] >= 12
    assert syncs["per_step"] == reads
    assert syncs["max_per_step"] == reads
    if reads:
        top = syncs["top_sources"][0]
        assert top["location"].endswith(f"scenarios.py:{line_of(scenarios.train, 'loss.item()')}")
        assert top["kind"] == "item"
        assert top["per_step"] == reads
        assert syncs["meaning"] == "host reads that would sync on GPU"
    else:
        assert syncs["top_sources"] == []


def test_grad_scaler_own_sync_is_counted_at_the_users_line(run_dir):
    loader, model, optimizer = job()
    scaler = torch.amp.GradScaler("cpu")
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
        train(loader, model, optimizer, steps=20, host_reads=2, scaler=scaler)
    syncs = agent.snapshot()["syncs"]
    assert syncs["per_step"] == 3  # two .item() in the loop + GradScaler.step's found-inf check
    locations = {source["location"].rsplit(":", 1)[1]: source for source in syncs["top_sources"]}
    scaler_line = line_of(scenarios.train, "scaler.step(optimizer)")
    assert locations[scaler_line]["per_step"] == 1


def test_every_kind_of_host_read_is_counted_once(run_dir):
    try:
        import numpy  # noqa: F401  (torch does not require it)
        has_numpy = True
    except ImportError:
        has_numpy = False
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 64)
    with tuneup.attach(run_dir=run_dir, sync_sample_every=1) as agent:
        for _ in range(8):
            optimizer.zero_grad()
            out = model(x)
            loss = out.pow(2).mean()
            loss.backward()
            optimizer.step()
            if loss > 1e9:  # bool(t)
                pass
            float(loss.detach())
            int(loss.detach() * 0)
            out.tolist()
            out.detach().cpu()
            if has_numpy:
                out.detach().numpy()
            torch.nonzero(out > 0)
            (out > 0).nonzero()
            f"{loss:.3f}"  # Tensor.__format__ reads through .item(): one read, not two
    syncs = agent.snapshot()["syncs"]
    # torch.nonzero (the function) is counted by the call watch, on the steps it watches.
    expected = {"bool": 1, "cpu": 1, "float": 1, "int": 1, "item": 1, "nonzero": 1, "torch.nonzero": 1, "tolist": 1}
    if has_numpy:
        expected["numpy"] = 1
    assert syncs["by_kind"] == expected
    assert syncs["per_step"] == sum(expected.values())


def test_the_optimizers_own_reads_on_sampled_steps_that_are_not_detail_steps_do_not_count(run_dir):
    """Ground truth from the loop: 120 steps of Adam, one `loss.item()` each (Adam's own reads of
    its CPU step counters happen inside optimizer.step: not the loop's). Sampled one in 2 while
    detail steps are one in 16, so most sampled steps are not detail steps: the optimizer's
    pre-hook, out of torch's registry on plain steps (OptimizerProbe.fit_pre_hook), is in place
    on those too, where it marks the update's region, and Adam's reads stay out of the count."""
    fresh_dynamo()
    loader, model, optimizer = job(torch.optim.Adam)
    seen = []
    with tuneup.attach(run_dir=run_dir, sync_sample_every=2, detail_every=16) as agent:
        timeline, counter = agent.recorder.timeline, agent.recorder.syncs
        for step, (x, y) in enumerate(loader, 1):
            seen.append((pre_hook_in_place(agent), counter.sampling, timeline.detail))
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()
            if step == 120:
                break
    assert any(sampled and not detail for _, sampled, detail in seen)
    assert all(in_place for in_place, sampled, detail in seen if sampled or detail)
    assert not all(in_place for in_place, _, _ in seen)  # out on the others
    syncs = agent.snapshot()["syncs"]
    assert syncs["sampled_steps"] >= 40
    assert syncs["per_step"] == 1 and syncs["max_per_step"] == 1


def test_reads_inside_the_dataloader_do_not_count(run_dir):
    def collate(batch):
        xs = torch.stack([x for x, _ in batch])
        ys = torch.stack([y for _, y in batch])
        assert len(ys.tolist()) == len(batch)  # a host read inside the loader
        return xs, ys

    torch.manual_seed(0)
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(SlowDataset(size=512), batch_size=8, collate_fn=collate)
    with tuneup.attach(run_dir=run_dir, sync_sample_every=1) as agent:
        train(loader, model, optimizer, steps=10, host_reads=1)
    assert agent.snapshot()["syncs"]["per_step"] == 1


def test_only_sampled_steps_are_counted(run_dir):
    loader, model, optimizer = job()
    with tuneup.attach(run_dir=run_dir, sync_sample_every=10, detail_every=4) as agent:  # (not paced: as listed below)
        train(loader, model, optimizer, steps=25, host_reads=1)
    columns = agent.recorder.timeline.ring.columns(1, 25)
    sampled = {step for step, syncs in zip(columns["step"], columns["syncs"]) if syncs >= 0}
    # Steps 3-5, then one drawn from each block of 10 after them, moved on to the first detail
    # step from there: exactly what sample_after lists, and each a detail step.
    counter, expected, step = agent.recorder.syncs, [], 0
    while (step := counter.sample_after(step)) <= 25:
        expected.append(step)
    assert sampled == set(expected) and expected[:3] == [3, 4, 5]
    detailed = {step for step, flag in zip(columns["step"], columns["detailed"]) if flag}
    assert sampled <= detailed
    assert agent.snapshot()["syncs"]["sampled_steps"] == len(sampled)


READ_NAMES = [attribute for owner, attribute in HOST_READS if owner is torch.Tensor]


def test_the_host_read_wrappers_are_in_place_on_sampled_steps_only(run_dir):
    # An Adam loop (its step reads each parameter's step count with .item(): 6 reads a step
    # through a wrapper left in place) with one .item() of its own. Ground truth: 40 steps, each
    # beginning at its fetch; tuneup samples the steps sample_after lists (3-5, then one in 8).
    loader, model, optimizer = job(torch.optim.Adam)
    in_place = {}
    with tuneup.attach(run_dir=run_dir, sync_sample_every=8) as agent:
        for step, (x, y) in enumerate(loader, start=1):
            in_place[step] = {name for name in READ_NAMES if name in vars(torch.Tensor)}
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()
            if step == 40:
                break
        closed = agent.recorder.timeline.ring.count  # step 40 closes at detach
        columns = agent.recorder.timeline.ring.columns(1, closed)
    assert closed == 39
    sampled = {step for step, syncs in zip(columns["step"], columns["syncs"]) if syncs >= 0}
    wrapped = {step for step, names in in_place.items() if names and step <= closed}
    assert {3, 4, 5} <= sampled and len(sampled) >= 6
    assert wrapped == sampled
    assert all(names in (set(), set(READ_NAMES)) for names in in_place.values())  # all or none
    assert agent.snapshot()["syncs"]["per_step"] == 1  # the loop's read, on every sampled step
    assert not set(READ_NAMES) & set(vars(torch.Tensor))  # after detach: torch's own


LOG_ONCE = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 13):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1))
    loss.backward()
    optimizer.step()
    if step == 4:
        print(f"step {step} loss {float(loss):.4f}")  # FLOAT
"""


def test_a_warning_inside_a_counted_read_names_the_jobs_line(tmp_path):
    """float() of a loss that requires grad warns, once a process (torch: "Converting a tensor
    with requires_grad=True to a scalar"). Ground truth: 12 steps, the one float() on step 4,
    one of the steps whose reads tuneup counts (3-5 always): there the read runs inside the
    wrapper posing as torch/_tensor.py, yet the warning names the script's line, as without
    tuneup: the job's stderr is the same line for line."""
    import subprocess
    import sys

    from tests.conftest import child_env
    from tuneup.report.sources import load

    program = tmp_path / "log_once.py"
    program.write_text(LOG_ONCE)
    line = next(number for number, text in enumerate(LOG_ONCE.splitlines(), 1) if "# FLOAT" in text)
    env = child_env(TUNEUP_RUN_DIR=str(tmp_path / "run"), TUNEUP_PORT="0")
    plain = subprocess.run([sys.executable, str(program)], env={**env, "TUNEUP_DISABLE": "1"}, capture_output=True,
                           text=True, timeout=300)
    tuned = subprocess.run([sys.executable, "-m", "tuneup", "run", str(program)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == tuned.returncode == 0, tuned.stderr
    if "UserWarning" not in plain.stderr:
        pytest.skip("this torch does not warn on float() of a tensor that requires grad")
    assert plain.stderr.startswith(f"{program}:{line}: UserWarning")
    # The job's stderr line for line, then the one line `tuneup run` ends a clean run with.
    assert tuned.stdout == plain.stdout and tuned.stderr.startswith(plain.stderr), tuned.stderr
    assert re.fullmatch(rf"tuneup: .* in 12 steps.*; the (advice|report): tuneup report {re.escape(str(tmp_path / 'run'))}\n",
                        tuned.stderr[len(plain.stderr):]), tuned.stderr
    histories, _ = load(str(tmp_path / "run"))
    sources = histories[0].snapshot()["syncs"]["top_sources"]
    assert [source["location"] for source in sources] == [f"{program}:{line}"]  # it was counted


def test_a_host_read_someone_wrapped_meanwhile_is_neither_covered_nor_removed(run_dir):
    # A profiler of the job's wraps Tensor.item between two of tuneup's sampled steps: from then
    # on its wrapper is the one in place, on sampled steps too and after detach; tuneup counts
    # the other kinds of reads as before.
    loader, model, optimizer = job()
    calls = []

    def item(tensor):
        calls.append(1)
        return torch._C.TensorBase.item(tensor)

    seen = []
    try:
        with tuneup.attach(run_dir=run_dir, sync_sample_every=2) as agent:
            for step, (x, y) in enumerate(loader, start=1):
                if "item" not in vars(torch.Tensor) and step > 6 and not calls:
                    torch.Tensor.item = item
                seen.append(vars(torch.Tensor).get("item") is item)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                loss.item()
                bool(loss > 0)
                if step == 30:
                    break
        first = seen.index(True)
        assert all(seen[first:]) and len(calls) == 30 - first
        assert vars(torch.Tensor)["item"] is item  # after detach: still theirs
        by_kind = agent.snapshot()["syncs"]["by_kind"]  # per sampled step
        assert by_kind["bool"] == 1.0  # counted on every sampled step
        assert 0 < by_kind["item"] < 1.0  # only on those before the profiler's wrapper came
    finally:
        if vars(torch.Tensor).get("item") is item:
            del torch.Tensor.item


def test_sync_sampling_can_be_turned_off(run_dir):
    loader, model, optimizer = job()
    with tuneup.attach(run_dir=run_dir, sync_sample_every=0) as agent:
        train(loader, model, optimizer, steps=10, host_reads=2)
        assert "item" not in vars(torch.Tensor)
    snapshot = agent.snapshot()
    assert snapshot["syncs"]["measured"] is False
    assert snapshot["probes"]["syncs"] == "turned off (sync_sample_every=0)"


def test_host_reads_keep_their_keyword_forms(run_dir):
    t = torch.tensor([0.0, 1.0, 2.0])
    with tuneup.attach(run_dir=run_dir):
        assert torch.nonzero(input=t).tolist() == [[1], [2]]
        assert torch.Tensor.nonzero(t, as_tuple=True)[0].tolist() == [1, 2]
