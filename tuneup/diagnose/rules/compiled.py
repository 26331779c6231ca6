"""torch.compile: graphs that recompile again and again, graph breaks in the job's code, and
an eager CUDA model whose steps go to launching kernels rather than running them."""

from __future__ import annotations

from ...format import percent, read_rate
from ...measure.history import nvml_utilization
from ..rule import Evidence, Facts, Missing, rule

RECOMPILES_PER_SITE = 2  # dynamo's automatic dynamic shapes recompile once by design
GPU_BUSY_BELOW = 0.60  # of the step: below this, with no data wait or syncs, the host is what is slow
LOW_STALL = 0.10
FEW_SYNCS = 1.0  # per step (the host-syncs rule's threshold): more, and they are the GPU's idle time


def launch_bound_share(facts: Facts) -> float | None:
    """The share of an eager CUDA job's step in which its GPU has no work although no data wait
    and no host-device sync explains it: the host launching kernels one by one (Python, dispatch,
    launch latency). None where that does not hold. From the job's own CUDA-event GPU time per
    step (measure/gpu_time.py), not NVML's device-wide utilization."""
    if not facts.on_cuda:
        raise Missing("a CUDA job")
    compiled = facts.snapshot.get("compile") or {}
    if compiled.get("compiles") or any(m.get("class") == "OptimizedModule"
                                       for m in (facts.snapshot.get("config") or {}).get("models") or []):
        return None  # already compiled
    window = facts.window
    gpu = facts.need((window.get("gpu_seconds") or {}).get("median"), "GPU time per step (CUDA events)")
    step = facts.need((window.get("step_seconds") or {}).get("median"), "step times")
    stall = window.get("stall_ratio") or 0.0
    syncs = facts.snapshot.get("syncs") or {}
    if not step or stall >= LOW_STALL or (syncs.get("per_step") or 0.0) >= FEW_SYNCS:
        return None
    busy = gpu_busy_share(facts, gpu, step)
    return 1 - busy if busy < GPU_BUSY_BELOW else None


def gpu_busy_share(facts: Facts, gpu: float, step: float) -> float:
    """The share of a step the GPU works: the CUDA events' span (`gpu` of `step`), bounded by
    NVML's utilization where sampled. The span runs from the step's first kernel to its last,
    gaps included: where the GPU waits for each launch (or for the host after a sync), the span
    is the host's time, not the GPU's work (on an H100, a launch-bound transformer's span was 96%
    of its step while NVML saw kernels running 32% of the time). NVML's utilization, the share
    of time a kernel ran, is the bound the span cannot give."""
    busy = gpu / step
    utilization = nvml_utilization(facts.snapshot)  # None without NVML samples: the span alone
    return min(busy, utilization) if utilization is not None else busy


def compile_fix(facts: Facts, graphs: bool = False) -> str:
    """torch.compile for the job's model, in its framework's words where the framework compiles
    it (`graphs`: CUDA graphs too, mode "reduce-overhead", which suits small fixed shapes)."""
    mode = ', mode="reduce-overhead"' if graphs else ""
    plain = (f"model = torch.compile(model{mode})   # before the training loop; the first steps compile"
             + ("" if graphs else '\n# small, fixed shapes: torch.compile(model, mode="reduce-overhead")   # CUDA graphs'))
    return facts.spoken(
        plain,
        # Lightning compiles nothing itself: the LightningModule is compiled before fit.
        lightning=f"model = torch.compile(model{mode})   # the LightningModule, before trainer.fit(model)",
        transformers="TrainingArguments(..., torch_compile=True"
                     + (', torch_compile_mode="reduce-overhead")' if graphs else ")   # the Trainer compiles the model"),
        accelerate=("from accelerate.utils import TorchDynamoPlugin\n"
                    'accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode="reduce-overhead"))'
                    if graphs else 'accelerator = Accelerator(dynamo_backend="inductor")   # prepare() compiles the model'))


@rule(
    id="recompiles",
    title="A compiled function keeps recompiling",
    severity="medium",
    inputs="torch.compile's recompiles per compiled function and the guard that failed "
           "(torch._dynamo.utils.guard_failures), compile time from dynamo's compile callbacks",
    threshold=f"one compiled function recompiled >= {RECOMPILES_PER_SITE} times",
    why="A graph is specialized to what its guards check (tensor sizes, Python values, module "
        "attributes); when a guard fails dynamo compiles again. Once is normal: a size that changes marks "
        "that dimension dynamic. More means something the graph depends on keeps changing, each time "
        "paying a compilation; past torch._dynamo.config.recompile_limit (8) the function runs eagerly.",
    doc="https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html",
)
def recompiles(facts: Facts) -> Evidence | None:
    compiled = facts.compiled
    sites = [site for site in compiled.get("recompile_sites") or [] if site.get("count", 0) >= RECOMPILES_PER_SITE]
    if not sites:
        return None
    site = sites[0]
    guard = str(site.get("guard", ""))
    totals = facts.totals
    spent, trained = totals.get("compile_seconds") or 0.0, totals.get("seconds") or 0.0
    compiles = max(1, compiled.get("compiles") or 1)
    # The recompilations' share of the run (compile time spread evenly over compilations).
    share = spent * min(1.0, compiled.get("recompiles", 0) / compiles) / (spent + trained) if spent + trained else 0.0
    if "size" in guard or "stride" in guard:
        fix = ("torch._dynamo.mark_dynamic(x, 0)   # before the first call: the batch dimension varies\n"
               + facts.spoken("# or: DataLoader(..., drop_last=True) so the last batch is not short;\n",
                              transformers="# or: TrainingArguments(..., dataloader_drop_last=True) so the last batch "
                                           "is not short;\n")
               + "# or: torch.compile(model, dynamic=True)")
    else:
        fix = ("# keep what the failed guard checks fixed between calls (a Python number, a flag,\n"
               "# a module attribute), or pass it as a tensor; TORCH_LOGS=recompiles shows every reason")
    return Evidence(
        observed=f"{site.get('where')} recompiled {site.get('count')} times ({compiled.get('recompiles')} recompiles "
                 f"in all), last because {guard}; compiling took {spent:.2f} s of the steps measured",
        numbers={"recompiles": compiled.get("recompiles"), "sites": sites, "compile_seconds": spent,
                 "compiles": compiled.get("compiles")},
        fix=fix,
        gain=share or None,
        gain_text=None if share else "the recompilations' time, and a function that stays compiled",
    )


@rule(
    id="graph-breaks",
    title="torch.compile breaks the graph in the job's code",
    severity="low",
    inputs="graph breaks with dynamo's reason and the job's source line (torch._dynamo.utils."
           "graph_break_reasons); the host reads counted at those lines on sampled steps",
    threshold=">= 1 graph break",
    why="At a graph break dynamo ends the graph, runs the rest of the Python eagerly and starts another "
        "graph after it: more guards to check each call, no fusion across the break, and for a host "
        "read (.item(), a data-dependent if) a wait for the device at every step.",
    doc="https://docs.pytorch.org/docs/stable/compile/programming_model.graph_breaks_index.html",
)
def graph_breaks(facts: Facts) -> Evidence | None:
    compiled = facts.compiled
    sites = compiled.get("graph_break_sites") or []
    if not compiled.get("graph_breaks") or not sites:
        return None
    named = "; ".join(f"{site.get('where')} ({site.get('reason')})" for site in sites[:3])
    reasons = " ".join(str(site.get("reason", "")) for site in sites).lower()
    if "item" in reasons:
        fix = ("x = torch.where(cond, a, b)    # decide on the device instead of `if t.item() ...`\n"
               "# or, to keep .item() inside the graph: torch._dynamo.config.capture_scalar_outputs = True")
    else:
        fix = ("# torch.compile(model, fullgraph=True) stops at each break with its reason;\n"
               "# move the unsupported call out of the compiled function or replace it with a torch op")
    reads, on_gpu = _reads_at(facts, sites[:3])
    read_text = "; ".join(f"{read['kind']} at {read['location']} ({read_rate(read)})" for read in reads)
    if reads:
        named += (f"; at the break the job reads the device: {read_text} "
                  + ("(CUDA synchronizations, counted by torch's sync debug mode: host-syncs has their cost)"
                     if on_gpu else "(measured on sampled steps; each a host-device sync on a GPU)"))
    return Evidence(
        observed=f"{compiled['graph_breaks']} graph break(s) while compiling: {named}",
        numbers={"graph_breaks": compiled["graph_breaks"], "sites": sites, "graphs": compiled.get("graphs"),
                 "reads_at_breaks": reads},
        fix=fix,
        gain_text="fewer, larger graphs: fusion across the break, fewer guard checks"
                  + (", and no host wait at the break's read" if reads else "")
                  + " (not measurable from step times alone)",
    )


def _reads_at(facts: Facts, sites: list[dict]) -> tuple[list[dict], bool]:
    """The host reads the syncs probe counted at the breaks' lines (a break's `where` is the
    file's name and line, a read's location its path and line), and whether they are CUDA's
    syncs; none where the reads were not sampled."""
    try:
        syncs = facts.syncs
    except Missing:
        return [], False
    lines = {str(site.get("where")) for site in sites}
    reads = [dict(source) for source in syncs.get("top_sources") or []
             if str(source.get("location", "")).rsplit("/", 1)[-1] in lines]
    return reads, syncs.get("backend") == "cuda"


@rule(
    id="compile-off",
    title="An eager model spends its CUDA steps launching kernels: torch.compile would fuse them",
    severity="medium",
    inputs="GPU busy time per step (CUDA events around the step's work, bounded by NVML's utilization), "
           "step time, data wait, host-device syncs per step, whether anything in the job is compiled",
    threshold=f"eager model on CUDA, GPU busy < {percent(GPU_BUSY_BELOW)} of the step with data wait < "
              f"{percent(LOW_STALL)} and < {FEW_SYNCS:g} sync per step",
    why="When neither the input pipeline nor a sync holds the GPU back, the time it sits idle is the "
        "host issuing one small kernel after another (Python, dispatch, launch latency). torch.compile "
        "fuses them into fewer, larger kernels; mode=\"reduce-overhead\" also replays them as a CUDA "
        "graph, one launch per step. It costs a compilation at the start (seconds to minutes).",
    doc="https://docs.pytorch.org/docs/stable/generated/torch.compile.html",
)
def compile_off(facts: Facts) -> Evidence | None:
    idle = launch_bound_share(facts)
    if idle is None:
        return None
    return Evidence(
        observed=f"the GPU was busy {percent(1 - idle)} of a step, with data wait and syncs too small to explain "
                 "the rest; nothing in the job is compiled",
        numbers={"gpu_busy_ratio": 1 - idle, "launch_bound_ratio": idle},
        fix=compile_fix(facts),
        gain=idle,
        gain_text=f"up to {percent(idle)} shorter steps (the GPU's idle share of a step; what fusion saves "
                  "is not known until it is tried)",
    )
