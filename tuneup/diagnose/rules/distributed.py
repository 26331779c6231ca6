"""Multi-GPU and multi-process training: DataParallel, DDP on a CPU backend with GPUs, and
straggling ranks."""

from __future__ import annotations

from bisect import bisect_right
from statistics import median
from typing import Any

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
CPU_STARVED_SHARE = 0.5  # a straggler whose extra wait for a CPU is this much of its excess is starved


def allreduce_wait(snapshot: dict) -> float | None:
    """A rank's wait in DDP's all-reduce per step (measure/ddp.py): where it reports it, from
    DDP's own timers (a rank summary's `ddp`, a full snapshot's system sample), past the
    start-up (`steady`; logs without the flag are taken as they are)."""
    ddp = snapshot.get("ddp") or (snapshot.get("system") or {}).get("ddp") or {}
    return ddp.get("allreduce_wait_seconds") if ddp.get("steady", True) else None


def cpu_wait(snapshot: dict) -> float | None:
    """A rank's threads' wait for a CPU per step (runnable, not running: Linux's run-queue
    wait, summed over the job's threads, not tuneup's: measure/host.py), from a rank summary's `host` or
    a full snapshot's system sample; None where not known."""
    host = snapshot.get("host") or (snapshot.get("system") or {}).get("host") or {}
    return host.get("step_cpu_wait_seconds")


def _step(summary: dict) -> float | None:
    """A rank's median step time in its window (None: not known)."""
    return ((summary.get("window") or {}).get("step_seconds") or {}).get("median")


def own_time(snapshot: dict, by_wait: bool = False) -> float | None:
    """A rank's step time outside the all-reduce wait, where fast ranks wait for the slowest
    (so whole step times come out equal across ranks). `by_wait`: less the wait DDP measured,
    which also keeps a straggler whose own backward is slow (its gradients come last); else
    less the whole backward, which holds the wait."""
    step = _step(snapshot)
    if step is None:
        return None
    if by_wait:
        wait = allreduce_wait(snapshot)
        return max(0.0, step - wait) if wait is not None else None
    backward = ((snapshot.get("window") or {}).get("backward_seconds") or {}).get("median")
    return step - backward if backward is not None else step


def own_times(summaries: dict[int, dict]) -> tuple[dict[int, float], bool]:
    """Each rank's own time, on one basis for all: less DDP's measured all-reduce wait where
    every rank has it, else less the backward. Returns (times, whether by the wait)."""
    by_wait = all(allreduce_wait(s) is not None for s in summaries.values())
    times = {rank: own_time(s, by_wait) for rank, s in summaries.items()}
    return {rank: value for rank, value in times.items() if value is not None}, by_wait


def _rank_times(facts: Facts) -> tuple[dict[int, float], dict[int, dict], bool]:
    """Each rank's own time, and its summary (the last one given for a rank wins: rank 0's row
    from the exchange names its node, its full snapshot does not), and the basis (own_times)."""
    summaries: dict[int, dict] = {}
    for s in [facts.snapshot, *facts.ranks]:
        rank = (s.get("run") or {}).get("rank")
        if rank is not None:
            summaries[rank] = s
    if len(summaries) < 2:
        raise Missing("two or more ranks")
    times, by_wait = own_times(summaries)
    if len(times) < 2:
        raise Missing("per-rank step times")
    return times, summaries, by_wait


def _too_slow(value: float, middle: float) -> bool:
    """The straggler criterion: over STRAGGLER_FACTOR x the median, and STRAGGLER_MIN_SECONDS more.
    A median of 0 (the other ranks' own time is within their measured wait) counts as any other:
    a rank with a millisecond of its own while the rest have none is the one they wait for."""
    return value > STRAGGLER_FACTOR * middle and value - middle >= STRAGGLER_MIN_SECONDS


def _where(summary: dict) -> str:
    run = summary.get("run") or {}
    parts = ([f"node {run['node']}"] if run.get("node") is not None else []) + ([str(run["host"])] if run.get("host") else [])
    return f" ({', '.join(parts)})" if parts else ""


def _node(summary: dict) -> Any:
    """A rank's node: as the exchange numbered it, else its host (run logs read after the run)."""
    run = summary.get("run") or {}
    return run["node"] if run.get("node") is not None else run.get("host")


@rule(
    id="rank-straggler",
    title="One rank is slower than the others",
    severity="high",
    inputs="per-rank step time less the all-reduce wait (DDP's own timers; where a rank has none, less the "
           "backward, which holds the wait), from every rank: the node summaries live, the run logs after; "
           "each rank's threads' wait for a CPU per step (Linux run-queue wait) to tell a starved rank's cause",
    threshold=f"a rank's time > {STRAGGLER_FACTOR:g}x the median across ranks, and >= "
              f"{STRAGGLER_MIN_SECONDS * 1e3:g} ms more",
    why="Every all-reduce waits for the slowest rank, so the whole job runs at its pace; 15% is "
        "well above the few percent ranks differ by on identical hardware, and a millisecond above "
        "the scheduling jitter of steps that short. Where the slow rank's threads wait for a CPU "
        f"for {percent(CPU_STARVED_SHARE)} or more of its excess beyond the other ranks' wait, its host is "
        "the cause (a crowded machine), not its work, and the fix says so. A longer wait for a CPU "
        "alone names no rank: on a busy host, ranks at the same pace differ by milliseconds of it.",
    doc="https://docs.pytorch.org/docs/stable/notes/ddp.html",
)
def rank_straggler(facts: Facts) -> Evidence | None:
    times, summaries, by_wait = _rank_times(facts)
    middle = median(times.values())
    slowest = max(times, key=times.get)
    return _slow_rank(slowest, times, middle, summaries, by_wait) if _too_slow(times[slowest], middle) else None


def _slow_rank(slowest: int, times: dict[int, float], middle: float, summaries: dict[int, dict],
               by_wait: bool) -> Evidence:
    """A rank over the straggler criterion in its own time; its host named as the cause where
    its threads' extra wait for a CPU is CPU_STARVED_SHARE of its excess or more."""
    excess = times[slowest] - middle
    slow = summaries[slowest]
    step = _step(slow) or times[slowest]
    slow_ranks = sorted(rank for rank, value in times.items() if _too_slow(value, middle))
    waits = {rank: allreduce_wait(summaries[rank]) for rank in times} if by_wait else {}
    others_wait = median(w for rank, w in waits.items() if rank != slowest) if waits else None
    wait_text = (f"; in DDP's all-reduce it waits {seconds(waits[slowest])} per step, the other ranks "
                 f"{seconds(others_wait)} (median): they wait for it" if waits else "")
    fix = (f"# look at rank {slowest}'s own report: its data wait, its host (CPU load, GPU clocks),\n"
           "# and uneven work (variable-length batches: bucket by length or pad)")
    cpu = _cpu_numbers(slowest, _cpu_waits(summaries), excess)
    if cpu["cpu_wait_share"] is not None and cpu["cpu_wait_share"] >= CPU_STARVED_SHARE:
        wait_text += "; " + _starved_text(cpu)
        fix = _starved_fix(slowest)
    return Evidence(
        observed=f"rank {slowest}{_where(slow)} spends {seconds(times[slowest])} per step outside the all-reduce, "
                 + (f"{percent(excess / middle)} more than the median rank ({seconds(middle)})" if middle > 0
                    else "while the median rank spends none: its wait in the all-reduce takes its whole step")
                 + (f"; {len(slow_ranks)} ranks are that slow" if len(slow_ranks) > 1 else "") + wait_text,
        numbers={"rank": slowest, "node": (slow.get("run") or {}).get("node"), "rank_seconds": times[slowest],
                 "median_seconds": middle, "basis": "allreduce_wait" if by_wait else "backward",
                 "allreduce_wait_seconds": waits.get(slowest),
                 "others_allreduce_wait_seconds": others_wait, **cpu,
                 "slow_ranks": slow_ranks[:64], "ranks_compared": len(times),
                 # Every rank's figure where there are few; at fleet size the slow ones only.
                 "per_rank_seconds": {str(k): v for k, v in sorted(times.items())
                                      if len(times) <= 64 or k in slow_ranks[:64]}},
        fix=fix,
        gain=min(1.0, excess / step),  # every rank's step is the slowest rank's
    )


def _cpu_waits(summaries: dict[int, dict]) -> dict[int, float] | None:
    """Every rank's threads' wait for a CPU per step (cpu_wait); None where a rank's is not known
    (no schedstat: another OS) or under two ranks."""
    waits = {rank: cpu_wait(summary) for rank, summary in summaries.items()}
    if len(waits) < 2 or any(wait is None for wait in waits.values()):
        return None
    return waits


def _cpu_numbers(rank: int, cpu_waits: dict[int, float] | None, excess: float) -> dict[str, Any]:
    """The evidence's CPU-wait figures for `rank`: its wait, the other ranks' (median), and its
    extra wait as a share of `excess` (its time beyond the median rank's, > 0); None where unknown."""
    if cpu_waits is None:
        return {"cpu_wait_seconds": None, "others_cpu_wait_seconds": None, "cpu_wait_share": None}
    others = median(w for r, w in cpu_waits.items() if r != rank)
    share = max(0.0, (cpu_waits[rank] - others) / excess)
    return {"cpu_wait_seconds": cpu_waits[rank], "others_cpu_wait_seconds": others, "cpu_wait_share": share}


def _starved_text(cpu: dict[str, Any]) -> str:
    return (f"its threads wait {seconds(cpu['cpu_wait_seconds'])} per step for a CPU (runnable, not running), "
            f"the other ranks {seconds(cpu['others_cpu_wait_seconds'])} (median): its host gives it less CPU "
            "than its work needs")


def _starved_fix(rank: int) -> str:
    return (f"# rank {rank}'s threads wait for a core: its host's CPUs are shared with other work.\n"
            "# Free them (other processes; DataLoader workers and torch threads beyond its cores: its\n"
            "# report's cpu-oversubscribed), or give each rank cores of its own (numactl --physcpubind,\n"
            "# taskset, a cpuset)")


def _median_without(values: list[float], removed: list[float]) -> float:
    """The median of sorted `values` less the sorted `removed` (a sub-multiset of them), in
    O(log) steps per order statistic: the rule runs over thousands of ranks on rank 0."""
    count = len(values) - len(removed)

    def order(k: int) -> float:  # the k-th smallest (0-based) of values less removed
        low, high = 0, len(values) - 1
        while low < high:  # the first index whose value has > k others at or below it
            middle = (low + high) // 2
            if bisect_right(values, values[middle]) - bisect_right(removed, values[middle]) > k:
                high = middle
            else:
                low = middle + 1
        return values[low]

    return (order((count - 1) // 2) + order(count // 2)) / 2


@rule(
    id="node-straggler",
    title="One machine's ranks are all slower than the others",
    severity="high",
    inputs="per-rank own time (step less the all-reduce wait, as rank-straggler) with each rank's node, from the "
           "node summaries",
    threshold=f"every rank of a node > {STRAGGLER_FACTOR:g}x the median rank of the other nodes, and >= "
              f"{STRAGGLER_MIN_SECONDS * 1e3:g} ms more; nodes as the launcher (torchrun) placed the ranks",
    why="When all of a machine's ranks are slow alike, the cause is the machine (a throttled or hot "
        "chassis, a slow NIC or PCIe link, a noisy neighbour, a different GPU model), not the work "
        "the ranks were given: fix or replace that node, or leave it out.",
    doc="https://docs.pytorch.org/docs/stable/elastic/run.html",
)
def node_straggler(facts: Facts) -> Evidence | None:
    times, summaries, _ = _rank_times(facts)
    nodes: dict[Any, list[int]] = {}
    for rank in times:
        node = _node(summaries[rank])
        if node is not None:
            nodes.setdefault(node, []).append(rank)
    if len(nodes) < 2:
        raise Missing("ranks on two or more nodes")
    slow: list[tuple[float, Any, float]] = []  # (excess, node, the other nodes' median)
    everyone = sorted(times[r] for rs in nodes.values() for r in rs)
    for node, ranks in nodes.items():
        middle = _median_without(everyone, sorted(times[r] for r in ranks))
        fastest = min(times[r] for r in ranks)
        if _too_slow(fastest, middle):
            slow.append((fastest - middle, node, middle))
    if not slow or len(slow) * 2 > len(nodes):
        return None  # none, or half the nodes or more: no one machine stands out
    excess, node, middle = max(slow, key=lambda entry: entry[0])
    ranks = sorted(nodes[node])
    host = (summaries[ranks[0]].get("run") or {}).get("host")
    node_median = median(times[r] for r in ranks)
    step = max(_step(summaries[r]) or 0 for r in ranks)
    return Evidence(
        observed=f"every rank of node {node}{f' ({host})' if host and host != node else ''} is slow: its {len(ranks)} ranks spend "
                 f"{seconds(node_median)} per step outside the all-reduce (the fastest {seconds(middle + excess)}), "
                 f"against {seconds(middle)} for the median rank of the other nodes",
        numbers={"node": node, "host": host, "ranks": ranks[:64], "node_median_seconds": node_median,
                 "others_median_seconds": middle, "slow_nodes": [n for _, n, _ in sorted(slow, key=lambda entry: -entry[0])]},
        fix=f"# node {node}: compare its GPUs' clocks and throttle reasons, temperatures and PCIe/NIC\n"
            "# throughput with another node's (tuneup report of one of its ranks); drain or replace it",
        gain=min(1.0, excess / step) if step else None,
    )
