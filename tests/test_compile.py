"""torch.compile: tuneup leaves no trace on what a job compiles (issue 19).

tests/programs/compiled_loops.py trains eight compiled shapes one after another
(`torch.compile(model)` of torch's own and of the job's classes with DataLoader workers,
`model.compile()`, a compiled `optimizer.step`, `fullgraph=True`, `dynamic=True`, inductor,
a whole training step compiled with `optimizer.step()` inside it)
and prints, per shape, its losses and what torch's own counters say it compiled. Run with
plain python and under `tuneup run`, advise and apply mode (attached before the script builds
or compiles anything, so model discovery is active while the first graphs are traced): the
same graphs, frames, recompiles, graph breaks, warnings and torch log records, bit-identical
losses, and every step counted. The same for two programs that compile with a recompile
(compiled_last_batch.py) and with a graph break (compiled_item_forward.py), whose reports
name the guard and the line.
"""

from __future__ import annotations

import copy

import json
import subprocess
import urllib.request
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from prometheus_client.parser import text_string_to_metric_families
from torch._dynamo.utils import counters

import tuneup
from tuneup.diagnose import evaluate
from tests.conftest import child_env
from tuneup.export.runlog import read_log

PROGRAM = Path(__file__).parent / "programs" / "compiled_loops.py"
SHAPES = 8
STEPS = 12  # per shape: the program's default


def shapes(stdout: str) -> dict[str, dict]:
    return {record["shape"]: record for record in
            (json.loads(line[len("SHAPE "):]) for line in stdout.splitlines() if line.startswith("SHAPE "))}


MODES = {"advise": [], "apply": ["--apply"]}  # `tuneup run`'s options for each mode


def run_modes(program: Path, tmp_path_factory, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`program` with plain python, then under `tuneup run` in each of MODES (a run directory
    each): (plain, {mode: (completed, run_dir)}). All of them on one inductor cache of their
    own, filled by a plain run first: a cold cache changes torch's own frame counter (every
    Python function first called while inductor compiles cold is a frame convert_frame counts
    and leaves to run: convert_frame.py ConvertFrame.__call__ counts before it looks; 95 of
    inductor's own in compiled_loops.py's `step` shape, and tuneup's compile-start callbacks
    beside them), so the runs compared all find every graph cached, as a job's second run does."""
    base = tmp_path_factory.mktemp(program.stem)
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor-cache")}
    for run in ("warm-up", "plain"):
        plain = subprocess.run([sys.executable, str(program), *argv], capture_output=True, text=True,
                               env=child_env(TUNEUP_RUN_DIR=str(base / run), **cache), timeout=900)
        assert plain.returncode == 0, (run, plain.stderr[-3000:])
    tuned = {}
    for mode, options in MODES.items():
        run_dir = base / mode
        done = subprocess.run([sys.executable, "-m", "tuneup", "run", *options, str(program), *argv],
                              capture_output=True, text=True, env=child_env(TUNEUP_RUN_DIR=str(run_dir), **cache),
                              timeout=900)
        assert done.returncode == 0, (mode, done.stderr[-3000:])
        tuned[mode] = done, run_dir
    return plain, tuned


def end_totals(run_dir: Path) -> dict:
    [end] = [event for event in read_log(next(run_dir.glob("events*.jsonl"))).events if event.get("event") == "end"]
    return end["totals"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_modes(PROGRAM, tmp_path_factory)


def one_frame_fewer(compiled: dict, expected: dict) -> None:
    """The one difference a compiled optimizer step shows under tuneup, taken out of `compiled`
    and `expected` where it is exactly that: one frame fewer, total and ok. tuneup's global
    optimizer hooks, which dynamo traces in torch's step wrapper, return at once where
    is_compiling() (as the issue asks of anything dynamo may trace), and any such call marks
    the traced frame as having side effects (torch/_dynamo/variables/torch.py:
    tx.mark_inconsistent_side_effects(), pytorch#110765; symbolic_convert.py _return then
    raises no SkipFrame for a graph-less frame), so dynamo keeps the graph-less frame resuming
    after torch's own graph break in the step wrapper; the no-op `_optimizer_step_code` it
    calls is inlined there, not a frame of its own. (Without tuneup, a global step hook that
    asks is_compiling() gives 7 frames where none gives 8 and one that does not ask gives 9.)
    Any other frame more or fewer (a frame of tuneup's compiled as the job's) still fails."""
    frames, plain = compiled.pop("frames"), expected.pop("frames")
    assert (plain["total"] - frames["total"], plain["ok"] - frames["ok"]) == (1, 1), (frames, plain)


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_program_compiles_the_same_under_tuneup(runs, mode):
    plain, tuned = runs
    tuned = tuned[mode][0]
    before, after = shapes(plain.stdout), shapes(tuned.stdout)
    assert len(before) == SHAPES and list(after) == list(before)
    for shape, record in before.items():
        seen = after[shape]
        assert seen["losses"] == record["losses"], shape  # bit-identical (float.hex)
        compiled, expected = dict(seen["compiled"]), dict(record["compiled"])
        if shape in ("optimizer", "step"):
            one_frame_fewer(compiled, expected)
        assert compiled == expected, shape
        ours = [w for w in seen["warnings"] if not w.startswith("TuneupWarning")]
        assert ours == record["warnings"], shape
        assert seen["torch_log"] == record["torch_log"], shape
    # The job's own output, line for line (tuneup's summary goes to stderr).
    assert [line for line in tuned.stdout.splitlines() if not line.startswith("SHAPE ")] == \
        [line for line in plain.stdout.splitlines() if not line.startswith("SHAPE ")]


@pytest.mark.gpu
def test_on_the_gpu_cuda_graphs_and_compiled_shapes_compile_the_same_under_tuneup(tmp_path):
    """On CUDA, with mode="reduce-overhead" (CUDA graphs) added, and the whole training step
    compiled (its steps counted by the parameters' versions): the same graphs, breaks,
    recompiles, warnings and losses under `tuneup run --apply`, every step counted; tuneup's
    CUDA-event timing records no event inside a capture (a capture would fail with an error)."""
    shapes_run = "module,in-place,optimizer,inductor,reduce-overhead,step"
    # One inductor cache, filled first (run_modes says why: a cold compile adds frames to the counter).
    env = child_env(TUNEUP_RUN_DIR=str(tmp_path / "run"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    argv = [str(PROGRAM), "--device", "cuda", "--shapes", shapes_run]
    warm = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env=dict(env, TUNEUP_RUN_DIR=str(tmp_path / "warm-up")), timeout=900)
    assert warm.returncode == 0, warm.stderr[-2000:]
    plain = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=900)
    tuned = subprocess.run([sys.executable, "-m", "tuneup", "run", "--apply", *argv], capture_output=True, text=True,
                           env=env, timeout=900)
    assert plain.returncode == tuned.returncode == 0, (plain.stderr[-2000:], tuned.stderr[-2000:])
    before, after = shapes(plain.stdout), shapes(tuned.stdout)
    assert list(after) == list(before) == shapes_run.split(",")
    for shape, record in before.items():
        compiled, expected = dict(after[shape]["compiled"]), dict(record["compiled"])
        if shape in ("optimizer", "step"):
            one_frame_fewer(compiled, expected)
        assert (after[shape]["losses"], compiled) == (record["losses"], expected), shape
        assert [w for w in after[shape]["warnings"] if not w.startswith("TuneupWarning")] == record["warnings"], shape
    events = read_log(next((tmp_path / "run").glob("events*.jsonl"))).events
    [end] = [event for event in events if event.get("event") == "end"]
    assert end["totals"]["steps"] == len(before) * STEPS


def test_every_compiled_step_is_counted(runs):
    """A compiled optimizer step included: its hooks return at once inside the compiled code,
    and tuneup calls them around the compiled function instead. A whole training step
    compiled too: no hook of the optimizer's runs eagerly there, and its steps close at the
    fetch after the parameters changed (their version counters)."""
    for mode, (_, run_dir) in runs[1].items():
        assert end_totals(run_dir)["steps"] == SHAPES * STEPS, mode


def compiled_record(stdout: str) -> dict:
    [line] = [line for line in stdout.splitlines() if line.startswith("COMPILED ")]
    return json.loads(line[len("COMPILED "):])


@pytest.fixture(scope="module", params=["compiled_last_batch.py", "compiled_item_forward.py"])
def program_runs(request, tmp_path_factory):
    return request.param, *run_modes(PROGRAM.parent / request.param, tmp_path_factory)


def test_a_recompiling_or_breaking_program_compiles_the_same_under_tuneup(program_runs):
    """compiled_last_batch.py (inductor): its short last batch recompiles the forward once
    (ground truth in its docstring: 2 graphs, one guard failed, 21 steps); compiled_item_forward.py
    (inductor): `.item()` in the forward breaks its graph on every step (the code resumed after
    it recompiles once, for the float it read), and tuneup counts that read on its sampled
    steps (the frame it calls it from is no frame of dynamo's: 3 frames, 3 graphs, 1 break,
    one guard failed, 24 steps). Under `tuneup run`, advise and apply mode: torch's own
    counters the same (frames total and ok, graphs, recompiles, breaks), the same guards
    failed, the same warnings and torch log records, bit-identical losses, the job's own output
    line for line, and every step counted."""
    name, plain, tuned = program_runs
    expected = compiled_record(plain.stdout)
    truth = {"compiled_last_batch.py": (21, 2, 2, 0, 1), "compiled_item_forward.py": (24, 3, 3, 1, 1)}[name]
    assert (expected["steps"], expected["compiled"]["frames"]["total"], expected["compiled"]["stats"]["unique_graphs"],
            sum(expected["compiled"]["graph_break"].values()),
            sum(map(len, expected["guard_failures"].values()))) == truth, expected
    for mode, (done, run_dir) in tuned.items():
        seen = compiled_record(done.stdout)
        assert seen["losses"] == expected["losses"], mode  # bit-identical (float.hex)
        assert (seen["compiled"], seen["guard_failures"]) == (expected["compiled"], expected["guard_failures"]), mode
        assert [w for w in seen["warnings"] if not w.startswith("TuneupWarning")] == expected["warnings"], mode
        assert seen["torch_log"] == expected["torch_log"], mode
        assert [line for line in done.stdout.splitlines() if not line.startswith("COMPILED ")] == \
            [line for line in plain.stdout.splitlines() if not line.startswith("COMPILED ")], mode
        assert end_totals(run_dir)["steps"] == expected["steps"], mode


def test_the_report_names_the_guard_that_recompiled_and_the_line_that_broke(program_runs):
    """`tuneup report` on each program's run: compiled_last_batch.py's recompile with the guard
    that failed (x's size: 32, then 8, the guard torch's own record holds), compiled_item_forward.py's
    graph break at its BREAK line with dynamo's reason and the read it broke at, counted at that
    line on every sampled step; compile time kept out of the step times, its warm-up steps said."""
    name, plain, tuned = program_runs
    source = (PROGRAM.parent / name).read_text().splitlines()
    for mode, (_, run_dir) in tuned.items():
        report = subprocess.run([sys.executable, "-m", "tuneup", "report", str(run_dir)], capture_output=True, text=True,
                                env=child_env(COLUMNS="400"), timeout=300)
        assert report.returncode == 0, report.stderr[-2000:]
        text = report.stdout
        assert "torch.compile:" in text and "kept out of their times" in text, (mode, text)
        if name == "compiled_last_batch.py":
            [guard] = [reason for reasons in compiled_record(plain.stdout)["guard_failures"].values()
                       for reason in reasons]
            assert "size mismatch at index 0. expected 32, actual 8" in guard
            assert "recompiled 1x: " in text and guard.split(": ", 1)[1] in text, (mode, text)
        else:
            line = next(number for number, text_line in enumerate(source, 1) if "# BREAK" in text_line)
            assert f"graph break 1x at {name}:{line}: Unsupported Tensor.item()" in text, (mode, text)
            assert "[graph-breaks]" in text, (mode, text)
            # The read dynamo broke at runs eagerly at every step: the syncs probe counted it there.
            flat = " ".join(text.split())  # (the report wraps its lines)
            assert "at the break the job reads the device: item at " in flat, (mode, text)
            assert f"{name}:{line} (1.0/step) (measured on sampled steps" in flat, (mode, text)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def compile_as(how: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
    """The module the loop calls, compiled `how` on the eager backend: torch.compile(model)'s
    wrapper, the model compiled in place (model.compile()), or the model itself with its
    optimizer's step compiled ("compiled optimizer step")."""
    if how == "torch.compile(model)":
        return torch.compile(model, backend="eager")
    if how == "model.compile()":
        model.compile(backend="eager")
    else:
        optimizer.step = torch.compile(optimizer.step, backend="eager")
    return model


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "compiled optimizer step"])
def test_a_compiled_model_or_step_is_found_and_timed(how, run_dir):
    """Attached before the model is built or compiled (as `tuneup run` is): the model is found
    (as torch.compile's wrapper, or itself when compiled in place), its forward and the
    optimizer's step are timed, every step counted, and the job compiles one graph."""
    torch._dynamo.reset()
    counters.clear()
    agent = tuneup.attach(run_dir=run_dir, interval=0.2)
    try:
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trained = compile_as(how, model, optimizer)
        job_step, job_call = vars(optimizer).get("step"), vars(model).get("_compiled_call_impl")
        job_forward = vars(trained).get("forward")  # built while discovery stood in for __call__
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        for _ in range(40):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(trained(x), y)
            loss.backward()
            optimizer.step()
        # Timed without module hooks: the compiled call stays on nn.Module's fast path.
        assert not trained._forward_hooks and not trained._forward_pre_hooks
        if how == "torch.compile(model)":
            assert vars(trained)["forward"] is not job_forward  # timed on the instance
            twin = copy.deepcopy(trained)  # rebuilt from the module it wraps, without tuneup's wrapper
            assert twin.forward.__wrapped__ is not vars(trained)["forward"].__wrapped__
            assert torch.equal(twin(x), trained(x))
    finally:
        agent.detach()
        graphs = counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
    snapshot = agent.snapshot()
    expected = {"torch.compile(model)": "OptimizedModule"}.get(how, "Net")
    assert [model["class"] for model in snapshot["config"]["models"]] == [expected]
    assert snapshot["totals"]["steps"] == 40
    window = snapshot["window"]
    assert window["forward_ratio"] > 0 and window["optimizer_ratio"] > 0, window
    assert graphs == 1
    assert vars(optimizer).get("step") is job_step  # detach put the job's own step back
    assert vars(model).get("_compiled_call_impl") is job_call  # ... and the model's compiled call
    if how == "torch.compile(model)":  # ... and torch.compile's forward, around torch's own __call__
        assert vars(trained)["forward"].__wrapped__.__func__ is vars(nn.Module)["__call__"]


class Gated(nn.Module):
    """A forward that reads a value on the host (`.item()`): dynamo breaks the graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.mean().item() > 10.0:  # BREAK: a host read inside the compiled forward
            h = h / 2
        return self.b(h)


def gated_run(how: str, agent_options: dict | None, run_dir) -> tuple[list[str], dict, dict | None]:
    """40 steps of Gated, compiled `how`, batches of 64 and 48 rows alternating; with
    `agent_options`, under tuneup attached before the model is built. The losses (float.hex),
    torch's counters, and tuneup's snapshot."""
    torch._dynamo.reset()
    counters.clear()
    agent = tuneup.attach(run_dir=run_dir, interval=60, **agent_options) if agent_options is not None else None
    try:
        torch.manual_seed(0)
        model = Gated()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trained = compile_as(how, model, optimizer)
        losses = []
        for step in range(40):
            size = 64 if step % 2 == 0 else 48
            x, y = torch.randn(size, 16), torch.randn(size, 1)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(trained(x), y)
            loss.backward()
            optimizer.step()
            losses.append(float.hex(loss.detach().double().item()))
    finally:
        if agent is not None:
            agent.detach()
        compiled = {section: dict(counters[section]) for section in ("frames", "stats", "recompiles", "graph_break")}
        torch._dynamo.reset()
    return losses, compiled, agent.snapshot() if agent is not None else None


@pytest.mark.parametrize("mode", ["advise", "apply"])
@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_host_read_inside_a_compiled_forward_adds_no_frame(how, mode, run_dir):
    """Ground truth from gated_run: the `.item()` in Gated.forward breaks its graph and runs
    eagerly between the graphs, on every step; the batch size changes (a recompile, then
    dynamic). tuneup counts that read on its sampled steps (every other step here), calling it
    from the job's line through a frame of its own (_patching.call_site): dynamo's frame
    callback never gets that frame. The same frames (total and ok), graphs, recompiles and
    breaks as without tuneup, losses bit-identical, all 40 steps counted, the read counted at
    Gated's BREAK line."""
    import inspect

    source, first = inspect.getsourcelines(Gated.forward)
    break_line = next(first + index for index, line in enumerate(source) if "BREAK" in line)
    plain, expected, _ = gated_run(how, None, run_dir)
    options = {"sync_sample_every": 2, **({"mode": "apply"} if mode == "apply" else {})}
    tuned, compiled, snapshot = gated_run(how, options, run_dir)
    assert expected["graph_break"] and expected["frames"]["total"] >= 2, expected
    assert compiled == expected
    assert tuned == plain
    assert snapshot["totals"]["steps"] == 40
    assert any(source["location"].endswith(f"test_compile.py:{break_line}") and source["kind"] == "item"
               for source in snapshot["syncs"]["top_sources"]), snapshot["syncs"]


def test_compile_time_recompiles_and_graph_breaks_are_shown_with_their_lines(run_dir):
    """Ground truth, from the loop below: 30 steps; batches of 64 then 48 (the epoch's last
    batch is short): the second size recompiles the forward once (dynamo then marks the size
    dynamic); `.item()` in Gated.forward breaks the graph at the BREAK line; the steps that
    compiled are warm-up steps, their compile time kept out of the step times."""
    import inspect

    torch._dynamo.reset()
    break_line = next(number for number, line in enumerate(inspect.getsourcelines(Gated.forward)[0],
                                                           inspect.getsourcelines(Gated.forward)[1])
                      if "BREAK" in line)
    agent = tuneup.attach(run_dir=run_dir, interval=0.2)
    try:
        torch.manual_seed(0)
        model = torch.compile(Gated(), backend="eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(112, 16), torch.randn(112, 1)
        for step in range(30):
            start = 0 if step % 2 == 0 else 64
            x, y = data[0][start:start + 64], data[1][start:start + 64]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        agent.ticker.tick()
        with urllib.request.urlopen(f"{agent.server.url}/metrics", timeout=10) as response:
            exposition = response.read().decode()
    finally:
        agent.detach()
    snapshot = agent.snapshot()
    compiled, totals = snapshot["compile"], snapshot["totals"]
    scraped = {sample.name: sample.value for family in text_string_to_metric_families(exposition)
               for sample in family.samples if sample.name.startswith("tuneup_") and "compile" in sample.name
               or sample.name in ("tuneup_recompiles_total", "tuneup_graph_breaks_total")}
    assert scraped["tuneup_recompiles_total"] >= 1 and scraped["tuneup_graph_breaks_total"] >= 1, scraped
    assert scraped["tuneup_compile_seconds_total"] > 0 and scraped["tuneup_compiled_graphs"] >= 2, scraped
    torch._dynamo.reset()
    assert snapshot["totals"]["steps"] == 30
    assert compiled["compiles"] >= 2 and compiled["seconds"] > 0, compiled
    assert compiled["recompiles"] >= 1 and compiled["recompile_sites"][0]["where"].startswith("forward")
    assert "size" in compiled["recompile_sites"][0]["guard"], compiled["recompile_sites"]
    sites = {site["where"]: site for site in compiled["graph_break_sites"]}
    assert f"test_compile.py:{break_line}" in sites, (break_line, compiled["graph_break_sites"])
    assert "item" in sites[f"test_compile.py:{break_line}"]["reason"].lower()
    # The compiling steps are warm-up steps: their compile time is out of the step times. (A
    # loop without a DataLoader closes a step at the next optimizer step: the second
    # iteration's forward, and its recompile, fall in step 1, one warm-up step.)
    assert totals["warmup_steps"] >= 1, totals
    assert totals["compile_seconds"] == pytest.approx(compiled["seconds"]), (totals, compiled)
    report = agent.report()
    assert "torch.compile:" in report and "graph break" in report and "recompiled" in report
    assert "left out of the step-time statistics and the split" in " ".join(report.split()), report


def test_the_compile_rules_name_the_recompiling_guard_and_the_breaking_line(run_dir):
    """Ground truth: a batch size that changes every step among three sizes with dynamic=False
    recompiles the forward for each new size (2 recompiles: 48, then 32); `.item()` in
    Gated.forward breaks the graph at its BREAK line, and the code dynamo resumes at after it
    is specialized to `h`'s size and to the float `.item()` read (`___stack0 == 0.22...`, its
    guard_failures say; dynamic=False keeps the float static): a new value every step
    recompiles it until torch._dynamo.config.recompile_limit compilations (8: 7 recompiles),
    after which that frame runs eagerly."""
    import inspect

    from tuneup.diagnose.engine import evaluate

    torch._dynamo.reset()
    source, first = inspect.getsourcelines(Gated.forward)
    break_line = next(first + index for index, line in enumerate(source) if "BREAK" in line)
    agent = tuneup.attach(run_dir=run_dir, interval=0.2)
    try:
        torch.manual_seed(0)
        model = torch.compile(Gated(), backend="eager", dynamic=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(30):
            size = (64, 48, 32)[step % 3]
            x, y = torch.randn(size, 16), torch.randn(size, 1)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    finally:
        agent.detach()
    snapshot = agent.snapshot()
    torch._dynamo.reset()
    findings = {finding.rule: finding for finding in evaluate(snapshot).findings}
    recompiling = findings["recompiles"]
    sites = {site["where"].split(" at test_compile.py")[0]: site["count"] for site in recompiling.evidence["sites"]}
    limit = torch._dynamo.config.recompile_limit
    assert sites == {"forward": 2, f"forward after its graph break at line {break_line}": limit - 1}, sites
    assert snapshot["compile"]["recompiles"] == 2 + limit - 1
    assert "mark_dynamic" in recompiling.fix
    breaking = findings["graph-breaks"]
    assert f"test_compile.py:{break_line}" in breaking.observed and "capture_scalar_outputs" in breaking.fix


def test_recompiles_before_a_reset_are_not_given_to_the_frames_after_it(run_dir):
    """Ground truth from the loop: a first model compiled with dynamic=False and trained on
    batches of 64, 48, 32 and 16 rows compiles its forward four times (3 recompiles); then
    `torch._dynamo.reset()`, which numbers dynamo's frames from 0 again
    (torch/_dynamo/__init__.py reset: FRAME_COUNTER = 0), and a second model trained on 64
    and 48 compiles its forward twice (1 recompile), as frame 0 again. The run recompiled 4
    times; the second model's forward once, so no site recompiled >= 2 times since the reset
    and the recompiles rule stays silent (the first model's sites went with torch's records
    of them: reset clears guard_failures)."""
    from tuneup.diagnose.engine import evaluate

    def train(sizes):
        model = torch.compile(Net(), backend="eager", dynamic=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(24):
            size = sizes[step % len(sizes)]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(torch.randn(size, 16)), torch.randn(size, 1)).backward()
            optimizer.step()

    torch._dynamo.reset()
    agent = tuneup.attach(run_dir=run_dir, interval=60)
    try:
        torch.manual_seed(0)
        train((64, 48, 32, 16))
        before = agent.snapshot()["compile"]
        torch._dynamo.reset()
        train((64, 48))
        agent.ticker.tick()
    finally:
        agent.detach()
    snapshot = agent.snapshot()  # (before the reset below clears torch's records it reads)
    torch._dynamo.reset()
    compiled = snapshot["compile"]
    assert (before["recompiles"], [site["count"] for site in before["recompile_sites"]]) == (3, [3]), before
    assert compiled["compiles"] == 6 and compiled["recompiles"] == 4, compiled
    [site] = compiled["recompile_sites"]
    assert site["count"] == 1 and "size" in site["guard"], site
    assert "recompiles" not in {finding.rule for finding in evaluate(snapshot).findings}


def test_amp_off_on_a_compiled_model_waits_for_a_measure_it_cannot_take(run_dir):
    """A compiled fp32 model on a CPU with bf16 (claimed: cpu_bf16=True): its forward is not
    timed (its graphs run the step, not its forward), so amp-off says what it wants, not a guess, and apply
    mode tries nothing (on a GPU it estimates, and says apply mode cannot make the change:
    test_rules_recorded)."""
    torch._dynamo.reset()
    agent = tuneup.attach(run_dir=run_dir, mode="apply", actions=["amp"], cpu_bf16=True, interval=0.2)
    try:
        torch.manual_seed(0)
        model = torch.compile(Net(), backend="eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        for _ in range(140):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        agent.ticker.tick()  # the rules and apply mode's turn, now
        for _ in range(60):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    finally:
        agent.detach()
        torch._dynamo.reset()
    assert "amp-off" not in {finding["rule"] for finding in agent.findings()}
    wanting = evaluate(agent.snapshot()).wanting
    assert "the model is compiled" in wanting["amp-off"], wanting
    assert [record for record in agent.actions() if record["action"] == "amp"] == []

def eager_then_compiled(model, optimizer, loader, eager: int, seen: list | None = None) -> list[float]:
    """`eager` steps as written, then with `optimizer.step = torch.compile(optimizer.step)` (as
    torch's compiled-optimizer tutorial writes it) for the rest of the loader's batches: dynamo
    traces torch's step wrapper, which iterates the registry of global step pre-hooks
    (torch/optim/optimizer.py profile_hook_step). `seen`: at each eager step, whether
    tuneup's pre-hook was in that registry."""
    from torch.optim import optimizer as registry

    losses = []
    for index, (x, y) in enumerate(loader):
        if index < eager and seen is not None:
            seen.append(any(getattr(hook, "__qualname__", "").startswith("optimizer_hooks.")
                            for hook in registry._global_optimizer_pre_hooks.values()))
        if index == eager:
            optimizer.step = torch.compile(optimizer.step, backend="eager")
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_an_optimizer_step_compiled_after_eager_steps_compiles_as_without_tuneup(run_dir):
    """Ground truth from the loop: 160 batches of 8, the first 120 steps eager, then the
    optimizer's step compiled for the last 40. On the eager steps tuneup's optimizer pre-hook
    comes and goes from torch's registry (in place on detail steps only:
    OptimizerProbe.fit_pre_hook), and dynamo guards on that registry where it traces the step
    wrapper (`len(G['_global_optimizer_pre_hooks'])`): the compilation's start callback puts the
    hook back for good before dynamo traces, so the compiled step is traced with it and no guard
    of it ever fails. Compared with the same loop
    without tuneup: the same graphs and recompiles, bit-identical losses, and all 160 steps
    counted."""
    from torch.utils.data import DataLoader, TensorDataset

    def run(attached: bool):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = TensorDataset(torch.randn(1280, 16), torch.randn(1280, 1))
        loader = DataLoader(data, batch_size=8)
        seen: list[bool] = []
        if not attached:
            return eager_then_compiled(model, optimizer, loader, 120), {}, seen
        with tuneup.attach(run_dir=run_dir, detail_every=8, sync_sample_every=0) as agent:
            losses = eager_then_compiled(model, optimizer, loader, 120, seen)
        return losses, agent.snapshot()["totals"], seen

    from torch._dynamo.utils import guard_failures  # code -> the guards that failed at its lookups

    plain, _, _ = run(False)
    expected = {section: dict(counters[section]) for section in ("frames", "stats", "recompiles")}
    assert not guard_failures
    tuned, totals, seen = run(True)
    compiled = {section: dict(counters[section]) for section in ("frames", "stats", "recompiles")}
    assert any(seen) and not all(seen[8:])  # it came and went on the eager steps
    # The step wrapper's frame guards on `len(G['_global_optimizer_pre_hooks'])`: had the hook
    # come or gone after its compilation, that guard would fail and the step recompile.
    assert not guard_failures, {code.co_name: reasons for code, reasons in guard_failures.items()}
    one_frame_fewer(compiled, expected)  # the compiled optimizer step's one frame
    assert compiled == expected
    assert [float.hex(value) for value in tuned] == [float.hex(value) for value in plain]
    assert totals["steps"] == 160



def compiled_steps(model, optimizer, micro_batches: int):
    """Two ways to compile the training step with `micro_batches` forwards and backwards
    accumulating into one update (each backward a graph break: dynamo does not trace
    Tensor.backward): `whole(xs, ys)` runs them all and the update; `micro(x, y)` runs one,
    `update()` steps the optimizer and zeroes the gradients."""

    @torch.compile(backend="eager")
    def whole(xs, ys):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(xs, ys):
            loss = nn.functional.mse_loss(model(x), y) / micro_batches
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total

    @torch.compile(backend="eager")
    def micro(x, y):
        loss = nn.functional.mse_loss(model(x), y) / micro_batches
        loss.backward()
        return loss.detach()

    @torch.compile(backend="eager")
    def update():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return whole, micro, update


@pytest.mark.parametrize("fetch", [False, True], ids=["whole step, batches in memory", "micro-step, DataLoader"])
def test_a_training_step_compiled_with_its_update_counts_one_step_per_update(run_dir, fetch):
    """Ground truth from the loop: 24 updates of SGD, each after 4 micro-batches (forward,
    backward) accumulating, the update inside compiled code, so no optimizer hook runs
    eagerly and no forward is seen. In memory: one call of the compiled step per update, the
    micro-batches sliced inside it. With a DataLoader: 96 fetches of a micro-batch of 8 rows,
    each through a compiled forward and backward, every 4th followed by a compiled update.
    Each update moves the parameters' version counters, the accumulating backwards do not:
    24 steps, not 96 (a micro-batch taken for a step) nor 1 (none closed). Losses
    bit-identical to the same loop without tuneup."""
    from torch.utils.data import DataLoader, TensorDataset

    def run(attached: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        whole, micro, update = compiled_steps(model, optimizer, 4)
        xs, ys = torch.randn(24, 4, 8, 16), torch.randn(24, 4, 8, 1)
        agent = tuneup.attach(run_dir=run_dir, interval=60) if attached else None
        try:
            if fetch:
                losses = []
                for index, (x, y) in enumerate(DataLoader(TensorDataset(xs.flatten(0, 2), ys.flatten(0, 2)),
                                                          batch_size=8)):
                    losses.append(float.hex(micro(x, y).item()))
                    if index % 4 == 3:
                        update()
            else:
                losses = [float.hex(whole(x, y).item()) for x, y in zip(xs, ys)]
        finally:
            if agent is not None:
                agent.detach()
        return losses, agent

    plain, _ = run(False)
    tuned, agent = run(True)
    torch._dynamo.reset()
    assert len(plain) == (96 if fetch else 24) and tuned == plain
    snapshot = agent.snapshot()
    assert snapshot["totals"]["steps"] == 24
    assert agent.recorder.timeline.changed_steps >= 23  # (the last one closes at detach)
    at = "a DataLoader fetch" if fetch else "the next backward"
    assert snapshot["habits"]["step_boundary"].endswith(f"{at} after they changed")
    assert snapshot["window"]["backward_passes_per_step"] == 4
    if fetch:
        assert snapshot["window"]["fetches_per_step"] == 4


def test_a_compilation_is_seen_before_any_tick_after_dynamo_loads(tmp_path):
    """No tick comes (interval 60 s), so only dynamo's import tells tuneup when to register its
    compile callbacks. Under `tuneup run`, the program imports nothing of dynamo's; torch.compile
    loads it, and its function compiles at the first call (6 steps): that compilation is timed,
    its step a warm-up step."""
    env = child_env(TUNEUP_RUN_DIR=str(tmp_path / "run"), TUNEUP_INTERVAL="60", TUNEUP_PORT="0")
    child = subprocess.run([sys.executable, "-m", "tuneup", "run", str(PROGRAM.parent / "compiled_train_step.py"),
                            "--steps", "6"], capture_output=True, text=True, env=env, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    [end] = [event for event in read_log(next((tmp_path / "run").glob("events*.jsonl"))).events
             if event.get("event") == "end"]
    assert end["totals"]["steps"] == 6 and end["totals"]["warmup_steps"] >= 1, end["totals"]
    assert end["totals"]["compile_seconds"] > 0


def test_updates_no_hook_sees_after_an_optimizer_are_found_by_their_fetches(run_dir):
    """Ground truth from the loop: 56 batches fetched, each one update: 8 by torch's SGD, then
    48 written out by hand (`p.add_(p.grad, alpha=-lr)` under no_grad), as a script switching
    to an update rule of its own writes them. No optimizer hook
    sees the later ones and no compilation announces them, so the fetches decide: after
    UNSEEN_FETCHES of them with no update seen, the parameters' versions end the steps. Those
    first fetches are one step; every later one is its own."""
    from torch.utils.data import DataLoader, TensorDataset

    from tuneup.measure.hotpath import UNSEEN_FETCHES

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(torch.randn(56 * 8, 16), torch.randn(56 * 8, 1)), batch_size=8)
    with tuneup.attach(run_dir=run_dir, interval=60) as agent:
        for index, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if index < 8:
                optimizer.step()
                continue
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(parameter.grad, alpha=-0.05)
    totals = agent.snapshot()["totals"]
    assert agent.recorder.timeline.fetches == 56
    # 8 by SGD, one of the first UNSEEN_FETCHES + 1 by hand, each of the 48 - (UNSEEN_FETCHES + 1) after.
    assert totals["steps"] == 8 + 1 + 48 - (UNSEEN_FETCHES + 1), totals


def test_long_gradient_accumulation_stays_one_step_per_update(run_dir):
    """Ground truth from the loop: an AdamW update after the first micro-batch fetched from a
    DataLoader (forward, backward), then 3 more, each after 40: 4 steps. After each backward the loop moves the
    gradients into buffers of its own and clears them (as DeepSpeed's ZeRO engine does in its
    backward), and puts the sums back before the update. Past UNSEEN_FETCHES fetches without an
    update tuneup watches the parameters (it cannot tell this from an update it cannot see);
    they do not change until the update, and a gradient cleared between micro-batches is no
    update there (ModelProbe.hand_boundary steps aside while watching; before the first
    update no optimizer was seen, and such a loop's micro-batches are steps updated by hand)."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sums = {parameter: torch.zeros_like(parameter) for parameter in model.parameters()}
    loader = DataLoader(TensorDataset(torch.randn(121 * 8, 16), torch.randn(121 * 8, 1)), batch_size=8)
    with tuneup.attach(run_dir=run_dir, interval=60) as agent:
        for index, (x, y) in enumerate(loader):
            (nn.functional.mse_loss(model(x), y) / 40).backward()
            for parameter, total in sums.items():
                total += parameter.grad
                parameter.grad = None
            if index % 40 == 0:
                for parameter, total in sums.items():
                    parameter.grad = total.clone()
                    total.zero_()
                optimizer.step()
                optimizer.zero_grad()
    snapshot = agent.snapshot()
    assert agent.recorder.timeline.fetches == 121
    assert snapshot["totals"]["steps"] == 4, snapshot["totals"]
    assert agent.recorder.timeline.watching is False  # the last update ended the watch
