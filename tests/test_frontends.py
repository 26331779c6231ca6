"""torch's front-ends see the job as they would without tuneup.

Every attribute tuneup replaces at attach is listed in AUDIT with the front-ends that look at
it. Each front-end runs three times in this process on the same objects: before attach, while
attached (after real training steps, so every probe is installed, the root model's class is
patched, a watched step ran, and, in apply mode, AMP is on trial) and after detach; what it
produces must be the same each time: TorchScript's code (functions and modules) or its error,
jit.trace and fx code, torch.export's graph, torch.compile's graphs, graph breaks and
recompiles, deep copies, pickles and torch.save round trips, and batches from DataLoader
workers started with spawn.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import re
import sys
import warnings
from math import sqrt  # fx autowraps math functions found in the forward's globals

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

import tuneup
from tuneup.diagnose.rules import precision as precision_rules
from tuneup.measure.precision import BUDGET_STEPS, PrecisionTrial
from tuneup.measure.syncs import HOST_READS
from torch._dynamo.callback import CompilationCallbackHandler

# (owner, attribute): the front-ends that look at it, as tested below.
AUDIT = {
    (DataLoader, "__iter__"): "DataLoader workers under spawn, pickle",
    (DataLoader, "_get_iterator"): "DataLoader workers under spawn (apply mode)",
    (_BaseDataLoaderIter, "__next__"): "DataLoader workers under spawn",
    (torch.Tensor, "backward"): "jit.script of functions calling backward, compile",
    (torch.optim.Optimizer, "zero_grad"): "deepcopy/pickle/save of optimizers, compile",
    (nn.Module, "zero_grad"): "jit.script/trace, fx, export of modules, deepcopy, save",
    (torch.amp.GradScaler, "scale"): "pickle and deepcopy of GradScaler",
    (torch.amp.GradScaler, "step"): "pickle and deepcopy of GradScaler",
    (torch.amp.GradScaler, "update"): "pickle and deepcopy of GradScaler",
    **{(owner, name): "jit.script of tensor methods, compile" for owner, name in HOST_READS},
    ("model class", "forward"): "jit.script/trace, fx, export, compile, deepcopy, save (advise and apply)",
    (("instance", CompilationCallbackHandler), "clear"): "none: torch._dynamo.reset calls it, nothing inspects it",
}


def audit_key(owner):
    """An owner as AUDIT names it: itself, or by its class an instance that cannot be hashed
    (dynamo's callback handler, a dataclass)."""
    try:
        hash(owner)
    except TypeError:
        return "instance", type(owner)
    return owner
if torch.distributed.is_available():
    from torch.distributed import distributed_c10d

    AUDIT[(torch.distributed, "destroy_process_group")] = "none: called, never inspected"
    AUDIT[(distributed_c10d, "destroy_process_group")] = "none: called, never inspected"


class Block(nn.Module):
    """A model written the way public scripts write them: functional ops from the module's
    own imports (F, sqrt), which TorchScript and fx resolve through the forward's globals."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        return self.fc2(h) / sqrt(h.shape[-1])


class Arrays(Dataset):
    """Samples converted from NumPy arrays with torch.tensor (a copy), as many datasets do."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        row = numpy.full(8, index / 32, dtype=numpy.float32)
        return torch.tensor(row), torch.tensor(numpy.float32(index % 2))


X = torch.linspace(-1, 1, 16).reshape(2, 8)
FORWARD = vars(Block)["forward"]  # the class as this file defines it


def script_functions():
    """Functions calling torch functions TorchScript resolves by identity."""

    def uses_builtins(t: torch.Tensor) -> torch.Tensor:
        return t + torch.tensor(1.0) + torch.nonzero(t).sum()

    def uses_backward(t: torch.Tensor):
        torch.autograd.backward([t.sum()])

    def uses_methods(t: torch.Tensor) -> float:
        values: list[float] = t.tolist()
        return t.sum().item() + float(len(values)) + float(bool(t.sum() > 0)) + float(t.cpu().nonzero().numel())

    scripted = [torch.jit.script(fn) for fn in (uses_builtins, uses_backward, uses_methods)]
    return [s.code for s in scripted], scripted[0](X[0]).tolist(), scripted[2](X[0])


def script_clipping():
    """Scripting a function that clips gradients: compiled from clip_grad_norm_'s own source."""

    def clips(parameters: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, 1.0)

    return torch.jit.script(clips).code


def script_module(model):
    scripted = torch.jit.script(model)
    # Each compilation of a class gets a new mangled name, with or without tuneup.
    graph = re.sub(r"___torch_mangle_\d+\.", "", str(scripted.graph))
    return scripted.code, graph, scripted(X).tolist()


def trace_module(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings: the same either way
        traced = torch.jit.trace(model, X)
    return traced.code, traced(X).tolist()


def fx_trace(model):
    graph = torch.fx.symbolic_trace(model)
    return graph.code, graph(X).tolist()


def export(model):
    program = torch.export.export(model, (X,))
    return str(program.graph), program.module()(X).tolist()


def compiled(model):
    """torch.compile (dynamo; the eager backend keeps it quick): graphs, breaks and recompiles,
    on the model and on a train step (zero_grad, GradScaler, backward, a loss read); then the
    outputs (apply mode's AMP, on trial, changes those on purpose: compared apart)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    log = logging.getLogger("torch._dynamo")
    level = log.level
    log.setLevel(logging.ERROR)  # the graph break at .item() is logged as a warning every run
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the model stays as it is
    scaler = torch.amp.GradScaler("cpu")

    @torch.compile(backend="eager")
    def step(x):
        optimizer.zero_grad()
        loss = model(x).sum()
        scaler.scale(loss).backward()
        return loss.item()

    forward = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [forward(X).tolist() for _ in range(3)] + [step(X) for _ in range(3)]
    seen = {section: dict(counters[section]) for section in ("stats", "graph_break", "recompiles") if counters[section]}
    torch._dynamo.reset()
    log.setLevel(level)
    return seen, sorted({str(w.message) for w in caught}), outputs


def copies(model, optimizer, scaler):
    model_copy = copy.deepcopy(model)
    optimizer_copy = copy.deepcopy(optimizer)
    scaler_copy = copy.deepcopy(scaler)
    return (model_copy(X).tolist(), sorted(map(str, optimizer_copy.state_dict()["state"].items())),
            scaler_copy.state_dict())


def saved(model, optimizer, scaler):
    def round_trip(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return (round_trip(model)(X).tolist(), type(round_trip(optimizer)).__name__,
            str(round_trip(optimizer.state_dict())["state"]), pickle.loads(pickle.dumps(scaler)).state_dict(),
            type(pickle.loads(pickle.dumps(model))).__name__)


def spawned_workers():
    loader = DataLoader(Arrays(), batch_size=8, num_workers=2, multiprocessing_context="spawn")
    return [[t.tolist() for t in batch] for batch in loader]


FRONT_ENDS = {
    "jit.script functions": lambda job: script_functions(),
    "jit.script clip_grad_norm_": lambda job: script_clipping(),
    "jit.script module": lambda job: script_module(job["model"]),
    "jit.trace": lambda job: trace_module(job["model"]),
    "fx.symbolic_trace": lambda job: fx_trace(job["model"]),
    "torch.export": lambda job: export(job["model"]),
    "torch.compile": lambda job: compiled(job["model"]),
    "deepcopy": lambda job: copies(job["model"], job["optimizer"], job["scaler"]),
    "torch.save and pickle": lambda job: saved(job["model"], job["optimizer"], job["scaler"]),
    "DataLoader workers under spawn": lambda job: spawned_workers(),
}


def outcome(front_end, job):
    """What a front-end produced, or the error it raised (type and message)."""
    try:
        return ("ok", FRONT_ENDS[front_end](job))
    except Exception as exc:  # some front-ends refuse a case: they must refuse it the same way
        return ("error", type(exc).__name__, str(exc))


def train(job, steps):
    model, optimizer, scaler = job["model"], job["optimizer"], job["scaler"]
    loader = DataLoader(Arrays(), batch_size=4, shuffle=False)
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).squeeze(1), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            done += 1
            if done == steps:
                break


def claimed_bf16_gain(trial, model, captured, config, budget):
    """PrecisionTrial._time's result for a model twice as fast under bf16 autocast."""
    step = budget / BUDGET_STEPS
    return {"device": "cpu", "dtype": "bfloat16", "model": type(model).__name__, "pairs": 12, "faster_pairs": 12,
            "fp32_seconds": step, "reduced_seconds": step / 2, "speedup": 2.0}


def new_job():
    torch.manual_seed(0)
    model = Block()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "scaler": torch.amp.GradScaler("cpu")}


def restore(job, state):
    """The job's model, optimizer and scaler as they were (copies: Optimizer.load_state_dict
    keeps the tensors it is given where their device and dtype already fit, and training
    would change them in place)."""
    model_state, optimizer_state, scaler_state = copy.deepcopy(state)
    job["model"].load_state_dict(model_state)
    job["optimizer"].load_state_dict(optimizer_state)
    job["scaler"].load_state_dict(scaler_state)


@pytest.fixture(scope="module", params=["advise", "apply"])
def phases(request, tmp_path_factory):
    """Each front-end's outcome before attach, while attached and after detach. The job trains
    between attach and the attached phase; its state is put back as it was before, so every
    phase sees the same model."""
    mode = request.param
    job = new_job()
    train(job, 4)
    state = (copy.deepcopy(job["model"].state_dict()), copy.deepcopy(job["optimizer"].state_dict()),
             job["scaler"].state_dict())
    results = {"before": {name: outcome(name, job) for name in FRONT_ENDS}}
    run_dir = tmp_path_factory.mktemp(f"frontends-{mode}")
    options = dict(run_dir=run_dir, port=0, interval=0.1)
    patch = pytest.MonkeyPatch()
    if mode == "apply":  # AMP on trial: the model class's forward is apply mode's too
        options.update(mode="apply", actions=["amp"], cpu_bf16=True)
        # This 8-16-1 model gains nothing in bf16, and amp-off (which starts the AMP action)
        # fires on a measured gain: the measurement is claimed, as the CPU's bf16 units are,
        # for a test about the front-ends and not about the gain (test_precision_trial).
        patch.setattr(PrecisionTrial, "_time", claimed_bf16_gain)
        # And so is the model's share of the step (forward + backward: 15-25% of this loop's,
        # whose loader and AdamW do most of it): on a machine busy enough to push it under 10%,
        # apply mode would leave AMP to the user (terms.small_gain_refusal) and try nothing.
        patch.setattr(precision_rules, "_compute_share", lambda facts: 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = tuneup.attach(**options)
    try:
        steps = 0
        while steps < 3000 and not (
                agent.recorder.calls.watched_steps and (mode == "advise" or any(
                    r["decision"] == "trying" for r in agent.actions()))):
            train(job, 8)
            steps += 8
        trying = mode == "apply" and any(r["decision"] == "trying" for r in agent.actions())
        why = (steps, agent.recorder.precision.result, [(r["decision"], r.get("reason")) for r in agent.actions()],
               [f["rule"] for f in agent.findings()])
        replaced = {(audit_key(owner), name) for owner, name, _ in agent._patches.replaced}
        originals = [original for _, _, original in agent._patches.replaced]
        restore(job, state)
        # The FLOP count waiting for the model's next training forward (started again where the
        # loop's last step, not closed until the next fetch, gave it one: offstep.py capture), as it does every
        # RECHECK_STEPS steps (a module pre-hook of tuneup's on the model at that moment made
        # jit.script fail on its code and deepcopy on what it was bound to, in CI at step 592).
        flops = agent.recorder.flops
        flops.capture([job["model"]])
        waiting = [flops.state == "capturing"]
        # And a watched step open (calls.py: the profile function set and, on CPU, the array
        # copy mode ready), as on an early step or one in every few hundred: the front-ends run
        # inside it until one of them closes the step (the compiled train step's optimizer).
        agent.recorder.calls._start(agent.recorder.timeline.ring.count)
        waiting.append(sys.getprofile() is not None)
        # And a sampled step counting host reads: on CPU their wrappers are in place only then
        # (syncs.py SyncCounter.install), and the front-ends meet them there.
        agent.recorder.syncs._start()
        waiting.append("item" in vars(torch.Tensor))
        results["attached"] = {name: outcome(name, job) for name in FRONT_ENDS}
        waiting.append(flops.state == "capturing")
        left = (flops.state, flops._missed, flops.skipped)
        flops.counts.clear()  # counted again from the next training forward it is given
        more = 0
        while more < 3000 and flops.state in ("capturing", "captured"):  # (captured: its step not closed yet)
            # One step at a time: the count's next look comes at the next lifecycle check (every
            # 64 steps), and with torch.compile among the front-ends that look stops counting
            # (the model is compiled): eight steps at a time ended past it in CI ('done', 1).
            train(job, 1)
            more += 1
        recount = (flops.state, len(flops.counts))
        restore(job, state)
    finally:
        agent.detach()
        patch.undo()
    results["detached"] = {name: outcome(name, job) for name in FRONT_ENDS}
    return {"results": results, "replaced": replaced, "originals": originals, "agent": agent,
            "mode": mode, "trying": trying, "why": why, "model_class": Block, "waiting": waiting, "left": left,
            "recount": recount}


def test_a_capture_waiting_for_the_next_forward_leaves_no_trace_and_is_given_it(phases):
    """The front-ends ran while the FLOP count waited for a training forward (nothing of it on
    the model: see the test below), from inside a watched and sync-sampled step, and none of their calls was
    taken for the training forward; the job's next
    training forward on a detail step was, and counted."""
    assert phases["waiting"] == [True, True, True, True], phases["left"]
    assert phases["recount"] == ("counted", 1)


@pytest.mark.parametrize("front_end", list(FRONT_ENDS))
def test_front_ends_behave_as_without_tuneup_attached_and_after_detach(phases, front_end):
    if phases["mode"] == "apply":
        assert phases["trying"], ("AMP must be on trial while the front-ends run", phases["why"])
    before = phases["results"]["before"][front_end]
    attached = phases["results"]["attached"][front_end]
    if front_end == "torch.compile" and phases["mode"] == "apply" and before[0] == "ok":
        # The compiled forward runs under AMP's autocast on purpose (its graph captures the
        # casts too): the same number of graphs, the same breaks, recompiles and warnings;
        # outputs as close as bf16 keeps them.
        (seen, warned, _), (seen_before, warned_before, _) = attached[1], before[1]
        assert seen["stats"]["unique_graphs"] == seen_before["stats"]["unique_graphs"]
        assert {k: v for k, v in seen.items() if k != "stats"} == {k: v for k, v in seen_before.items() if k != "stats"}
        assert warned == warned_before
        assert numpy.allclose(numpy.array(attached[1][2][:3]), numpy.array(before[1][2][:3]), atol=0.05)
    else:
        assert attached == before
    assert phases["results"]["detached"][front_end] == before


def trainers_audited() -> set:
    """The frameworks' Trainer classes whose __init__ tuneup wraps while attached (integrations/
    watch.py), where the process imported them (another test may have): a call, never resolved
    by identity; functools.wraps keeps the signature LightningCLI and argparse helpers inspect."""
    from tuneup.integrations.watch import TRAINER_MODULES

    return {(module.Trainer, "__init__") for name in TRAINER_MODULES if (module := sys.modules.get(name)) is not None}


def test_every_replaced_attribute_is_audited_and_none_is_resolved_by_identity(phases):
    audited = {key for key in AUDIT if key[0] != "model class"} | trainers_audited()
    replaced = {(owner, name) for owner, name in phases["replaced"] if owner is not Block}
    assert replaced <= audited, replaced - audited
    assert (Block, "forward") in phases["replaced"]  # the model class, audited as "model class"
    from torch.jit._builtins import _find_builtin

    # TorchScript resolves builtins by identity (torch/jit/_builtins.py): none may be replaced.
    assert [original for original in phases["originals"] if _find_builtin(original) is not None] == []
    for module in (torch, torch.nn.functional, torch.autograd, torch.nn.utils):
        assert not any(original is value for original in phases["originals"] for value in vars(module).values()
                       if callable(value) and not isinstance(value, type)), module.__name__


def test_detach_leaves_no_hook_or_attribute_behind(phases):
    assert vars(Block)["forward"] is FORWARD
    assert "backward" not in vars(torch.Tensor) or not hasattr(torch.Tensor.backward, "__wrapped__")
    assert not any(hasattr(getattr(owner, name, None), "__wrapped__") for owner, name in HOST_READS)
    assert not module_hooks._global_forward_pre_hooks and not module_hooks._global_forward_hooks
    assert vars(nn.Module)["__call__"] is module_hooks.Module._wrapped_call_impl  # model discovery's, put back
    assert not optimizer_hooks._global_optimizer_pre_hooks and not optimizer_hooks._global_optimizer_post_hooks


SCRIPTS = {
    "imports torch.distributed.optim": """
        import torch.distributed.optim
        print("imported", torch.distributed.optim.ZeroRedundancyOptimizer.__name__)
    """,
    "scripts a function calling torch.tensor": """
        import torch

        @torch.jit.script
        def shifted(x: torch.Tensor) -> torch.Tensor:
            return x + torch.tensor(1.0) + torch.nonzero(x).sum()

        print(shifted(torch.arange(4.0)).tolist())
    """,
    "trains a scripted module": """
        import torch
        from torch import nn

        torch.manual_seed(0)
        encoder = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))  # a root tuneup cannot hook
        head = nn.Linear(8, 1)
        optimizer = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
        data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(8)]
        for step in range(40):
            x, y = data[step % 8]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(head(encoder(x)), y)
            loss.backward()
            optimizer.step()
        print(f"{loss.item():.6f}", sum(p.sum().item() for p in head.parameters()))
    """,
}


def write_script(folder, name: str, source: str, attach: bool):
    import textwrap

    path = folder / f"{name.replace(' ', '_')}.py"
    path.write_text(("import tuneup; tuneup.attach()\n" if attach else "") + textwrap.dedent(source))
    return path


@pytest.mark.parametrize("attach", [False, True], ids=["tuneup run", "tuneup.attach()"])
@pytest.mark.parametrize("name", [*SCRIPTS, "GPT-2 pretraining script"])
def test_torchscript_jobs_run_as_under_plain_python(tmp_path, name, attach):
    """The reproductions of the TorchScript crash: the same exit status and output as python."""
    import subprocess
    import sys

    from tests.conftest import PROGRAMS, child_env

    if name in SCRIPTS:
        script = write_script(tmp_path, name, SCRIPTS[name], attach)
    else:
        source = (PROGRAMS / "train_gpt2_small.py").read_text()
        script = write_script(tmp_path, "train_gpt2", source, attach)
    env = child_env(TUNEUP_RUN_DIR=str(tmp_path / "run"), TUNEUP_PORT="0")
    plain = subprocess.run([sys.executable, str(script)], env={**env, "TUNEUP_DISABLE": "1"}, capture_output=True,
                           text=True, timeout=300)
    command = [str(script)] if attach else ["-m", "tuneup", "run", str(script)]
    measured = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert measured.returncode == 0, measured.stderr
    assert measured.stdout == plain.stdout and measured.stdout
    assert "Traceback" not in measured.stderr and "TuneupWarning" not in measured.stderr, measured.stderr
    if name == "GPT-2 pretraining script":
        # The numpy-copies rule still sees the script's one torch.tensor(array) per step; a
        # finding where the copies take 1% of a step or more (rule.MIN_GAIN), else passed as slight.
        from tuneup.report.document import build
        from tuneup.report.sources import load

        histories, source = load(str(tmp_path / "run"))
        document = build(histories, source=source)
        habits = document["runs"][0]["snapshot"]["habits"]
        assert habits["numpy_copies_per_step"] == 1.0 and habits["clip_grad_calls_per_step"] == 1.0
        run = document["runs"][0]
        totals = run["snapshot"]["totals"]
        share = habits["numpy_copy_seconds_per_step"] / (totals["seconds"] / totals["steps"])
        found = any(f["rule"] == "numpy-copies" for f in document["findings"])
        assert found == (share >= 0.01) and found != ("numpy-copies" in run["evaluation"]["slight"]), share
