"""Apply mode: safe changes made to a real training loop as measured experiments, kept only
when they help, rolled back at once when they endanger the run, undone on request."""

from __future__ import annotations

import json
import random
import re
import statistics
import time
import urllib.request
import warnings

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

import tuneup
from benchmarks.scenarios import sample
from tuneup.act.actions import amp as amp_action
from tuneup.act.actions.dataloader import LoaderChange
from tuneup.act.judge import ALPHA, MIN_SPEEDUP
from tuneup.measure.terms import shadow_refusal
from tuneup.report.live import frame as live_frame
from tests.conftest import one_intra_op_thread


class SlowIndexed(Dataset):
    """An I/O-bound dataset (a sleep per sample) whose samples carry their index."""

    def __init__(self, size: int = 1600, latency: float = 0.00125, fail_in_workers: bool = False) -> None:
        self.size = size
        self.latency = latency
        self.fail_in_workers = fail_in_workers  # workers started from now on fail to read

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]):
        """A batch read at once (torch's fetcher calls this when a dataset has it): one sleep
        of the batch's latency. Sixteen sleeps a batch each waited for the scheduler again on a
        machine busy with other processes, and the batch took 56 ms instead of 10."""
        if self.fail_in_workers and get_worker_info() is not None:
            raise OSError("this dataset's files cannot be opened in a worker process")
        time.sleep(self.latency * len(indices))
        return [(*sample(index, 32), index) for index in indices]


@one_intra_op_thread()
def io_bound_run(steps: int, *, compute: float = 0.02, set_to_none: bool = True, dataset: Dataset | None = None,
                 agent_options: dict | None = None, after_step=None, observe=None, jitter: float = 0.0,
                 **loader_options):
    """Train an MLP on a slow loader (num_workers=0, shuffled by the global RNG unless told
    otherwise) for `steps` steps, each step's own wait drawn in [1 - jitter, 1 + jitter] x
    `compute` from a random stream of the test's; returns (what `observe(x, y, index)` saw of each batch,
    default the indices; losses; a final draw from the global RNG; agent; loader). It ends
    early where `after_step(step, agent)` returns True.

    The premise is timing (a loader slower than the step), so it is built of sleeps that a
    machine's load cannot flip: 16 samples of 1.25 ms a batch (20 ms) against `compute` seconds
    of the step's own waiting (20 ms, a GPU's work as the host sees it). One worker overlaps
    the batch's sleep with the step's: about 2x (1.9-2.1x at p=0.001 on an idle machine), with
    little CPU. Epochs are 100 steps, so a worker's start at an epoch's beginning weighs little.
    With 10 ms batches against 8 ms, the CPU a worker spends shipping a batch (fetch, collate,
    pickling) was no longer small beside the sleeps on a machine busy with other work: the first
    worker's gain fell to 1.10x (p=0.09) and CI judged it "within the noise"; with the step's
    time spun on the CPU instead, two busy processes starved the workers and the main thread alike.
    The judge's windows are about a second of steps, so the steps a test runs are ~50 ms each:
    the first change is decided by step ~75.
    The loop runs one intra-op thread: with two, torch's second thread spun after every op
    while the main one slept (25 ms of CPU a 50 ms step, 2.6 ms with one thread), and beside
    busy processes that CPU was what the steps waited for: the worker's gain fell to 1.12x
    (p=0.24) in the full suite beside two busy processes.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader_options = {"batch_size": 16, "shuffle": True, **loader_options}
    loader = DataLoader(dataset or SlowIndexed(size=1600), **loader_options)
    agent = tuneup.attach(**agent_options) if agent_options is not None else None
    batches, losses = [], []
    ended = False
    waits = random.Random(0)
    try:
        while len(batches) < steps and not ended:
            for x, y, index in loader:
                optimizer.zero_grad(set_to_none=set_to_none)
                loss = nn.functional.mse_loss(model(x), y[:, :1])
                time.sleep(compute * (1 + jitter * (2 * waits.random() - 1)))
                loss.backward()
                optimizer.step()
                batches.append(observe(x, y, index) if observe is not None else index.tolist())
                losses.append(loss.item())
                if after_step is not None and after_step(len(batches), agent):
                    ended = True
                    break
                if len(batches) >= steps:
                    break
    finally:
        if agent is not None:
            agent.detach()
    return batches, losses, torch.rand(3), agent, loader


# Apply mode's decisions rest on step times: a full collection of pytest's heap landing in a
# trial's DataLoader fetches made a 1.44x faster trial "within the noise" (p=0.15) in the full
# suite, never alone (conftest.heap_as_a_script_has).
pytestmark = pytest.mark.usefixtures("heap_as_a_script_has")


def apply_options(run_dir, **extra):
    # The CPU's bf16 capability is pinned (absent unless a test claims it): whether amp-off
    # fires, and so whether apply mode tries AMP beside the change a test is about, must not
    # depend on the machine the suite runs on.
    return dict(mode="apply", run_dir=run_dir, **{"interval": 0.2, "cpu_bf16": False, **extra})


def decisions(agent):
    """Every record's change, decision, reason and steps: what a failed assertion shows."""
    return [(r.get("change"), r["decision"], r.get("reason"), r.get("applied_step"), r.get("decided_step"))
            for r in agent.actions()]


def records(agent, action=None, decision=None):
    return [r for r in agent.actions() if (action is None or r["action"] == action)
            and (decision is None or r["decision"] == decision)]


def test_apply_mode_tunes_an_io_bound_loader_without_changing_the_batches(run_dir):
    plain_batches, plain_losses, plain_rng, _, _ = io_bound_run(150)
    batches, losses, rng, agent, loader = io_bound_run(150, agent_options=apply_options(run_dir))
    kept = records(agent, "dataloader", "kept")
    assert kept and kept[0]["after"]["num_workers"] > 0, decisions(agent)
    first = kept[0]
    # Kept on the judge's own terms, by less waiting for data (the compute is the same). Not the
    # stall *share*: on a busy machine the workers are starved too, and the shorter step can
    # spend a larger share of itself waiting on them.
    assert first["speedup"] >= MIN_SPEEDUP and first["p_faster"] < first["alpha"] <= ALPHA, first
    assert first["trial"]["data_wait_seconds"] < first["baseline"]["data_wait_seconds"], first
    # The same samples in the same order, the same losses, the same global RNG stream.
    assert batches == plain_batches
    assert losses == plain_losses
    assert torch.equal(rng, plain_rng)
    assert loader.num_workers == 0, "detach puts the job's own settings back"


class Curriculum(SlowIndexed):
    """A curriculum the loop moves on every step (`dataset.noise = ...`): in workers, each with
    the copy it forked, the batches would stop following it."""

    noise = 0.0

    def __getitems__(self, indices: list[int]):
        return [(x * (1 + self.noise), y, index) for x, y, index in super().__getitems__(indices)]


def test_a_dataset_the_loop_changes_while_it_trains_keeps_its_work_in_the_main_process(run_dir):
    def run(agent_options):
        dataset = Curriculum(size=1600)

        def harder(step, agent):
            dataset.noise = min(0.5, step / 200)

        return io_bound_run(150, dataset=dataset, agent_options=agent_options, after_step=harder,
                            observe=lambda x, y, index: x.sum().item())

    plain_batches, plain_losses, _, _, _ = run(None)
    batches, losses, _, agent, loader = run(apply_options(run_dir, actions=("dataloader",)))
    assert not records(agent, "dataloader", "trying") and not records(agent, "dataloader", "kept"), decisions(agent)
    said = records(agent, "dataloader", "not applicable")
    assert said and "the dataset's noise changed while the job trained" in said[0]["reason"], decisions(agent)
    assert batches == plain_batches and losses == plain_losses  # the curriculum followed, in the main process


def test_the_configuration_reports_the_loader_settings_the_steps_run_with(run_dir):
    """A kept num_workers change: the configuration while attached, and the final report's after
    detach put the job's own back (a later trial cut short at detach undone first: the report
    once read the job's num_workers=0 beside the waits two workers left), show the setting the
    steps ran with, marked as apply mode's with the job's own value beside it; read at the step
    a trial is decided, the count it left in effect (it once lagged until the next tick). Read where no
    trial is on (the search may go on from the kept count at once: beside two busy processes
    it tried 2 -> 3 within 20 steps of keeping 0 -> 2, and the configuration rightly read 3).
    Trained until then, up to 800 steps: in run 24b of the full suite (and 1 in 3 beside two
    busy processes) 2 -> 3 began within 20 steps of 0 -> 2's keep and was kept at step 247
    after running on, and prefetch_factor's trial began 3 steps later and was still on at
    step 400, the old end: no step of the run was one to read at."""
    seen, fresh, checked = {}, [], set()

    def kept_then_read(step, agent):
        rows = records(agent, "dataloader")
        for row in rows:  # read at once after each decision: the count the next steps run with
            if row["decision"] in ("kept", "reverted") and "before" in row and row["id"] not in checked:
                checked.add(row["id"])
                side = "after" if row["decision"] == "kept" else "before"
                fresh.append((row[side]["num_workers"], agent.snapshot()["config"]["loaders"][0]["num_workers"]))
        kept = [r for r in rows if r["decision"] == "kept"]
        trying = any(r["decision"] == "trying" for r in rows)
        if kept and not trying and step >= kept[-1]["decided_step"] + 20 and "config" not in seen:
            seen["kept"] = kept[-1]
            seen["config"] = agent.snapshot()["config"]["loaders"][0]
        return "config" in seen and step >= seen["kept"]["decided_step"] + 25

    _, _, _, agent, loader = io_bound_run(800, agent_options=apply_options(run_dir, actions=["dataloader"]),
                                          after_step=kept_then_read)
    assert "config" in seen, decisions(agent)
    assert fresh and all(expected == read for expected, read in fresh), (fresh, decisions(agent))
    workers = seen["kept"]["after"]["num_workers"]
    assert seen["config"]["num_workers"] == workers > 0 and seen["config"]["set_by_tuneup"]["num_workers"] == 0, \
        (seen, decisions(agent))
    assert loader.num_workers == 0  # the job's own, put back at detach (and never changed on the object)
    final = agent.document()["runs"][0]["snapshot"]["config"]["loaders"][0]
    latest = records(agent, "dataloader", "kept")[-1]["after"]["num_workers"]  # (a later keep: its count)
    assert final["num_workers"] == latest > 0 and final["set_by_tuneup"]["num_workers"] == 0, final


def test_a_trial_is_judged_without_the_steps_that_began_an_epoch(run_dir):
    """Ground truth from the code: epochs of 20 batches (320 samples, batch 16), so steps
    1, 21, 41, ... begin one, and with workers each of those starts them afresh (not
    persistent). The windows (about a second of 20-40 ms steps) hold one or two such steps;
    the verdict leaves out exactly those of its baseline and trial windows, and says so."""
    _, _, _, agent, _ = io_bound_run(150, dataset=SlowIndexed(size=320),
                                     agent_options=apply_options(run_dir, actions=["dataloader"]))
    decided = [r for r in records(agent, "dataloader") if r["decision"] in ("kept", "reverted")]
    assert decided, decisions(agent)
    first = decided[0]
    windows = [(first[side]["first_step"], first[side]["last_step"]) for side in ("baseline", "trial")]
    began = sum(1 for low, high in windows for step in range(low, high + 1) if (step - 1) % 20 == 0)
    assert began >= 1, windows  # the premise: an epoch start in a window
    # (a trial looked at twice says so after it: its windows are the second look's)
    assert f"; {began} step{'s' if began > 1 else ''} that began an epoch left out" in first["reason"], first
    assert first["decision"] == "kept" and first["after"]["num_workers"] > 0, decisions(agent)


@pytest.mark.parametrize("counter", [True, False], ids=["energy counter", "no energy counter"])
def test_a_change_row_shows_the_gpus_energy_a_step_before_and_after(run_dir, counter):
    """NVML is the fake (no GPU here): its energy counter rises at 350 W on each GPU, and the job
    holds memory on GPU 1 only (one rank of a node whose GPUs it sees). Ground truth: a step costs
    350 W x its time on the job's GPU, so the worker that halves the step halves its joules; a
    GPU without the counter (before Volta) gives no energy figure rather than a guess."""
    from tests import fake_nvml
    from tuneup.report.summary import change_rows

    fake_nvml.reset(own_gpu=1, no_energy=not counter)

    def judged(step, agent):  # up to 400 steps: a busy machine had the first trial begin at step 55 of 150, undecided at detach
        return any(r.get("trial") for r in records(agent, "dataloader"))

    try:
        _, _, _, agent, _ = io_bound_run(400, agent_options=apply_options(run_dir, actions=["dataloader"],
                                                                           nvml_module="tests.fake_nvml"),
                                         after_step=judged)
    finally:
        fake_nvml.reset()
    decided = [r for r in records(agent, "dataloader") if r.get("trial")]
    assert decided, decisions(agent)
    first = decided[0]
    if not counter:
        assert "energy" not in first and change_rows([first])[0][6] == "–"
        return
    energy = first["energy"]
    assert energy["before_watts"] == pytest.approx(350, rel=0.05) and energy["after_watts"] == pytest.approx(350, rel=0.05)
    for side, window in (("before", first["baseline"]), ("after", first["trial"])):
        assert energy[f"{side}_joules_per_step"] == pytest.approx(350 * window["mean_step_seconds"], rel=0.25), (
            energy, window)
    assert energy["ratio"] == pytest.approx(1 / first["speedup"], rel=0.25), (energy, first["speedup"])
    assert change_rows([first])[0][6].endswith(f"({energy['ratio']:.2f}x)") and " J -> " in change_rows([first])[0][6]


def test_advise_mode_changes_nothing(run_dir):
    _, _, _, agent, loader = io_bound_run(100, agent_options=dict(run_dir=run_dir, interval=0.2))
    assert agent.actions() == []
    assert any(f["rule"] == "data-stall" for f in agent.findings())
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (0, None, False)


def test_a_worker_failure_during_a_trial_rolls_back_and_loses_no_batch(run_dir):
    plain, _, _, _, _ = io_bound_run(120, dataset=SlowIndexed(fail_in_workers=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches, _, _, agent, loader = io_bound_run(120, dataset=SlowIndexed(fail_in_workers=True),
                                                    agent_options=apply_options(run_dir))
    assert batches == plain
    rolled = records(agent, "dataloader", "rolled back")
    assert len(rolled) == 1 and "cannot be opened in a worker process" in rolled[0]["reason"]
    assert records(agent, "dataloader", "kept") == []
    assert loader.num_workers == 0


class StepClock:
    """The test's own clock at the end of every step of io_bound_run (its `after_step`): ground
    truth for a trial's gain beside tuneup's own figures. A premise built of sleeps still rests
    on some CPU (a worker makes, pickles and ships each batch; the main process unpickles it),
    and beside busy processes that CPU can take what the sleeps would save: a one-worker gain of
    1.55x on an idle machine measured 1.0-1.26x with four busy processes. A test then asserts
    what apply mode decided against what this clock measured in the same run."""

    CLEAR = 1.3  # a gain this size by this clock is one the judge's windows must find

    def __init__(self, then=None) -> None:
        self.ends: dict[int, float] = {}
        self.then = then

    def __call__(self, step, agent):
        self.ends[step] = time.perf_counter()
        return self.then(step, agent) if self.then is not None else False

    def _median_step(self, steps, average=statistics.median) -> float:
        return average([self.ends[s] - self.ends[s - 1] for s in steps if s in self.ends and s - 1 in self.ends])

    def speedup(self, record, others, average=statistics.median) -> float:
        """Median step time of the steps the record's baseline spans, less those of other trials
        (a reused baseline spans an undone trial), over the median of its trial's steps."""
        trial = range(record["trial"]["first_step"], record["trial"]["last_step"] + 1)
        busy = {s for r in others if r is not record and "decided_step" in r
                for s in range(r["applied_step"], r["decided_step"] + 1)}
        baseline = [s for s in range(record["baseline"]["first_step"], record["baseline"]["last_step"] + 1)
                    if s not in busy]
        return self._median_step(baseline, average) / self._median_step(trial, average)

    def check(self, record, others, average=statistics.median) -> float:
        """Kept where this clock says clearly faster; never kept where it says no faster (by the
        median step; `average=statistics.mean` where steps alternate between two lengths)."""
        measured = self.speedup(record, others, average)
        if measured >= self.CLEAR:
            assert record["decision"] == "kept", (measured, record["decision"], record["reason"])
        if measured <= 1.0:
            assert record["decision"] != "kept", (measured, record["decision"], record["reason"])
        return measured


class DearToShip(SlowIndexed):
    """Batches that cost more to bring from a worker than to make: in a worker each batch takes
    `latency` a sample of CPU (what pickling it, shipping it and a worker's own start-up cost a
    real loader: CPU work, not a wait), in the main process nothing. Each batch draws
    augmentation noise from torch's global RNG (in a worker, that worker's stream). (A sleep
    instead, a cost no real loader has, reads as workers waiting on storage: apply mode then
    adds one, as data-stall advises for those.)"""

    def __getitems__(self, indices: list[int]):
        if get_worker_info() is not None:
            until = time.thread_time() + self.latency * len(indices)
            while time.thread_time() < until:  # the worker's own CPU time: as long however busy the machine
                pass
        noise = torch.rand(len(indices), 1)
        return [(x + 0.01 * n, y, index) for (x, y, index), n in
                zip(((*sample(index, 32), index) for index in indices), noise)]


def test_a_loader_whose_workers_cost_more_than_they_save_is_moved_down_in_a_long_epoch(run_dir):
    """Ground truth from the code: the job runs one worker per usable core (apply mode adds no
    more: they are CPU-bound), each taking 16 x 1.25 ms x cores = 20 ms x cores of CPU a batch,
    so one batch every 20 ms, against a step of 10 ms (a sleep): about 20 ms a step, half of it
    waiting for data. In the main process a batch costs nothing: about 10 ms a step, 2x faster;
    one worker is slower than the job's own. Epochs are 1,000 steps, longer than a persistent-workers trial
    can span. The dataset draws noise from the global RNG: in workers from theirs."""
    from tuneup.measure.host import usable_cores

    cores = usable_cores()
    options = dict(dataset=DearToShip(size=16 * 1000, latency=0.00125 * cores), num_workers=cores, compute=0.01)
    plain, _, plain_rng, _, _ = io_bound_run(400, **options)
    clock = StepClock()
    batches, _, rng, agent, loader = io_bound_run(400, agent_options=apply_options(run_dir, actions=["dataloader"]),
                                                  after_step=clock, **options)
    tried = [r for r in records(agent, "dataloader") if "before" in r]
    assert tried and (tried[0]["before"]["num_workers"], tried[0]["after"]["num_workers"]) == (cores, 0), \
        decisions(agent)
    clock.check(tried[0], tried)  # idle: 1.8x by the test's clock, kept
    assert not records(agent, "dataloader", "not applicable"), decisions(agent)
    # The same samples in the same order, and the job's own random stream as without tuneup:
    # in the main process the dataset drew its noise from a stream of its own.
    assert batches == plain
    assert torch.equal(rng, plain_rng)
    assert loader.num_workers == cores, "detach puts the job's own settings back"


def test_workers_that_wait_on_io_at_the_usable_cores_get_the_one_more_data_stall_advises(run_dir):
    """Ground truth from the code: the job runs one worker per usable core, each batch of 16
    samples a 16 x 2.5 ms x cores sleep (storage, as the workers see it: no CPU), so the workers
    deliver one every 40 ms against a step of 10 ms (a sleep): three quarters of each step wait
    for data, and no batch waits in the queue even where other processes slow the loop twofold
    (with 20 ms batches, beside the suite's other processes, 83% of the fetches looked at found
    one waiting and data-stall judged the wait to be the shipping). Sleeping workers need no
    core: one more makes a batch every 40 x cores / (cores + 1) ms, and data-stall advises it
    (num_workers=cores + 1: its workers are not CPU-bound). Apply mode tries that count, where
    its search once stopped at the usable cores ("num_workers is at the 2 usable cores") with
    the finding saying it could make it, and moved to none instead (0.34x: reverted): the two
    workers, started together, deliver together, so each second fetch found a batch waiting, and
    data-stall took the wait for the shipping until it also timed the fetches that found none
    (70 ms, against 0.7 ms to ship a batch). In CI's full suite it moved to none again (0.38x:
    reverted): four looks at the queue, all before step 45, had each found a batch waiting (two
    workers hand over in pairs, and one fetch in two finds the other's batch), and the workers'
    1.2 ms of CPU a batch read as what making one here would cost. The queue is now looked at on
    every fetch to the 64th, and fewer workers are advised only where the workers are CPU-bound
    or idle ahead with most of the batches asked for made."""
    from tuneup.measure.host import usable_cores

    cores = int(usable_cores())

    def decided(step, agent):
        return any(r["decision"] in ("kept", "reverted") for r in records(agent, "dataloader"))

    clock = StepClock(then=decided)
    _, _, _, agent, loader = io_bound_run(600, dataset=SlowIndexed(size=16 * 1000, latency=0.0025 * cores),
                                          num_workers=cores, compute=0.01, after_step=clock,
                                          agent_options=apply_options(run_dir, actions=["dataloader"]),
                                          generator=torch.Generator().manual_seed(0))
    finding = next((f for f in agent.findings() if f["rule"] == "data-stall"), None)
    tried = [r for r in records(agent, "dataloader") if "before" in r]
    assert tried and (tried[0]["before"]["num_workers"], tried[0]["after"]["num_workers"]) == (cores, cores + 1), \
        json.dumps([decisions(agent), finding and finding["evidence"]], default=str)
    # Kept where the test's own clock says clearly faster: by the mean, as two workers started
    # together deliver together (steps of 11 and 70 ms in turn, a median that reads either).
    clock.check(tried[0], tried, average=statistics.mean)
    assert loader.num_workers == cores, "detach puts the job's own settings back"


class Detections(Dataset):
    """Images with a few boxes each, as detection datasets return them: an image tensor and a
    target dict of boxes and labels a sample, cheap to make (a seeded draw)."""

    def __len__(self) -> int:
        return 16 * 1000

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        boxes = 1 + index % 4
        return (torch.rand(3, 32, 32, generator=generator),
                {"boxes": torch.rand(boxes, 4, generator=generator),
                 "labels": torch.randint(0, 5, (boxes,), generator=generator)})


def detection_collate(batch):
    return tuple(zip(*batch))  # torchvision's detection reference: images and targets stay lists


@one_intra_op_thread()
def detection_run(steps: int, workers: int, agent_options: dict, after_step) -> tuple:
    """A detection-shaped loop (torchvision's references/detection: a list of images and a
    list of target dicts a batch) over `workers` loader workers; the GPU's work is a 10 ms wait
    as the host sees it. Returns (agent, loader)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Detections(), batch_size=16, shuffle=True, num_workers=workers, collate_fn=detection_collate)
    agent = tuneup.attach(**agent_options)
    step = 0
    try:
        while step < steps:
            for images, targets in loader:
                optimizer.zero_grad()
                predicted = model(torch.stack(images))
                loss = nn.functional.mse_loss(predicted, torch.stack([target["boxes"][0] for target in targets]))
                time.sleep(0.01)
                loss.backward()
                optimizer.step()
                step += 1
                if after_step(step, agent) or step >= steps:
                    break
            else:
                continue
            break
    finally:
        agent.detach()
    return agent, loader


def test_more_workers_than_cores_whose_wait_is_the_shipping_go_to_none_first(run_dir):
    """Ground truth from the code: each batch is 16 images and 32 target tensors, 48 tensors
    that a worker ships one by one (a shared-memory segment and a connection each, in the
    training process: measure/transfer.py), while making one costs a few hundred microseconds
    of seeded draws. With two workers more than the usable cores, the workers keep ahead (a
    batch waits in the queue) and the loop's wait is receiving them: fewer workers would ship
    every batch still; with none the batch is made in the loop, without shipping. So the first
    move is straight to none (it went to the usable cores first), and it pays: kept where the
    test's own clock says clearly faster."""
    from tuneup.measure.host import usable_cores

    workers = int(usable_cores()) + 2
    clock = StepClock(then=lambda step, agent: any(r["decision"] in ("kept", "reverted") for r in records(agent, "dataloader")))
    agent, loader = detection_run(600, workers, apply_options(run_dir, actions=["dataloader"]), clock)
    tried = [r for r in records(agent, "dataloader") if "before" in r]
    assert tried and (tried[0]["before"]["num_workers"], tried[0]["after"]["num_workers"]) == (workers, 0), \
        decisions(agent)
    clock.check(tried[0], tried)
    assert loader.num_workers == workers, "detach puts the job's own settings back"


def test_a_rejected_worker_count_has_its_neighbour_tried(run_dir):
    """Ground truth from the code: batches take 10 ms in-process (16 samples of 0.625 ms)
    against a 4 ms step; in a pool of n > 1 workers every sample costs 5n x, so n workers
    make a batch every 50 ms whatever n (slower than none, ~14 ms a step, and than the 23-36
    ms steps none ran beside busy processes, where pools of 30 ms a batch once measured 1.2x
    faster and were kept, rightly) and one worker one every 10 ms, overlapped with the step. The estimate (1.25 x the wait over the rest of the
    step, 3.1: the usable cores, 2 on a 2-core machine) is rejected, and so is every count
    above one; the neighbour halfway to it, down to one, is what pays. The split leaves room
    for a loaded machine: with 8 ms batches against 5 ms (an estimate of 2.0) CI's full suite
    once stretched the step's own part past the batch's and the estimate said one, which left
    no count to reject. The step's own wait varies by +-90% (a seeded stream of the test's),
    so windows (up to a second of ~14 ms steps) are longer than the 24 steps apply mode waits
    after undoing a trial, and the undone trial's baseline serves the next."""
    class SlowerInPools(SlowIndexed):
        def __getitems__(self, indices: list[int]):
            info = get_worker_info()
            if info is not None and info.num_workers > 1:
                time.sleep(self.latency * len(indices) * (5 * info.num_workers - 1))
            return super().__getitems__(indices)

    def one_decided(step, agent):
        return any(r["after"]["num_workers"] == 1 for r in records(agent, "dataloader")
                   if r["decision"] in ("kept", "reverted") and "after" in r)

    clock = StepClock(then=one_decided)
    _, _, _, agent, _ = io_bound_run(1500, dataset=SlowerInPools(latency=0.000625), compute=0.004,
                                     after_step=clock, jitter=0.9,
                                     agent_options=apply_options(run_dir, actions=["dataloader"]),
                                     generator=torch.Generator().manual_seed(0))
    tried = [r for r in records(agent, "dataloader") if "before" in r]
    moves = [(r["before"]["num_workers"], r["after"]["num_workers"], r["decision"])
             for r in tried if r["before"]["num_workers"] != r["after"]["num_workers"]]
    assert len(moves) >= 2 and moves[0][0] == 0 and moves[0][1] >= 2 and moves[0][2] == "reverted", decisions(agent)
    # Each next count is halfway to the rejected one (2 -> 1 on two cores; 4 -> 2 -> 1 on four).
    for (_, rejected, _), move in zip(moves, moves[1:]):
        assert move[:2] == (0, rejected // 2), decisions(agent)
    assert moves[-1][1] == 1, decisions(agent)
    # Kept where it paid: idle, 1.4x by the test's clock.
    clock.check(next(r for r in tried if r["after"]["num_workers"] == 1), tried)
    # The neighbour's trial compares against the undone trial's baseline (the same settings,
    # a window earlier) instead of waiting a whole window again.
    first, second = tried[:2]
    window = second["trial"]["steps"]
    # The premise: windows longer than the MIN_WINDOW steps waited after an undo (a noise-sized
    # window, at least half a second of steps: ~40-70 steps of ~14 ms here), so the next trial's
    # baseline needs steps from before the undone trial.
    from tuneup.act.experimenter import MIN_WINDOW

    assert window > MIN_WINDOW, second["trial"]
    # Started once 24 steps ran with the job's settings again (after the settle steps and at
    # most one look's wait), not a whole window later: its baseline began before the undone
    # trial's change. (Step counts alone cannot tell the two apart where a window is near 24
    # steps: a busy run's first trial took 31 steps with its settle, the wait after it 32.)
    assert second["baseline"]["first_step"] < first["applied_step"], (first["baseline"], second["baseline"])


def test_apply_mode_ticks_early_until_the_rules_have_seen_their_first_steps(run_dir):
    """Ground truth from the code: steps of 50 ms (a sleep) under apply mode with a 2 s
    interval. The rules judge from WARMUP_STEPS + MIN_STEPS = 40 steps (2 s of them); until a
    tick finds them in the ring, ticks come every 0.5 s, so two have come before the first
    regular one would have, at 2 s; after that the interval is the user's again."""
    from tuneup.diagnose.rule import MIN_STEPS
    from tuneup.measure.history import WARMUP_STEPS
    from tuneup.ticker import EARLY_TICKS

    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        time.sleep(0.05)
        optimizer.step()

    interval = 2.0
    with tuneup.attach(**apply_options(run_dir, interval=interval)) as agent:
        ticker, began = agent.ticker, time.monotonic()
        while ticker.ticks < 2 and time.monotonic() - began < 30:
            step()
        assert ticker.ticks >= 2 and time.monotonic() - began < interval, (ticker.ticks, time.monotonic() - began)
        while ticker.early and time.monotonic() - began < 60:
            step()
        assert not ticker.early and agent.recorder.timeline.ring.count >= WARMUP_STEPS + MIN_STEPS
        ticks, since = ticker.ticks, time.monotonic()
        while time.monotonic() - since < interval / EARLY_TICKS * 3:
            step()
        assert ticker.ticks - ticks <= 1  # 1.5 s at the 2 s interval: one tick at most


def test_every_finding_apply_mode_can_make_gets_a_trial_or_a_reason_in_a_400_step_run(run_dir):
    """Ground truth from the code: the slow loader stalls (data-stall, the dataloader action) and
    the loop zeroes gradients in place (zero_grad(set_to_none=False): zero-grad-keeps-tensors, the
    zero-grad action). Every finding that says apply mode can make it gets, within the run, a
    record of a trial or of why not."""
    from tuneup.act.actions import ACTIONS

    offered: set[str] = set()
    last: list[dict] = []  # the records as the 400th step left them: detach ends any trial still on

    def watch(step, agent):
        offered.update(f["rule"] for f in agent.findings() if f["can_apply"])
        last[:] = [dict(r) for r in agent.actions()]
        return False

    _, _, _, agent, _ = io_bound_run(400, set_to_none=False, agent_options=apply_options(run_dir), after_step=watch)
    assert {"data-stall", "zero-grad-keeps-tensors"} <= offered, offered
    acted = {rule for r in agent.actions() for rule in ACTIONS[r["action"]].fixes}
    assert offered <= acted, decisions(agent)
    # Every applicable action (the loader's and zero_grad's) was tried, not only recorded
    tried = {r["action"] for r in last if r.get("applied_step")}
    assert {"dataloader", "zero-grad"} <= tried, decisions(agent)
    # One trial at a time: at the 400th step, at most the latest is still on, every earlier one decided
    on = [r for r in last if r["decision"] == "trying"]
    assert len(on) <= 1 and all(r["id"] == max(t["id"] for t in last if t.get("applied_step")) for r in on), \
        decisions(agent)


def test_workers_failing_epochs_after_a_kept_change_lose_no_batch_and_end_the_tuning(run_dir):
    """A kept configuration's workers fail later (the files moved, a worker was OOM-killed):
    the job does not crash, sees the same batches, and runs with its own settings again."""
    state = {}

    def break_workers_after_the_first_kept_change(step, agent):
        kept = agent is not None and records(agent, "dataloader", "kept")
        if kept and "at" not in state:
            state["at"] = step
            dataset.fail_in_workers = True  # workers started from here on cannot read
        return "at" in state and bool(records(agent, "dataloader", "rolled back"))

    # Until the rollback: the workers that fail are the next epoch's (100 steps), and a change
    # kept at the close of an epoch's last step is known only once the next epoch's workers
    # started (the close waits for the next batch), so they may be the epoch after.
    dataset = SlowIndexed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches, _, _, agent, loader = io_bound_run(600, dataset=dataset, agent_options=apply_options(run_dir),
                                                    after_step=break_workers_after_the_first_kept_change)
    plain, _, _, _, _ = io_bound_run(len(batches))
    assert "at" in state and batches == plain, decisions(agent)
    loader_records = records(agent, "dataloader")
    rolled = [r for r in loader_records if r["decision"] == "rolled back"]
    assert rolled and all("cannot be read" in r["reason"] or "cannot be opened" in r["reason"] for r in rolled), decisions(agent)
    assert not [r for r in loader_records if r["decision"] == "kept"]  # every loader change went
    assert loader.num_workers == 0


# A pass of Timed's (a sleep): what a pass of its work in fp32 would cost where bf16 units
# made it nearly free. Sleeps, not work: on a CPU without bf16 units (an AMD EPYC with AVX2
# only) bf16 autocast made a 256-512-512-10 MLP's step 14x slower than fp32 and this one's 3x
# (1.6 ms against 0.5), so "more fp32 passes" was no premise there; a sleep is the same on every
# CPU and no load beside the test lengthens it.
PASS_SECONDS = 0.0015


class Timed(nn.Module):
    """A small MLP that notes, per training forward, whether autocast was on (tuneup puts it
    around forward). With autocast off its forward also waits 4 passes (PASS_SECONDS each:
    6 ms, against the ~2 ms its layers take under bf16 autocast on a CPU without bf16 units),
    so bf16 autocast is measurably faster on every CPU, loaded or not (amp-off fires on the
    measured gain: measure/precision.py). With `slow_under_autocast=k` and `slow` set, it
    waits k passes under autocast instead: a precision change that makes steps slower.

    Forwards with weights other than its own parameters (the precision trial's, through
    torch.func.functional_call) are not the job's steps: they are not noted."""

    def __init__(self, slow_under_autocast: int = 0) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                    nn.Linear(64, 10))
        self.autocast: list[bool] = []
        self.slow_under_autocast = slow_under_autocast
        self.slow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled("cpu")
        if isinstance(self.layers[0].weight, nn.Parameter):
            self.autocast.append(autocast)
        passes = (self.slow_under_autocast if self.slow else 0) if autocast else 4
        if passes:
            time.sleep(passes * PASS_SECONDS)
        return self.layers(x)


@pytest.fixture(autouse=True)
def clear_amp_gain(request, monkeypatch):
    """The tests of AMP's guards and reverts need apply mode to switch AMP on, which it does only
    on a gain measured off the job's steps in >= 90% of the pairs (measure/precision.py). Timed
    is 5x the work in fp32, but beside busy processes a pair or two can still come out the other
    way; where the timing's medians say autocast is faster, its pairs are counted all faster
    here. The 90% rule itself is tested on the timing's own result (the not-clear and not-paying
    tests below, which opt out, and test_rules_recorded)."""
    if request.node.get_closest_marker("own_amp_timing"):
        return
    from tuneup.measure.precision import PrecisionTrial

    measure = PrecisionTrial._time

    def clear(self, *args, **kwargs):
        result = measure(self, *args, **kwargs)
        if result.get("pairs") and result.get("speedup", 0) > 1:
            result = dict(result, faster_pairs=result["pairs"])
        return result

    monkeypatch.setattr(PrecisionTrial, "_time", clear)


@one_intra_op_thread()
def amp_run(run_dir, steps, *, on_step=None, after_backward=None, scaler=None, actions=("amp",),
            slow_under_autocast=0):
    """Train `Timed` under apply mode with the CPU's bf16 capability claimed (the documented
    cpu_bf16 option): amp-off fires on the gain measured on the model and apply mode tries
    AMP, whatever CPU the suite runs on. Until every record is decided and 150 steps more, at
    most `steps` (20,000 in the tests: a decision waits for findings evaluated every `interval`
    seconds, so it comes after a time rather than a number of steps, which load changes). A model slow under autocast is made so only once
    that gain was measured (a model whose inputs grow, say).

    On one intra-op thread, so that a step's time is its work: with two threads and two other
    busy processes on two cores, each op's threads waited for one another to be scheduled, a
    step took 0.2 s instead of 1 ms, and 12x the work made it only 2.4x slower."""
    torch.manual_seed(0)
    model = Timed(slow_under_autocast)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    agent = tuneup.attach(**apply_options(run_dir, actions=list(actions), cpu_bf16=True))
    times = []
    try:
        for step in range(1, steps + 1):
            began = time.perf_counter()
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if on_step is not None:
                loss = on_step(step, loss, model, optimizer, agent)
            if scaler is not None:
                scaler.scale(loss).backward()
                if after_backward is not None:
                    after_backward(step, model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            times.append(time.perf_counter() - began)
            model.slow = agent.recorder.precision.state == "done"
            made = [r for r in records(agent) if r["decision"] != "not chosen"]  # (an action left out: a note)
            if step > 200 and made and all(r["decision"] != "trying" for r in made) \
                    and step > max(r.get("decided_step") or 0 for r in made) + 150:
                break
    finally:
        agent.detach()
    return agent, model, optimizer, times


def test_autocast_never_wraps_the_jobs_evaluation_or_no_grad_forwards(run_dir):
    """Ground truth from the loop: every 5th step it runs its model once in eval() mode under
    no_grad (a validation metric) and once in train() mode under no_grad (a sampler); Timed
    notes whether autocast was on in each. While AMP is applied the training forwards run
    under autocast; those two never do."""
    x_eval = torch.randn(16, 256)
    seen = []  # (step, autocast) of the loop's own evaluation and no-grad forwards

    def on_step(step, loss, model, optimizer, agent):
        if step % 5 == 0:
            model.eval()
            with torch.no_grad():
                model(x_eval)
            seen.append((step, model.autocast.pop()))  # kept out of the training forwards' list
            model.train()
            with torch.no_grad():
                model(x_eval)
            seen.append((step, model.autocast.pop()))
        return loss

    agent, model, _, _ = amp_run(run_dir, 20000, on_step=on_step)
    [record] = records(agent, "amp")
    applied = record["applied_step"]
    ended = record.get("decided_step") if record["decision"] != "kept" else len(model.autocast)
    assert all(model.autocast[applied + 1: ended]), record  # the training forwards: under autocast
    during = [autocast for step, autocast in seen if applied < step <= ended]
    assert len(during) >= 2 and not any(during)


def test_a_kept_amp_change_is_reported_on_its_finding_with_the_step_the_run_changed_from(run_dir):
    """Ground truth from the code: Timed waits 4 passes when autocast is off, so apply
    mode's bf16 autocast (the CPU's bf16 claimed) makes its steps faster and is kept. The job
    as written has no autocast: the final report still advises it (amp-off, not silenced by the
    autocast tuneup itself put on), and the finding says that apply mode made it, and from which
    step the run's numerics differ from the job's own (the step after the close that applied it)."""
    agent, model, _, _ = amp_run(run_dir, 20000)
    [record] = records(agent, "amp")
    assert record["decision"] == "kept", decisions(agent)
    # Ground truth of the first step under autocast, from the model's own notes (its list holds
    # step n's forward at n - 1): the step after the next, as this loop has no fetch: its steps
    # close at the next optimizer step, after the next step's forward.
    first = model.autocast.index(True) + 1
    assert record["effective_step"] == first == record["applied_step"] + 2, (record, first)
    # Its settle steps, costed as the trial's, are its own: from that first step, not the
    # old setting's step before it
    assert record["settle"]["steps"] == amp_action.AmpChange.settle_steps, record["settle"]
    document = json.loads(agent.report("json"))
    [finding] = [f for f in document["findings"] if f["rule"] == "amp-off"] or [document["findings"]]
    assert finding["applied"]["id"] == record["id"] and finding["applied"]["decision"] == "kept"
    # A gain is said as one: a ratio above 1, faster or (where the judge was not certain on a
    # busy machine: 1.29x in one full-suite run) not slower, never a slowdown.
    said_gain = re.match(r"([\d.]+)x (faster|\(not slower\))", record["reason"])
    assert said_gain and float(said_gain.group(1)) > 1, record["reason"]
    said = f"apply mode made it (change {record['id']}): {record['change']}, kept from step {first}"
    assert said in agent.report("markdown")
    assert said in " ".join(agent.report("text").split())  # wrapped to the terminal's width there
    assert said in agent.report("html")


@pytest.mark.own_amp_timing
@one_intra_op_thread()
def test_a_job_where_amp_does_not_pay_ends_bit_identical_to_plain_python(run_dir):
    """Ground truth from the code: Timed(slow_under_autocast=8) with `slow` set from the start
    waits 8 passes under autocast against 4 in fp32, so bf16 never pays on this model, measured
    off the job's steps or on them. Apply mode with every action allowed must leave no trace:
    the final parameters equal those of the same loop without tuneup, bit for bit."""
    def train(agent_options=None):
        torch.manual_seed(0)
        model = Timed(slow_under_autocast=8)
        model.slow = True
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        agent = tuneup.attach(**agent_options) if agent_options else None
        try:
            for _ in range(400):
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        finally:
            if agent is not None:
                agent.detach()
        return [p.detach().clone() for p in model.parameters()], model, agent

    plain, _, _ = train()
    tuned, model, agent = train(apply_options(run_dir, cpu_bf16=True))
    # The premise, measured: the timing off the job's steps ran and found no clear gain (beside
    # busy processes its figure is noise, but not a clear one: measure/terms.shadow_refusal).
    trial = agent.recorder.precision.result
    assert trial and trial.get("pairs") and shadow_refusal(trial) is not None, trial
    assert not any(model.autocast) and not records(agent, "amp"), decisions(agent)
    assert all(torch.equal(a, b) for a, b in zip(plain, tuned))


@pytest.mark.own_amp_timing
def test_amp_off_does_not_promise_apply_mode_for_a_forward_set_on_the_instance(run_dir, monkeypatch):
    """Ground truth from the loop: Timed, whose forward is set on the instance as Accelerate's
    prepare() wraps a model's (`model.forward = ...`, calling the class's forward). The AMP
    action puts autocast on the class's forward and refuses such a model; amp-off asks the same
    test (measure/config.py amp_refusal), so it fires on the gain measured off the job's steps
    but says apply mode cannot make it, with the action's own reason; the action's record says
    that reason, and no training forward ran under autocast. The timing is made to say a clear
    3x (claimed, not made: whether bf16 pays on a CPU is the machine's; on this suite's 2-core
    machine the real one said 0.18x), so the premise, amp-off firing, is the code's."""
    from tuneup.measure.precision import PrecisionTrial

    measure = PrecisionTrial._time

    def three_times(self, *args, **kwargs):
        result = measure(self, *args, **kwargs)
        if not result.get("pairs"):
            return result
        return dict(result, reduced_seconds=result["fp32_seconds"] / 3, speedup=3.0, faster_pairs=result["pairs"])

    monkeypatch.setattr(PrecisionTrial, "_time", three_times)
    torch.manual_seed(0)
    model = Timed()
    own = model.forward

    def forward(*args, **kwargs):  # the instance's own, around the class's
        return own(*args, **kwargs)

    model.forward = forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    agent = tuneup.attach(**apply_options(run_dir, actions=["amp"], cpu_bf16=True))
    try:
        for _ in range(20000):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if records(agent, "amp"):
                break
    finally:
        agent.detach()
    [record] = records(agent, "amp")
    [finding] = [f for f in agent.findings() if f["rule"] == "amp-off"]
    assert record["decision"] == "not applicable" and "Timed.forward is replaced on the instance" in record["reason"]
    assert finding["evidence"]["measured"], finding["evidence"]  # fired on the gain measured on the model
    assert finding["can_apply"] is False and finding["evidence"]["not_applicable"] == record["reason"], finding
    assert "apply mode can make it" not in agent.report("text")
    assert not any(model.autocast)


@pytest.mark.own_amp_timing
def test_amp_on_a_gain_that_is_not_clear_is_left_to_the_user_with_the_reason(run_dir, monkeypatch):
    """Timed's gain under autocast is real (4 passes waited in fp32, none under it), but the timing off the
    job's steps is made to say "faster in 10 of 12 pairs": enough for amp-off (75%), not for
    apply mode to change the run's numerics (90%): no step runs under autocast, and the record
    says why."""
    from tuneup.measure.precision import PrecisionTrial

    measure = PrecisionTrial._time

    def close_call(self, *args, **kwargs):
        result = measure(self, *args, **kwargs)
        return dict(result, pairs=12, faster_pairs=10) if result.get("pairs") else result

    monkeypatch.setattr(PrecisionTrial, "_time", close_call)
    agent, model, _, _ = amp_run(run_dir, 600)
    assert [f for f in agent.findings() if f["rule"] == "amp-off"], "the premise: amp-off fires"
    [record] = records(agent, "amp")
    assert record["decision"] == "not applicable" and "faster in 10 of 12 pairs" in record["reason"], record
    assert not any(model.autocast)


@pytest.mark.own_amp_timing
def test_amp_whose_measured_gain_is_a_small_share_of_the_step_is_left_to_the_user(run_dir, monkeypatch):
    """Timed's gain under autocast is real and clear (4 passes waited in fp32, none under it), but the
    model's compute is claimed to be 7.5% of the job's step (the window's forward + backward
    share, which bounds amp-off's gain: rules/precision.py): what autocast saves is under the
    10% a trial's windows resolve. amp-off fires (>= 5% of a step) and apply mode leaves the
    run's numerics alone, with the reason in the record (it kept such a change as "1.01x: not
    slower"). Claimed, not made: made with a sleep after each forward (7.5% idle), the timing
    off the steps and the steps' median, taken at different moments, came out at 10-13% beside
    two other busy processes, and the change was tried."""
    from tuneup.diagnose.rules import precision as precision_rules
    from tuneup.measure.precision import PrecisionTrial

    measure = PrecisionTrial._time

    def clear(self, *args, **kwargs):
        result = measure(self, *args, **kwargs)
        return dict(result, faster_pairs=result["pairs"]) if result.get("pairs") else result

    monkeypatch.setattr(PrecisionTrial, "_time", clear)
    monkeypatch.setattr(precision_rules, "_compute_share", lambda facts: 0.075)
    agent, model, _, _ = amp_run(run_dir, 3000)
    [record] = records(agent, "amp")
    assert record["decision"] == "not applicable" and "under the 10% a trial" in record["reason"], record
    assert not any(model.autocast)
    [finding] = [f for f in agent.findings() if f["rule"] == "amp-off"] or [None]
    assert finding is not None and 0.05 <= finding["gain"] < 0.10, ("the premise", finding)
    # The finding promises nothing apply mode will not do, and says why.
    assert not finding["can_apply"] and "under the 10%" in finding["evidence"]["not_applicable"], finding


def test_a_change_that_makes_steps_slower_is_reverted_with_speed_and_settings_restored(run_dir):
    forward = vars(Timed)["forward"]
    agent, model, _, times = amp_run(run_dir, 20000, slow_under_autocast=60)
    [record] = records(agent, "amp")
    assert record["decision"] == "reverted" and record["speedup"] < 0.8, record
    # Measured clearly faster off the job's steps (Timed: 4 passes waited in fp32, none under autocast), so
    # switched on to stay unless the job's steps are slower, which they are here (15x the passes waited).
    assert record["criterion"] == "not slower" and "slower" in record["reason"], record
    assert record["after"]["autocast"] == "cpu bfloat16" and record["before"]["autocast"] is None
    applied, decided = record["applied_step"], record["decided_step"]
    # Autocast was on exactly between the change and its revert, and off again after.
    assert not any(model.autocast[: applied])
    assert all(model.autocast[applied + 1: decided])
    assert not any(model.autocast[decided + 1:])
    # Apply mode's baseline is measured over time, not steps: on a loaded machine fewer than
    # 100 steps may precede the change.
    baseline = statistics.median(times[max(5, applied - 100): applied])
    trial = statistics.median(times[applied + 10: decided])
    after = statistics.median(times[decided + 10:])
    # The forward waits 15x its fp32 passes under autocast (60 against 4: Timed): a margin no machine load closes
    # between windows a few seconds apart. Autocast off again (asserted above) takes it away.
    assert trial > 3 * baseline, (baseline, trial)
    assert after < trial / 3, (baseline, trial, after)
    assert vars(Timed)["forward"] is forward  # the class is as the job defined it (after detach)


def test_a_nonfinite_loss_right_after_amp_rolls_back_within_one_step_with_no_update_applied(run_dir):
    state = {}

    def inject(step, loss, model, optimizer, agent):
        if "step" not in state and model.autocast[-1]:
            state["step"] = step
            state["params"] = [p.detach().clone() for p in model.parameters()]
            state["momentum"] = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            return loss * float("nan")
        if state.get("step") == step - 1:
            state["after"] = [p.detach().clone() for p in model.parameters()]
            state["momentum_after"] = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        return loss

    agent, model, optimizer, _ = amp_run(run_dir, 20000, on_step=inject)
    [record] = records(agent, "amp")
    assert record["decision"] == "rolled back", record
    assert record["decided_step"] == state["step"] and "non-finite" in record["reason"]
    assert "update was skipped" in record["reason"]
    assert model.autocast[state["step"]] is False  # the very next forward runs in fp32
    # The poisoned step changed nothing: parameters and momentum exactly as before it.
    assert all(torch.equal(a, b) for a, b in zip(state["params"], state["after"]))
    assert all(torch.equal(a, b) for a, b in zip(state["momentum"], state["momentum_after"]))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(s["momentum_buffer"]).all() for s in optimizer.state.values())


def test_fp16_switches_on_the_loops_own_grad_scaler_and_a_revert_restores_it_exactly(run_dir,
                                                                                    monkeypatch):
    monkeypatch.setattr(amp_action, "bf16_supported", lambda device, index=None: False)  # a GPU without bf16
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    before = dict(vars(scaler))
    seen = {}

    def watch(step, loss, model, optimizer, agent):
        if model.autocast[-1]:
            seen.setdefault("scaled", float(scaler.scale(loss.detach())) / float(loss.detach()))
            seen.setdefault("enabled", scaler.is_enabled())
        return loss

    agent, model, _, _ = amp_run(run_dir, 20000, on_step=watch, scaler=scaler)
    [record] = records(agent, "amp")
    assert record["change"].endswith("GradScaler enabled") and record["after"]["autocast"] == "cpu float16"
    assert seen == {"enabled": True, "scaled": 65536.0}
    # fp16 on a CPU is far slower than bf16, not always than Timed's fp32 (4 passes waited): reverted
    # by its trial, or kept and undone at detach, the scaler is the loop's own again either way.
    assert record["decision"] == "reverted" or record["undone"]["reason"] == "detach", record
    assert vars(scaler) == before and not scaler.is_enabled()


def test_a_burst_of_skipped_steps_rolls_amp_back(run_dir, monkeypatch):
    monkeypatch.setattr(amp_action, "bf16_supported", lambda device, index=None: False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = {}

    def overflow(step, model):
        if model.autocast[-1]:
            state.setdefault("first", step)
            if state["first"] + 25 <= step < state["first"] + 31:
                with torch.no_grad():  # an fp16 overflow in backward: GradScaler skips these steps
                    next(model.parameters()).grad.view(-1)[0] = float("inf")

    def io_wait(step, loss, model, optimizer, agent):
        # Most of each step a sleep: fp16 autocast on a CPU (slow there, slower on a busy
        # machine) must not make the trial 3x slower than its baseline, which cuts it short
        # (experimenter.DEADLINE_FACTOR) before the burst, past the scaler's calibration steps.
        time.sleep(0.004)
        return loss

    agent, model, _, _ = amp_run(run_dir, 20000, on_step=io_wait, after_backward=overflow, scaler=scaler)
    [record] = records(agent, "amp")
    assert record["decision"] == "rolled back" and "burst" in record["reason"], record
    assert state["first"] + 29 <= record["decided_step"] <= state["first"] + 32
    assert not scaler.is_enabled()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_set_to_none_puts_zeros_back_for_a_parameter_that_got_no_gradient(run_dir):
    class TwoBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
            self.use_b = True

        def forward(self, x):
            return self.a(x) + (self.b(x) if self.use_b else 0)

    def run(skip_b_at=None, options=None):
        torch.manual_seed(0)
        model = TwoBranches()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.01)
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        agent = tuneup.attach(**options) if options else None
        skipped = skip_b_at
        try:
            for step in range(1, 4000):
                if skipped is None and agent is not None and records(agent, "zero-grad", "trying"):
                    skipped = step + 3  # a step some time after the change, without branch b
                model.use_b = step != skipped
                optimizer.zero_grad(set_to_none=False)
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                if skipped is not None and step > skipped + 50:
                    break
        finally:
            if agent is not None:
                agent.detach()
        return model, skipped, agent

    tuned, skipped_at, agent = run(options=apply_options(run_dir, actions=["zero-grad"]))
    plain, _, _ = run(skip_b_at=skipped_at)
    [record] = records(agent, "zero-grad")
    assert record["decision"] == "rolled back" and record["decided_step"] == skipped_at, record
    assert "got no gradient" in record["reason"]
    # With zeros put back, branch b's momentum and weight decay moved it exactly as without tuneup.
    assert all(torch.equal(a, b) for a, b in zip(tuned.parameters(), plain.parameters()))


def test_revert_all_undoes_every_change_and_nothing_more_is_tried(run_dir):
    state = {}

    def revert_after_first_kept(step, agent):
        if "reverted_at" not in state and records(agent, decision="kept"):
            state["settings"] = [dict(r["after"]) for r in records(agent, decision="kept")]
            state["undone"] = agent.revert_all()
            state["reverted_at"] = step

    _, _, _, agent, loader = io_bound_run(150, set_to_none=False, after_step=revert_after_first_kept,
                                          agent_options=apply_options(run_dir))
    assert state.get("undone", 0) >= 1, decisions(agent)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (0, None, False)
    kept = records(agent, decision="kept")
    assert kept and all(r["undone"]["reason"] == "revert_all()" for r in kept)
    assert all(r["time"] <= time.time() for r in agent.actions())
    tried_after = [r for r in agent.actions() if (r.get("applied_step") or 0) > state["reverted_at"]]
    assert tried_after == []


def test_detach_reverts_a_change_on_trial(run_dir):
    def detach_during_the_trial(step, agent):
        if records(agent, "zero-grad", "trying"):
            agent.detach()

    _, _, _, agent, _ = io_bound_run(120, set_to_none=False, after_step=detach_during_the_trial,
                                     agent_options=apply_options(run_dir, actions=["zero-grad"]))
    [record] = records(agent, "zero-grad")
    assert record["decision"] == "reverted" and record["reason"] == "detach before the trial ended"
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
    assert model.weight.grad is not None  # zero_grad is torch's own again


def test_the_allow_list_limits_what_apply_mode_touches(run_dir, monkeypatch):
    _, _, _, agent, loader = io_bound_run(120, set_to_none=False,
                                          agent_options=apply_options(run_dir, actions="zero-grad"))
    assert {r["action"] for r in agent.actions() if r["decision"] != "not chosen"} == {"zero-grad"}
    # the loader stalls: its action, left out, is said to be (a record, no change)
    assert [(r["action"], r.get("applied_step")) for r in agent.actions() if r["decision"] == "not chosen"] == \
        [("dataloader", None)]
    assert loader.num_workers == 0
    with pytest.raises(ValueError, match="unknown action 'workers'.*dataloader, amp, cudnn-benchmark, zero-grad"):
        tuneup.attach(mode="apply", actions="workers")
    with pytest.raises(ValueError, match=r"mode='turbo'.*advise, apply"):
        tuneup.attach(mode="turbo")
    monkeypatch.setenv("TUNEUP_ACTIONS", "amp,nonsense")
    with pytest.warns(tuneup.TuneupWarning, match="TUNEUP_ACTIONS='amp,nonsense'.*apply mode takes no action"):
        agent = tuneup.attach(mode="apply", run_dir=run_dir / "env")
    agent.detach()
    assert agent.options.actions == ()  # not the default (every action): a typo allows none


def test_decisions_reach_the_run_log_the_report_and_the_metrics(run_dir):
    scraped = {}

    def scrape(step, agent):
        if "text" not in scraped and records(agent, decision="kept"):
            with urllib.request.urlopen(f"{agent.server.url}/metrics", timeout=5) as response:
                scraped["text"] = response.read().decode()
            agent.ticker.tick()  # the background thread's next drain, now: the decision reaches the events
            console = Console(record=True, width=200)
            console.print(live_frame(agent.server.url)[0])
            scraped["watch"] = console.export_text()

    _, _, _, agent, _ = io_bound_run(150, after_step=scrape, agent_options=apply_options(run_dir))
    kept = records(agent, "dataloader", "kept")
    assert kept, decisions(agent)
    kept = kept[0]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    logged = [e for e in events if e["event"] == "action" and e["id"] == kept["id"]]
    assert [e["decision"] for e in logged] == ["trying", "kept", "kept"]  # tried, kept, undone at detach
    assert logged[-1]["undone"]["reason"] == "detach" and logged[1]["speedup"] == kept["speedup"]
    families = {f.name: f for f in text_string_to_metric_families(scraped["text"])}
    rank = {"rank": "0", "local_rank": "0"}  # every tuneup_ series carries the job's rank
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in (*rank, "training_job")))): s.value
               for f in families.values() for s in f.samples if all(s.labels.get(k) == v for k, v in rank.items())}
    assert samples[("tuneup_apply_decisions_total", (("action", "dataloader"), ("decision", "kept")))] == 1
    assert samples[("tuneup_apply_changes_in_effect", (("action", "dataloader"),))] >= 1
    assert samples[("tuneup_apply_speedup_ratio", (("action", "dataloader"),))] == pytest.approx(kept["speedup"])
    assert "Changes tuneup made (apply mode)" in scraped["watch"]
    assert f"kept from step {kept['applied_step'] + 1}  {kept['change']}" in scraped["watch"]
    report = agent.report("markdown")
    assert "## Changes tuneup made" in report and kept["change"] in report
    assert f"{kept['speedup']:.2f}x" in report


def test_a_failing_change_is_reverted_and_the_other_actions_go_on(run_dir, monkeypatch):
    def broken(self):
        raise RuntimeError("cannot switch today")

    monkeypatch.setattr(LoaderChange, "apply", broken)
    batches, _, _, agent, loader = io_bound_run(150, set_to_none=False,
                                                agent_options=apply_options(run_dir, actions=["zero-grad", "dataloader"]))
    assert len(batches) == 150
    [failed] = records(agent, "dataloader")
    assert failed["decision"] == "failed" and "cannot switch today" in failed["reason"]
    assert loader.num_workers == 0
    assert [r["decision"] for r in records(agent, "zero-grad")] != []  # the other action still ran


class Augmented(SlowIndexed):
    """Random augmentation drawn from torch's global RNG, wherever the sample is loaded."""

    def __getitems__(self, indices: list[int]):
        return [(x + torch.rand(1), y, index) for x, y, index in super().__getitems__(indices)]


def noise_of(x, y, index):
    return x[:, 0].tolist()


def epochs(seen, size):
    return [tuple(map(tuple, seen[start:start + size])) for start in range(0, len(seen) - size + 1, size)]


def test_a_dataset_drawing_from_the_global_rng_keeps_its_order_and_its_workers_get_fresh_seeds(run_dir):
    """With the loader shuffling by the global RNG, moving such a dataset into workers would
    reorder later epochs: tuneup leaves num_workers alone. With its own generator the order
    cannot move, so tuneup adds workers, and their augmentation differs from epoch to epoch."""
    plain, _, plain_rng, _, _ = io_bound_run(120, dataset=Augmented())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned, _, tuned_rng, agent, loader = io_bound_run(120, dataset=Augmented(), agent_options=apply_options(run_dir))
    assert tuned == plain and torch.equal(tuned_rng, plain_rng)
    [refused] = [r for r in records(agent, "dataloader") if r["decision"] == "not applicable"]
    assert "global RNG" in refused["reason"] and "generator=torch.Generator()" in refused["reason"]
    assert records(agent, "dataloader", "kept") == [] and loader.num_workers == 0

    order = torch.Generator().manual_seed(1)
    clock = StepClock()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        noise, _, _, agent, _ = io_bound_run(500, dataset=Augmented(),
                                             generator=order, observe=noise_of, after_step=clock,
                                             agent_options=apply_options(run_dir / "own-generator"))
    tried = [r for r in records(agent, "dataloader") if r.get("trial")]
    assert tried and tried[0]["after"]["num_workers"] > 0, decisions(agent)  # workers tried: the order cannot move
    clock.check(tried[0], tried)  # kept where the test's own clock says it paid (idle: ~2x)
    if tried[0]["decision"] != "kept":
        return  # beside busy processes the gain can be too close to call, by this clock too
    later = epochs(noise, 100)[-4:]  # epochs that ran entirely on workers tuneup started
    assert len(set(later)) == len(later), "workers of different epochs drew the same augmentation"


class EagerBatches:
    """A batch sampler that draws its whole order from the global RNG as soon as an epoch
    starts (as many custom samplers do), before the loader draws its workers' seed."""

    def __init__(self, size: int, batch: int) -> None:
        self.size, self.batch = size, batch

    def __iter__(self):
        order = torch.randperm(self.size).tolist()
        return iter([order[i:i + self.batch] for i in range(0, self.size, self.batch)])

    def __len__(self) -> int:
        return self.size // self.batch


def test_an_eager_sampler_sees_the_same_order_every_epoch(run_dir):
    plain, _, plain_rng, _, _ = io_bound_run(150, batch_sampler=EagerBatches(1600, 16), batch_size=1, shuffle=False)
    tuned, _, tuned_rng, agent, _ = io_bound_run(150, batch_sampler=EagerBatches(1600, 16), batch_size=1,
                                                 shuffle=False, agent_options=apply_options(run_dir))
    assert records(agent, "dataloader", "kept"), decisions(agent)
    assert tuned == plain and torch.equal(tuned_rng, plain_rng)


def test_reverting_a_persistent_loader_between_epochs_keeps_later_epochs_in_order(run_dir):
    state = {}

    def revert_at_an_epoch_end(step, agent):
        if agent is not None and "at" not in state and records(agent, "dataloader", "kept") and step % 40 == 0:
            state["at"] = step
            agent.revert_all()

    # One worker sleeping 3 ms a sample (48 ms a batch) against a 6 ms step: a second worker
    # halves the step (the trial must be kept). With 24 ms batches the gain, 2x idle, fell to
    # 1.2-1.3x beside two busy processes (the scheduler's delay on each of a batch's wake-ups
    # weighs on a short step) and to 1.09x in CI.
    options = dict(num_workers=1, persistent_workers=True)
    plain, _, plain_rng, _, _ = io_bound_run(240, dataset=SlowIndexed(size=640, latency=0.003), compute=0.006,
                                             **options)
    tuned, _, tuned_rng, agent, loader = io_bound_run(240, dataset=SlowIndexed(size=640, latency=0.003),
                                                      compute=0.006,
                                                      agent_options=apply_options(run_dir),
                                                      after_step=revert_at_an_epoch_end, **options)
    assert "at" in state, decisions(agent)
    assert tuned == plain and torch.equal(tuned_rng, plain_rng)
    assert (loader.num_workers, loader.persistent_workers) == (1, True)


@one_intra_op_thread()  # its premise is timing, as amp_run's: amp-off fires on a measured gain
def test_a_nonfinite_update_is_skipped_for_every_optimizer_of_the_step(run_dir):
    torch.manual_seed(0)
    model = Timed()
    head, body = model.layers[-1], model.layers[:-1]
    first = torch.optim.SGD(body.parameters(), lr=0.01, momentum=0.9)
    second = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    state = {}
    with tuneup.attach(**apply_options(run_dir, actions=["amp"], cpu_bf16=True)) as agent:
        for step in range(1, 20000):  # until a few steps after AMP's first (a decision comes after a time)
            first.zero_grad()
            second.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if model.autocast[-1] and "step" not in state:
                state["step"] = step
                state["params"] = [p.detach().clone() for p in model.parameters()]
                loss = loss * float("nan")
            loss.backward()
            first.step()
            second.step()
            if state.get("step") == step:
                state["after"] = [p.detach().clone() for p in model.parameters()]
            if "step" in state and step > state["step"] + 5:
                break
    assert len(records(agent, "amp")) == 1, (decisions(agent), agent.recorder.precision.result,
                                             agent.snapshot()["window"]["step_seconds"],
                                             [f["rule"] for f in agent.findings()])
    [record] = records(agent, "amp")
    assert record["decision"] == "rolled back" and "update was skipped" in record["reason"]
    assert all(torch.equal(a, b) for a, b in zip(state["params"], state["after"]))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_failing_guard_turns_apply_mode_off_and_the_step_goes_on(run_dir, monkeypatch):
    def broken(grads, loss):
        raise NotImplementedError("cannot check these gradients")

    monkeypatch.setattr(amp_action.AmpChange, "_finite", staticmethod(broken))
    with pytest.warns(tuneup.TuneupWarning, match="apply mode turned off.*cannot check these gradients"):
        agent, model, _, _ = amp_run(run_dir, 20000)
    [record] = records(agent, "amp")
    assert record["decision"] == "reverted" and "stopped after an internal error" in record["reason"]
    assert not any(model.autocast[record["applied_step"] + 3:])


def test_numerics_are_left_alone_in_a_distributed_job(run_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    agent, model, _, _ = amp_run(run_dir, 20000)
    [record] = records(agent, "amp")
    assert record["decision"] == "not applicable" and "distributed" in record["reason"]
    assert not any(model.autocast)


def test_revert_all_from_another_thread_lands_between_steps(run_dir, monkeypatch):
    import threading

    monkeypatch.setattr(amp_action, "bf16_supported", lambda device, index=None: False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    before = dict(vars(scaler))
    state = {}

    def revert_elsewhere(step, loss, model, optimizer, agent):
        if model.autocast[-1] and "thread" not in state:
            state["thread"] = threading.Thread(target=lambda: state.setdefault("undone", agent.revert_all()))
            state["thread"].start()
            time.sleep(0.05)  # the other thread asks while this step is between scale() and step()
        return loss

    agent, model, _, _ = amp_run(run_dir, 20000, on_step=revert_elsewhere, scaler=scaler)
    state["thread"].join()
    assert state["undone"] == 1
    [record] = records(agent, "amp")
    assert record["decision"] == "reverted" and record["reason"] == "revert_all() before the trial ended"
    assert vars(scaler) == before
    assert all(torch.isfinite(p).all() for p in model.parameters())


def slow_worker_start(_worker_id):
    time.sleep(0.2)  # opening a dataset's files in each worker, as an h5py loader does


def test_persistent_workers_on_long_epochs_is_passed_over_with_the_start_up_it_would_save(run_dir):
    """Epochs of 650 steps (longer than a trial can span): persistent_workers is not tried; the
    reason says what the latest epoch's start cost. Ground truth from the loop's own clock: the
    first epoch's last step's end to the second epoch's first batch (the fetch that ends the
    epoch and shuts its two workers down, iter() starting two more that each sleep 0.2 s in
    worker_init_fn, then the first fetch: persistent workers would save all of it; beside busy
    processes the shutdown alone took some 60 ms), against an epoch of ~650 short steps."""
    from tuneup.act.actions.dataloader import DataLoaderTuning

    torch.manual_seed(0)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.randn(650 * 4, 8), torch.randn(650 * 4, 1)),
                        batch_size=4, num_workers=2, worker_init_fn=slow_worker_start)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = tuneup.attach(**apply_options(run_dir, actions=["dataloader"]))
    try:
        ended = time.perf_counter()
        for epoch in range(2):
            start_up = None
            for step, (x, y) in enumerate(loader):
                if start_up is None:
                    start_up = time.perf_counter() - ended
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                ended = time.perf_counter()
                if epoch == 1 and step == 20:
                    break
        said = DataLoaderTuning._start_up_said(agent.experimenter.job, loader, len(loader))
    finally:
        agent.detach()
    found = re.search(r"the latest epoch's start cost (\d+) ms beyond a step's wait, ([\d.]+)% of an epoch", said)
    assert found, said
    assert int(found.group(1)) / 1e3 == pytest.approx(start_up, rel=0.2, abs=0.01), (said, start_up)
    assert "worth setting yourself: DataLoader(..., persistent_workers=True)" in said  # 0.2 s of a ~1 s epoch


def test_a_finding_whose_action_was_not_chosen_says_so_in_a_record(run_dir):
    """Ground truth from the code: the I/O-bound loop stalls on its loader (data-stall, which the
    dataloader action fixes), but the run allows only the zero-grad action: the finding's
    "apply mode can make it" gets a record saying its action was not chosen, and how to add it."""
    _, _, _, agent, loader = io_bound_run(
        150, agent_options=apply_options(run_dir, actions=["zero-grad"]),
        after_step=lambda step, agent: bool(records(agent, "dataloader")))
    [note] = records(agent, "dataloader") or [None]
    assert note is not None and note["decision"] == "not chosen", decisions(agent)
    assert "not among the actions chosen for this run (zero-grad)" in note["reason"]
    assert "zero-grad,dataloader" in note["reason"] and loader.num_workers == 0
    report = agent.report("text")
    assert "not chosen" in report


def test_a_long_epoch_says_why_persistent_workers_were_not_tried_after_other_loader_trials(run_dir):
    """Ground truth from the code: the I/O-bound loop (io_bound_run) on epochs of 700 steps, over
    PERSISTENT_MAX_EPOCH: the search tries worker counts and prefetch_factor, then reaches
    persistent_workers, which such epochs make too rare to measure. That reason gets a record of
    its own (it was said only where nothing else had been tried)."""
    from tuneup.act.actions.dataloader import PERSISTENT_MAX_EPOCH

    assert 700 > PERSISTENT_MAX_EPOCH

    def said_persistent(step, agent):
        return any("persistent_workers" in str(r.get("reason")) for r in records(agent, "dataloader"))

    _, _, _, agent, _ = io_bound_run(1200, dataset=SlowIndexed(size=16 * 700),
                                     agent_options=apply_options(run_dir, actions=["dataloader"]),
                                     after_step=said_persistent)
    tried = [r for r in records(agent, "dataloader") if r.get("applied_step")]
    [note] = [r for r in records(agent, "dataloader", "not applicable") if "persistent_workers" in r["reason"]] or [None]
    assert tried and note is not None, decisions(agent)
    assert "epochs of 700 steps make too rare to measure" in note["reason"], note


def test_no_workers_are_tried_where_the_jobs_own_threads_keep_the_cores_busy(tmp_path):
    """Ground truth from the code (benchmarks/apply_scripts/augment_classifier.py, on two cores:
    the test pins the script to two): each batch of 32 images is made in the main process
    (decoded, cropped, resized, flipped, jittered, blurred, normalized: ~6.5 ms, 60% of a
    ~10 ms step), and a small CNN trains on it with the intra-op threads, which keep both cores
    busy (1.9-2.0 cores measured; beside busy processes they get less and wait for the rest). Moving the making into workers moves its CPU, it does not
    take it away: 0 -> 1 and 0 -> 2 workers measured 0.71-0.83x and 0.90-0.94x. Apply mode tries
    no worker count, and says why."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env
    from tuneup.report.sources import load

    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs two cores")
    script = str(ROOT / "benchmarks" / "apply_scripts" / "augment_classifier.py")
    done = subprocess.run([sys.executable, "-m", "tuneup", "run", "--apply", script, "--steps", "300"],
                          env=child_env(TUNEUP_RUN_DIR=str(tmp_path / "run"), TUNEUP_PORT="0"),
                          preexec_fn=lambda: os.sched_setaffinity(0, cores), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    histories, _ = load(str(tmp_path / "run"))
    actions = histories[0].actions
    assert not [r for r in actions if "num_workers" in (r.get("change") or "")], actions
    [record] = [r for r in actions if r["action"] == "dataloader" and r["decision"] == "not applicable"]
    assert record["reason"].startswith("num_workers stays 0: the job's own threads want "), record
    assert record["reason"].endswith("of the 2 usable cores, and workers would take the CPU they make "
                                     "batches with from the step"), record
