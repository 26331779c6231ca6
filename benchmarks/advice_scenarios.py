"""Real CPU training jobs, each with one injected bottleneck (or none), and the rules that
must fire on it: the scenario set for the advice engine's precision and recall.

Every scenario is a variation of one clean, well-configured job (normalized in-memory data,
a model whose step dwarfs the data loading, an LR schedule, no host reads). A scenario
changes one thing; the rule for that thing, and no other, must fire. Rules that cannot be
observed on a CPU (GPU, CUDA-only, multi-rank) are tested on recorded inputs instead
(tests/test_rules_recorded.py).

Used by tests/test_advice.py (asserted per scenario) and benchmarks/bench_advice.py
(the precision/recall table).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tuneup
from tuneup.measure.terms import SPIKE_FACTOR, SPIKE_HISTORY
from tuneup.report.document import build
from tuneup.report.sources import load

FEATURES = 64
HIDDEN = 1024


class Features(Dataset):
    """Normalized features (mean 0, std 1) with an optional per-sample latency, scale, and
    CPU work (a decode that keeps a worker busy).

    Samples are held as a list of (x, y) rows, so reading one costs a list lookup: the clean
    job's loading (about 60 µs a step here) stays far below 10% of even the fastest step of
    any scenario, bf16/fp16 steps on a CPU with bf16 units (1.3 ms) included. Indexing the
    tensors per sample (350 µs a step) made data-stall fire there, rightly, in scenarios meant
    to have one bottleneck."""

    def __init__(self, size: int = 4096, latency: float = 0.0, scale: float = 1.0, cpu_work: int = 0):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(size, FEATURES, generator=generator) * scale
        y = x[:, :4].sum(1, keepdim=True) / scale
        self.samples = list(zip(x.unbind(0), y.unbind(0)))
        self.latency = latency
        self.cpu_work = cpu_work

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        if self.latency:
            time.sleep(self.latency)
        if self.cpu_work:
            busy = torch.ones(self.cpu_work, self.cpu_work)
            for _ in range(4):
                busy = busy @ busy / self.cpu_work
        return self.samples[index]


def model(hidden: int = HIDDEN, conv_bn: bool = False) -> nn.Module:
    if conv_bn:
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Flatten(), nn.Linear(64 * 64, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 8), nn.Linear(8, 1))


@dataclass(frozen=True)
class Job:
    steps: int = 240
    batch_size: int = 64
    latency: float = 0.0
    scale: float = 1.0
    cpu_work: int = 0
    workers: int = 0
    hidden: int = HIDDEN
    conv_bn: bool = False
    lr: float = 0.01
    schedule: bool = True
    set_to_none: bool = True
    host_reads: int = 0
    scaler: bool = False
    overflow_every: int = 0
    autocast: torch.dtype | None = None
    eval_every: int = 0
    spike_every: int = 0
    numpy_copies: bool = False
    numpy_shared: bool = False  # numpy_copies' fix: the record through torch.from_numpy (no copy)
    anomaly: bool = False
    data_parallel: bool = False
    # torch's intra-op threads. One by default: with two on a 2-core machine, each op's threads
    # wait for one another whenever anything else runs (another process, tuneup's own thread),
    # and what timing says flips with the moment: the scenarios' MLP under bf16 autocast
    # measured 1.2x faster in 8 of 8 timings at one thread and 0.8x in 6 of 8 at two, and a
    # busy machine stretched the step 5x and not a torch.tensor(ndarray) copy (its share fell
    # from 4% to 1-2%).
    threads: int = 1


@contextmanager
def job_threads(job: Job) -> Iterator[None]:
    """torch's intra-op threads set to the job's for the block, then as they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(job.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


WARMUP = 20  # the steps the rules' window leaves out (measure.history.WARMUP_STEPS)
SPIKE_WINDOW = 128  # steps: what tuneup's SPIKE_HISTORY sampled norms span here (_spikes)


@dataclass(frozen=True)
class Truth:
    """What the loop measured of itself past the warm-up, by its own clock: the ground truth
    for the findings whose premise a machine's load can change (_premises)."""
    stall: float  # the wait for the next batch (end of one step's body to the start of the next) over the
    # steps, one-off waits left out (run_job; over tuneup's window's steps: run_scenario, `over`)
    stall_all: float  # the same with every wait: what the loop's clock says (tuneup's own work at a close too)
    copy_share: float  # the torch.tensor(ndarray) copies' time over the steps'
    step_seconds: float  # the steps' mean time
    # The same as bounds on what a few steps' copies say (tuneup times them on its watched
    # steps, 5 of a 240-step run): the median copy's share and the 90th percentile's (a busy
    # machine deschedules some copies: their mean can be over twice tuneup's figure, in CI)
    copy_bounds: tuple[float, float] = (0.0, 0.0)
    # bf16 autocast on the job's model, measured before and after the run (run_scenario:
    # amp_gain): (the share of a step it saves, the share of interleaved pairs it was faster in)
    amp: tuple[tuple[float, float], ...] = ()
    # The steps whose gradient norm (the loop's own, every step: clip_grad_norm_'s figure) was
    # over SPIKE_FACTOR times the median of the SPIKE_HISTORY norms before it, and the steps
    # it judged (past the first SPIKE_HISTORY)
    spike_steps: frozenset[int] = frozenset()
    judged_steps: int = 0
    # tuneup's own work at step closes as a share of the loop's clock (run_scenario: tuneup
    # reports it, totals.tuneup_seconds, and keeps it out of the job's wait; test_steps checks
    # the two add up to the loop's clock): the loop's stall holds it, the job's does not.
    own_share: float = 0.0
    # (step, the wait before it, its time with the wait) for every step, the warm-up's too: tuneup's
    # window takes whole intervals, and the one the warm-up ends in begins inside it (a window of
    # steps 15..80 was judged against the loop's 21..80 alone: a 7-point stall apart on a busy
    # machine). The loop's step k is tuneup's step k (both begin at the k-th fetch)
    waits: tuple[tuple[int, float, float], ...] = ()

    def over(self, first: int, last: int) -> Truth:
        """The stalls over steps first..last alone: those tuneup's window judged. On a machine whose
        load changes within the run, the steps a window leaves out (its whole intervals begin a few
        steps from the warm-up's end) can move a stall near the threshold by more than the margin."""
        chosen = [(wait, seconds) for step, wait, seconds in self.waits if first <= step <= last]
        return replace(self, **_stalls(chosen)) if chosen else self


def _stalls(waits: list[tuple[float, float]]) -> dict[str, float]:
    """The two stalls that bound the truth: with every wait, and without one-off waits (over 10x
    the median wait and a millisecond), which may be the loader's (a fetch descheduled on a busy
    machine) or not (tuneup's own work at a close, which it leaves out; a collector pause)."""
    total = sum(seconds for _, seconds in waits)
    typical = max(10 * statistics.median(wait for wait, _ in waits), 1e-3) if waits else 0.0
    steady = [(wait, seconds) for wait, seconds in waits if wait <= typical]
    steady_total = sum(seconds for _, seconds in steady)
    return {"stall": sum(wait for wait, _ in steady) / steady_total if steady_total else 0.0,
            "stall_all": sum(wait for wait, _ in waits) / total if total else 0.0}


def run_job(job: Job) -> Truth:
    """The training loop, with the scenario's one change, on the job's threads; returns its
    own measure of itself."""
    with job_threads(job):
        return _train(job)


def _train(job: Job) -> Truth:
    torch.manual_seed(0)
    dataset = Features(latency=job.latency, scale=job.scale, cpu_work=job.cpu_work)
    loader = DataLoader(dataset, batch_size=job.batch_size, shuffle=True, num_workers=job.workers,
                        persistent_workers=job.workers > 0, drop_last=True)
    net: nn.Module = model(job.hidden, job.conv_bn)
    if job.data_parallel:
        net = nn.DataParallel(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=job.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.9) if job.schedule else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if job.scaler else None
    loss_fn = nn.MSELoss()
    if job.numpy_copies:
        import numpy

        # A record of 128 times the features the model reads (a row of raw values, as a NumPy
        # pipeline hands it over), copied whole every step: a copy worth advice (numpy-copies'
        # gain is its share of the step, and a finding needs 1% of it: rule.MIN_GAIN).
        table = numpy.random.default_rng(0).standard_normal((job.batch_size, 128 * FEATURES)).astype("float32")
    step, copying = 0, 0.0
    copies: list[float] = []  # each steady step's copy time
    norms: list[torch.Tensor] = []  # the loop's own gradient norms (job.spike_every), read after the run
    waits: list[tuple[int, float, float]] = []  # (step, the wait before it, its time with the wait), every step
    ended = time.perf_counter()
    while step < job.steps:
        for x, y in loader:
            began = time.perf_counter()
            step += 1
            if job.numpy_copies:
                copied = time.perf_counter()
                record = torch.from_numpy(table) if job.numpy_shared else torch.tensor(table)  # a copy every step
                if step > WARMUP:
                    copies.append(time.perf_counter() - copied)
                    copying += copies[-1]
                x = x + record[:, :FEATURES]
            if job.overflow_every and step % job.overflow_every == 0:
                x = x * 1e30  # an unnormalized record: the loss overflows to inf
            if job.spike_every and step % job.spike_every == 0:
                y = y * 30  # a corrupt batch: a gradient spike (the momentum carries it some steps)
            if job.autocast is not None:
                with torch.autocast("cpu", dtype=job.autocast):
                    loss = loss_fn(net(x).float(), y)
            else:
                loss = loss_fn(net(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                # Every scenario's, as tensors (a read every step would be a host read): the
                # ground truth for no-grad-clipping wherever it fires, meant or not.
                norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                                   for p in net.parameters() if p.grad is not None])))
                optimizer.step()
            optimizer.zero_grad(set_to_none=job.set_to_none)
            if scheduler is not None:
                scheduler.step()
            for _ in range(job.host_reads):
                loss.item()
            if job.eval_every and step % job.eval_every == 0:
                net.eval()
                net(x[:8])  # evaluation without torch.no_grad()
                net.train()
            now = time.perf_counter()
            waits.append((step, began - ended, now - ended))
            ended = now
            if step >= job.steps:
                break
        ended = time.perf_counter()  # a new epoch's workers start: not the steady state's wait
    counted = max(1, job.steps - WARMUP)
    warm = [(wait, seconds) for step, wait, seconds in waits if step > WARMUP]  # the run's figures: past the warm-up
    total = sum(seconds for _, seconds in warm)
    spikes = _spikes([norm.item() for norm in norms])
    return Truth(**_stalls(warm),
                 copy_share=copying / total if total else 0.0, step_seconds=total / counted,
                 copy_bounds=_copy_bounds(copies, total / counted),
                 spike_steps=spikes, judged_steps=max(0, len(norms) - SPIKE_HISTORY), waits=tuple(waits))


def _copy_bounds(copies: list[float], step_seconds: float) -> tuple[float, float]:
    """(the median copy, the 90th-percentile copy) over the mean step: Truth.copy_bounds."""
    if not copies or not step_seconds:
        return 0.0, 0.0
    ordered = sorted(copies)
    return ordered[len(ordered) // 2] / step_seconds, ordered[int(0.9 * (len(ordered) - 1))] / step_seconds


def _spikes(norms: list[float]) -> frozenset[int]:
    """The steps (1-based) whose norm is over SPIKE_FACTOR times the median of the norms of the
    SPIKE_WINDOW steps before it (at least SPIKE_HISTORY): the time tuneup's SPIKE_HISTORY
    sampled norms span (a norm in ~16 steps here)."""
    return frozenset(index + 1 for index in range(SPIKE_HISTORY, len(norms))
                     if norms[index] > SPIKE_FACTOR * statistics.median(norms[max(0, index - SPIKE_WINDOW):index]))


def amp_gain(job: Job) -> tuple[float, float] | None:
    """(the seconds of a step that bf16 autocast saves, the share of pairs in which it was
    faster): its model's forward + backward at its batch, timed in fp32 and under CPU bf16
    autocast, 16 interleaved pairs, medians (gradients by torch.autograd.grad, on a model of
    its own). None for a job that already uses autocast."""
    if job.autocast is not None:
        return None
    with job_threads(job):
        return _amp_gain(job)


def _amp_gain(job: Job) -> tuple[float, float]:
    torch.manual_seed(0)
    net = model(job.hidden, job.conv_bn)
    x, y = torch.randn(job.batch_size, FEATURES) * job.scale, torch.randn(job.batch_size, 1)
    loss_fn = nn.MSELoss()
    parameters = list(net.parameters())
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(18):
        for low in ((False, True) if rep % 2 else (True, False)):
            began = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                loss = loss_fn(net(x).float(), y)
            torch.autograd.grad(loss, parameters)
            if rep >= 2:
                times[low].append(time.perf_counter() - began)
    saved = statistics.median(times[False]) - statistics.median(times[True])
    return saved, sum(low < full for full, low in zip(times[False], times[True])) / len(times[True])


@dataclass(frozen=True)
class Scenario:
    name: str
    job: Job
    expected: frozenset[str]
    note: str = ""
    setup: Callable[[], Callable[[], None]] | None = field(default=None, compare=False)


def _anomaly() -> Callable[[], None]:
    torch.autograd.set_detect_anomaly(True)
    return lambda: torch.autograd.set_detect_anomaly(False)


CLEAN = Job()
SCENARIOS: list[Scenario] = [
    Scenario("clean", CLEAN, frozenset(), "a well-configured job: nothing may fire"),
    Scenario("io-bound loader", replace(CLEAN, latency=0.0001), frozenset({"data-stall"}),
             "0.1 ms per sample read, num_workers=0"),
    Scenario("host reads", replace(CLEAN, host_reads=2), frozenset({"host-syncs"}), "two loss.item() per step"),
    Scenario("fp16 overflows", replace(CLEAN, scaler=True, overflow_every=10), frozenset({"scaler-skips"}),
             "every 10th batch unnormalized x1e30 under GradScaler"),
    Scenario("zero_grad keeps tensors", replace(CLEAN, set_to_none=False), frozenset({"zero-grad-keeps-tensors"})),
    Scenario("conv bias before BN", replace(CLEAN, conv_bn=True, hidden=256, lr=0.003),
             frozenset({"conv-bias-before-bn"}), "a learning rate at which this net trains without a loss spike"),
    Scenario("eval with grad", replace(CLEAN, eval_every=10), frozenset({"eval-with-grad"}),
             "an evaluation forward every 10 steps without no_grad"),
    Scenario("anomaly detection", replace(CLEAN, steps=120), frozenset({"debug-tools-on"}), "set_detect_anomaly(True)",
             setup=_anomaly),
    Scenario("no LR schedule", replace(CLEAN, schedule=False), frozenset({"no-lr-schedule"})),
    # tuneup reads gradient norms on sampled steps (1 in ~16 here: a norm costs 0.3 ms of a 5.5 ms
    # step, within its 0.5% budget), so it sees a spike only if it reads one: the corrupt batches
    # and the steps their momentum carries spike on 12% of this loop's steps, and over 1,000
    # steps it reads none of them about once in 2,000 runs (expected_findings).
    Scenario("corrupt batches", replace(CLEAN, spike_every=25, lr=0.002, steps=1000), frozenset({"no-grad-clipping"}),
             "a batch with targets 30x too large every 25 steps, no clipping"),
    Scenario("numpy copies", replace(CLEAN, numpy_copies=True), frozenset({"numpy-copies"}),
             "torch.tensor(ndarray) every step"),
    Scenario("raw inputs", replace(CLEAN, scale=100.0, lr=1e-6), frozenset({"input-not-normalized"}),
             "features x100 (raw units)"),
    Scenario("DataParallel", replace(CLEAN, data_parallel=True), frozenset({"data-parallel"})),
    # Half-precision steps are 10-40x faster on a CPU with bf16/fp16 units than without: the
    # widths keep them well above the loading time on the first (the loader's ~0.16 ms a batch
    # stays under 5% of a step: a 764-wide bf16 step of 1.9 ms put it at 8-10%, at the data-stall
    # threshold) and affordable on the second.
    Scenario("fp16 without scaler", replace(CLEAN, autocast=torch.float16, hidden=768, steps=60),
             frozenset({"fp16-without-scaler"}),
             "CPU autocast float16, no GradScaler; layer sizes are multiples of 8"),
    Scenario("misaligned bf16", replace(CLEAN, autocast=torch.bfloat16, hidden=1020, steps=80),
             frozenset({"tensor-core-alignment"}), "bf16 autocast with 1020-wide layers"),
    Scenario("oversubscribed CPU", replace(CLEAN, workers=2, cpu_work=128, batch_size=16, steps=150, threads=2),
             frozenset({"cpu-oversubscribed", "data-stall"}),
             "2 CPU-bound workers + 2 torch threads on 2 cores: the contention starves the loader too"),
]


STALL_MARGIN = 0.03  # tuneup's data wait is the loop's less its own bookkeeping (test_steps)


def _premises() -> dict[str, tuple[Callable[[Truth], tuple[float, float]], float, float]]:
    """The rules whose premise a machine's load can change, in any scenario: (the loop's own
    measure of it, as bounds (low, high), below which the rule must stay silent, from which it
    must fire): it must fire where the low bound reaches fires_from, stay silent where the high
    one is under silent_below, and either is right in between. A busy machine slows the
    training thread and the loader (or the copy) differently, and which more, the load decides."""
    from tuneup.diagnose.rule import MIN_GAIN
    from tuneup.diagnose.rules.input import STALL_THRESHOLD

    return {
        "data-stall": (lambda truth: (truth.stall - truth.own_share, truth.stall_all), STALL_THRESHOLD - STALL_MARGIN,
                       STALL_THRESHOLD + STALL_MARGIN),
        # tuneup times the copies on its watched steps (5 of a 240-step run), the loop on every
        # step: on a busy machine descheduled copies make the two differ (in CI: 0.85% seen by
        # tuneup, the loop's mean at 2% or more), so the premise is bounded by the typical copy
        # and the 90th percentile's, and the mean's at either end.
        "numpy-copies": (lambda truth: (min(truth.copy_share, truth.copy_bounds[0]),
                                        max(truth.copy_share, truth.copy_bounds[1])), MIN_GAIN / 2, MIN_GAIN * 2),
    }


# amp-off must fire where bf16 saved this many times its threshold before and after the run: at
# one thread the scenarios' MLP measured 1.04x to 1.46x in tuneup's own trials between truths of
# 16-20% (2x the threshold was not enough: a trial at 1.04x left it silent, rightly for its moment).
AMP_SURE = 4
MISS_CHANCE = 1e-3  # no-grad-clipping must fire where reading no spike at all was less likely than this


def expected_findings(scenario: Scenario, cpu_bf16: bool, truth: Truth | None = None,
                      norms_read: int | None = None) -> tuple[frozenset[str], frozenset[str]]:
    """(the rules that must fire on `scenario`, those that may) when the CPU has (or is treated
    as having) bf16 units: the scenario's own, plus amp-off wherever the job trains in fp32 on
    such a CPU where bf16 autocast measurably saves time on it (amp_gain). Given the run's own
    measure of itself (run_job's Truth), the timing rules (_premises) must fire as it says,
    whatever the scenario meant, and may either way close to their thresholds. Given the number
    of gradient norms tuneup read (`norms_read`, on sampled steps), no-grad-clipping must fire
    where the loop's own norms spiked often enough that reading none of the spikes had less
    than MISS_CHANCE, never where they did not spike, and may either way in between."""
    expected = set(scenario.expected | ({"amp-off"} if cpu_bf16 and scenario.job.autocast is None else set()))
    either = set()
    if "amp-off" in expected and truth is not None and truth.amp:
        # Its premise is the job's measured gain: it must fire where bf16 is clearly faster
        # before and after the run (AMP_SURE x its threshold, in 90% of the pairs), stay silent where it
        # is clearly slower (in 90% of the pairs), and may either way otherwise: on this 2-core
        # CPU the scenarios' MLP measured 0.75x in one run and 1.17x in the next, and flipped
        # between the two within a run (tuneup's trial, timed in between, is right for its moment).
        from tuneup.diagnose.rules.precision import AMP_MIN_GAIN

        if not all(gain >= AMP_SURE * AMP_MIN_GAIN and faster >= 0.9 for gain, faster in truth.amp):
            expected.discard("amp-off")
            if not all(gain <= 0 and faster <= 0.1 for gain, faster in truth.amp):
                either.add("amp-off")
    if truth is not None and norms_read is not None:
        from tuneup.measure.terms import MIN_BEFORE

        judged = max(0, norms_read - MIN_BEFORE)  # the first norms have nothing before them
        share = len(truth.spike_steps) / truth.judged_steps if truth.judged_steps else 0.0
        meant = "no-grad-clipping" in expected
        expected.discard("no-grad-clipping")
        if meant and share and (1 - share) ** judged < MISS_CHANCE:
            expected.add("no-grad-clipping")
        elif share:  # (a scenario about something else whose norms spiked too: it may fire)
            either.add("no-grad-clipping")
    if truth is not None:
        for rule_id, (measure, silent_below, fires_from) in _premises().items():
            low, high = measure(truth)
            if low >= fires_from:
                expected.add(rule_id)
            else:
                expected.discard(rule_id)
                if high >= silent_below:
                    either.add(rule_id)
    return frozenset(expected), frozenset(either)


def run_scenario(scenario: Scenario, run_dir: Path, cpu_bf16: bool | None = False) -> dict[str, Any]:
    """Run the job under tuneup; returns the report document built from its run log (the
    `tuneup report RUN_DIR` path), with the loop's own measure of itself (run_job's Truth) as
    "truth" beside it. `cpu_bf16` pins the CPU's bf16 capability (the advice depends on it: see
    expected_findings); None uses what this CPU reports."""
    restore = scenario.setup() if scenario.setup else None
    try:
        before = amp_gain(scenario.job) if cpu_bf16 is not False else None  # with the job's threads
        with tuneup.attach(run_dir=run_dir, interval=0.1, port=0, cpu_bf16=cpu_bf16 if cpu_bf16 is not None else "auto"):
            truth = run_job(scenario.job)
        if before is not None:  # and after detach
            after = amp_gain(scenario.job)
            truth = replace(truth, amp=tuple((saved / truth.step_seconds, faster)
                                             for saved, faster in (before, after)))
    finally:
        if restore is not None:
            restore()
    histories, source = load(str(run_dir))
    document = build(histories, source=source)
    snapshot = document["runs"][0]["snapshot"]
    window, totals = snapshot.get("window") or {}, snapshot["totals"]
    if window.get("first_step") is not None:
        truth = truth.over(window["first_step"], window["last_step"])
    own = totals.get("tuneup_seconds") or 0.0
    if totals["seconds"] + own > 0:
        truth = replace(truth, own_share=own / (totals["seconds"] + own))
    return dict(document, truth=truth)


def about_the_machine(finding: dict[str, Any]) -> bool:
    """A finding about other processes' load on the machine ("the machine is busy with other
    work"), not about the job: true wherever the machine is shared and busy (CI, a laptop),
    whatever the job. Its evidence says so (other_cores, measured), so a scenario's ground
    truth is compared without it."""
    from tuneup.diagnose.rules.input import OTHERS_MIN_CORES

    return finding["rule"] == "cpu-oversubscribed" and \
        (finding.get("evidence") or {}).get("other_cores", 0) >= OTHERS_MIN_CORES and \
        finding["observed"].startswith("the machine is busy with other work")


def norms_read(document: dict[str, Any]) -> int | None:
    """How many gradient norms tuneup read (its run's habits), or None."""
    norms = ((document["runs"][0]["snapshot"].get("habits") or {}).get("grad_norms")) or {}
    return norms.get("samples")


def fired(document: dict[str, Any]) -> set[str]:
    """The rules that fired on the job (findings about the machine's other load left out)."""
    return {finding["rule"] for finding in document["findings"] if not about_the_machine(finding)}


def precision_recall(results: list[tuple[frozenset[str], set[str]]]) -> tuple[float, float]:
    """Precision and recall over (expected, fired) pairs."""
    true_positive = sum(len(expected & got) for expected, got in results)
    predicted = sum(len(got) for _, got in results)
    relevant = sum(len(expected) for expected, _ in results)
    precision = true_positive / predicted if predicted else 1.0
    recall = true_positive / relevant if relevant else 1.0
    return precision, recall
