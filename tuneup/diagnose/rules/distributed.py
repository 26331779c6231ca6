"""Multi-GPU and multi-process training: DataParallel, DDP on a CPU backend with GPUs, and
straggling ranks."""

from __future__ import annotations

from statistics import median

from ...format import percent, seconds
from ..rule import Evidence, Facts, Missing, rule

DDP_NOTES = "https://docs.pytorch.org/docs/stable/notes/cuda.html#use-nn-parallel-distributeddataparallel-instead-of-multiprocessing-or-nn-dataparallel"


@rule(
    id="data-parallel",
    title="nn.DataParallel instead of DistributedDataParallel",
    severity="high",
    inputs="the model's wrapper class",
    threshold="a model wrapped in nn.DataParallel",
    why="DataParallel runs one Python thread per GPU under the GIL, re-replicates the model "
        "every step and gathers outputs on GPU 0; DDP (one process per GPU) overlaps the "
        "gradient all-reduce with backward and is faster even on one node.",
    doc=DDP_NOTES,
)
def data_parallel(facts: Facts) -> Evidence | None:
    wrapped = [m for m in facts.models if m.get("parallel") == "DataParallel"]
    if not wrapped:
        return None
    return Evidence(
        observed=f"{wrapped[0]['class']} is wrapped in nn.DataParallel",
        numbers={"parallel": "DataParallel"},
        fix="# torchrun --nproc_per_node=N train.py\n"
            "torch.distributed.init_process_group(\"nccl\")\n"
            "model = nn.parallel.DistributedDataParallel(model.to(local_rank), device_ids=[local_rank])",
        gain_text="typically faster than DataParallel on every GPU count",
    )


@rule(
    id="ddp-backend",
    title="Distributed training on GPUs without NCCL",
    severity="high",
    inputs="the process group's backend; the job's devices",
    threshold="a CUDA job whose default process group is not NCCL",
    why="gloo moves CUDA tensors through host memory for every all-reduce; NCCL uses NVLink/"
        "PCIe peer-to-peer and InfiniBand directly.",
    doc="https://docs.pytorch.org/docs/stable/distributed.html#which-backend-to-use",
)
def ddp_backend(facts: Facts) -> Evidence | None:
    dist = facts.config.get("distributed") or {}
    if not dist.get("initialized"):
        raise Missing("a process group")
    if not facts.on_cuda:
        return None
    backend = str(dist.get("backend"))
    if "nccl" in backend:
        return None
    return Evidence(
        observed=f"the process group uses {backend} while training on CUDA ({dist.get('world_size')} ranks)",
        numbers={"backend": backend, "world_size": dist.get("world_size")},
        fix='torch.distributed.init_process_group(backend="nccl")',
        gain_text="all-reduce at GPU interconnect speed instead of through host memory",
    )


STRAGGLER_FACTOR = 1.15
STRAGGLER_MIN_SECONDS = 0.001  # below a millisecond per step, ranks differ by scheduling jitter alone


def own_time(snapshot: dict) -> float | None:
    """A rank's step time minus its backward: in DDP the backward holds the all-reduce, where
    fast ranks wait for the slowest, so whole step times come out equal across ranks."""
    window = snapshot.get("window") or {}
    step = (window.get("step_seconds") or {}).get("median")
    backward = (window.get("backward_seconds") or {}).get("median")
    if step is None:
        return None
    return step - backward if backward is not None else step


@rule(
    id="rank-straggler",
    title="One rank is slower than the others",
    severity="high",
    inputs="per-rank step time (less the backward, which holds the all-reduce wait) from every rank's run log",
    threshold=f"a rank's time > {STRAGGLER_FACTOR:g}x the median across ranks, and >= "
              f"{STRAGGLER_MIN_SECONDS * 1e3:g} ms more",
    why="Every all-reduce waits for the slowest rank, so the whole job runs at its pace; 15% is "
        "well above the few percent ranks differ by on identical hardware, and a millisecond above "
        "the scheduling jitter of steps that short.",
    doc="https://docs.pytorch.org/docs/stable/notes/ddp.html",
)
def rank_straggler(facts: Facts) -> Evidence | None:
    ranks = [s for s in [facts.snapshot, *facts.ranks] if (s.get("run") or {}).get("rank") is not None]
    if len(ranks) < 2:
        raise Missing("two or more ranks")
    times = {s["run"]["rank"]: own_time(s) for s in ranks}
    times = {rank: value for rank, value in times.items() if value is not None}
    if len(times) < 2:
        raise Missing("per-rank step times")
    middle = median(times.values())
    slowest = max(times, key=times.get)
    if not middle or times[slowest] <= STRAGGLER_FACTOR * middle or times[slowest] - middle < STRAGGLER_MIN_SECONDS:
        return None
    excess = times[slowest] - middle
    slow = next(s for s in ranks if s["run"]["rank"] == slowest)
    step = (slow.get("window") or {}).get("step_seconds", {}).get("median") or times[slowest]
    return Evidence(
        observed=f"rank {slowest} spends {seconds(times[slowest])} per step outside the all-reduce, "
                 f"{percent(excess / middle)} more than the median rank ({seconds(middle)})",
        numbers={"rank": slowest, "rank_seconds": times[slowest], "median_seconds": middle,
                 "per_rank_seconds": {str(k): v for k, v in sorted(times.items())}},
        fix=f"# look at rank {slowest}'s own report: its data wait, its host (CPU load, GPU clocks),\n"
            "# and uneven work (variable-length batches: bucket by length or pad)",
        gain=min(1.0, excess / step),  # every rank's step is the slowest rank's
    )
