"""The call watch: torch.tensor(ndarray) copies, torch.nonzero host reads and gradient clipping
seen on watched steps without replacing any torch function, and never a trace left behind."""

from __future__ import annotations

import cProfile
import inspect
import sys
import warnings

import numpy
import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.data import DataLoader, Dataset

import tuneup
from tuneup.measure import calls as call_watch

TABLE = numpy.random.default_rng(0).standard_normal((8, 16)).astype("float32")


def line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def loop(steps: int, *, copies: bool = True, clip: str | None = None, nonzero: bool = False, loader=None):
    """A loop that converts an array per step the way RL and tabular scripts do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(loader) if loader is not None else None
    for _ in range(steps):
        if batches is not None:
            x = next(batches)[0]
        else:
            x = torch.as_tensor(TABLE)  # shares the array: no copy
        if copies:
            x = x + torch.tensor(TABLE)  # a copy
            x = x * torch.tensor(TABLE[0])  # another copy
            x = x + torch.tensor([1.0])  # from a list: not an array copy
            x = x + torch.from_numpy(TABLE)  # shares: no copy
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if clip == "norm":
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
        optimizer.step()
        if nonzero:
            torch.nonzero(x > 0)


def habits(agent) -> dict:
    return agent.snapshot()["habits"]


def test_array_copies_are_counted_per_watched_step_with_their_lines(run_dir):
    with tuneup.attach(run_dir=run_dir) as agent:
        loop(12)
        assert sys.getprofile() is None  # between watched steps nothing watches
    seen = habits(agent)
    assert seen["watched_steps"] == 3  # steps 3-5; the next comes after at least MIN_GAP steps
    assert seen["numpy_copies"] == 6 and seen["numpy_copies_per_step"] == 2.0
    assert seen["numpy_copies_in_loader"] == 0
    assert seen["numpy_copy_seconds_per_step"] > 0
    lines = {source["location"].rsplit(":", 1)[1]: source["calls"] for source in seen["numpy_copy_sources"]}
    assert lines == {str(line_of(loop, "torch.tensor(TABLE)  #")): 3, str(line_of(loop, "torch.tensor(TABLE[0])")): 3}
    assert all(source["location"].startswith("tests/test_calls.py:") for source in seen["numpy_copy_sources"])


class ArrayRows(Dataset):
    """A dataset that copies each sample out of an array with torch.tensor (main process)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return (torch.tensor(TABLE[index % 8]),)


def test_copies_in_the_datasets_getitem_count_as_in_the_loader(run_dir):
    loader = DataLoader(ArrayRows(), batch_size=4)  # 4 copies per fetch, in the main process
    with tuneup.attach(run_dir=run_dir) as agent:
        loop(12, copies=False, loader=loader)
    seen = habits(agent)
    assert seen["numpy_copies_per_step"] == 4.0 and seen["numpy_copies_in_loader"] == seen["numpy_copies"]


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_gradient_clipping_is_seen_without_a_wrapper(run_dir, clip):
    before = (nn.utils.clip_grad_norm_, nn.utils.clip_grad_value_)
    with tuneup.attach(run_dir=run_dir) as agent:
        loop(8, copies=False, clip=clip)
        assert (nn.utils.clip_grad_norm_, nn.utils.clip_grad_value_) == before  # never replaced
    assert habits(agent)["clip_grad_calls"] == 3 and habits(agent)["clip_grad_calls_per_step"] == 1.0


def test_no_clipping_is_no_clipping(run_dir):
    with tuneup.attach(run_dir=run_dir) as agent:
        loop(8, copies=False)
    assert habits(agent)["clip_grad_calls"] == 0 and habits(agent)["watched_steps"] == 3


def test_torch_nonzero_is_a_host_read_on_steps_both_watched_and_sampled(run_dir):
    before = torch.nonzero
    with tuneup.attach(run_dir=run_dir, sync_sample_every=1) as agent:
        loop(10, copies=False, nonzero=True)
        assert torch.nonzero is before
    syncs = agent.snapshot()["syncs"]
    assert syncs["by_kind"] == {"torch.nonzero": 1.0}
    [source] = syncs["top_sources"]
    assert source["location"].endswith(f":{line_of(loop, 'torch.nonzero(x > 0)')}")


def test_the_watch_leaves_no_mode_on_the_stack_and_profiles_only_watched_steps(run_dir):
    seen = []  # (profile function set, modes on the stack), at each forward

    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 1)

        def forward(self, x):
            seen.append((sys.getprofile() is not None, len(_get_current_function_mode_stack())))
            return self.fc(x)

    model = Recording()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir) as agent:
        for _ in range(10):
            x = torch.tensor(TABLE)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert sys.getprofile() is None and _get_current_function_mode_stack() == []
    # With no DataLoader a step closes when the next optimizer step begins: watched steps 3-5
    # run from the optimizer step of iteration 3 to that of iteration 6, over forwards 4-6.
    assert seen == [(iteration in (4, 5, 6), 0) for iteration in range(1, 11)], seen
    assert agent.recorder.calls.watching is False and habits(agent)["numpy_copies_per_step"] == 1.0


def test_a_jobs_own_profiler_keeps_its_place(run_dir):
    profiler = cProfile.Profile()
    with tuneup.attach(run_dir=run_dir) as agent:
        profiler.enable()
        try:
            loop(8)
            still_profiling = sys.getprofile() is not None
        finally:
            profiler.disable()
    assert still_profiling
    seen = habits(agent)
    assert seen["watched_steps"] == 0 and agent.recorder.calls.busy_steps >= 1
    assert seen["numpy_copies_per_step"] is None  # nothing watched: unknown, not zero
    assert profiler.getstats()  # the job's profile holds its calls


class ProfileInWorker(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        return (torch.tensor([float(sys.getprofile() is not None)]),)


def test_workers_forked_during_a_watched_step_are_not_watched(run_dir):
    loader = DataLoader(ProfileInWorker(), batch_size=4, num_workers=2)
    profiled = []
    with tuneup.attach(run_dir=run_dir) as agent:
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):  # a new iterator, so new workers, every 4 steps: epochs start on watched steps
            for (x,) in loader:
                profiled.extend(x.flatten().tolist())
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert agent.recorder.calls.watched_steps >= 3 and len(profiled) == 48
    assert set(profiled) == {0.0}


def test_gaps_keep_the_watchs_extra_time_within_its_budget():
    watch = call_watch.CallWatch.__new__(call_watch.CallWatch)
    for usual, watched in [(0.001, 0.0014), (0.001, 0.001), (0.005, 0.02), (0.001, 1.0)]:
        watch._usual = usual
        gap = watch._gap(watched)
        extra = max(0.0, watched - usual)
        assert call_watch.MIN_GAP <= gap <= call_watch.MAX_GAP
        assert gap == call_watch.MAX_GAP or extra / (gap * usual) <= call_watch.WATCH_BUDGET


def test_a_failing_watch_turns_itself_off_with_one_warning_and_the_job_goes_on(run_dir, monkeypatch):
    def broken(frame):
        raise RuntimeError("boom")

    monkeypatch.setattr(call_watch, "user_frame", broken)
    with pytest.warns(tuneup.TuneupWarning, match=r"calls probe turned off after an internal error: RuntimeError: boom"):
        with tuneup.attach(run_dir=run_dir) as agent:
            loop(12)
    assert sys.getprofile() is None and _get_current_function_mode_stack() == []
    assert agent.snapshot()["totals"]["steps"] == 12 and agent.snapshot()["probes"]["calls"] == "off"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop(2)  # after detach: nothing of tuneup runs
