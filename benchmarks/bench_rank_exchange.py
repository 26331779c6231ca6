"""The cross-rank exchange at fleet size, simulated against a real TCPStore on loopback.

    python benchmarks/bench_rank_exchange.py [--worlds 8 64 512 4096] [--rounds 3]

For each world size N (nodes of 8 ranks, as torchrun places them), N simulated ranks publish
realistic summaries (measure/ranks.py `compact` of a window) into one TCPStore server, and rank 0
gathers them, two ways in the same run:

- two levels (what tuneup does): every rank `set`s its summary under its node; each node's
  leader (a real RankExchange, with its own connection and thread) reads its node and publishes
  one node summary; rank 0 (a real RankExchange) reads the node summaries;
- flat (what tuneup did before): every rank `set`s its summary; rank 0 reads each rank's key
  (`check` + `get`), at most 1,024 of them.

Printed per N and scheme (medians over --rounds): rank 0's time for one exchange, its store
operations and the bytes it read (in all, and per rank: two levels' against NODE_ROW_BUDGET),
the memory its view of the ranks holds (tracemalloc), the rules' time over that view, and
whether the injected straggler (one rank, in the last node but one) and the injected slow
node (every rank of node 1) were named correctly. Ranks other than
rank 0 and the leaders publish through a pool of connections (a `set` is all they do).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tuneup.diagnose import evaluate  # noqa: E402
from tuneup.measure.ranks import NODE_ROW_BUDGET, RANK_KEY, RankExchange, compact  # noqa: E402

PER_NODE = 8
FLAT_KEY = "tuneup/rank/{rank}"
FLAT_MAX_PEERS = 1024
TIMEOUT = datetime.timedelta(seconds=60)


def summary(rank: int, world: int, straggler: int | None, slow_node: int | None) -> dict:
    node = rank // PER_NODE
    step = 0.100
    if rank == straggler:
        step = 0.130
    if node == slow_node:
        step = 0.125
    snapshot = {
        "run": {"rank": rank, "local_rank": rank % PER_NODE, "run_id": "fleet-job", "host": f"gpu-node-{node:04d}",
                "pid": 4000 + rank % PER_NODE, "world_size": world},
        "window": {"steps": 1000, "step_seconds": {"median": step, "mean": step, "p90": step * 1.04, "min": step * 0.97,
                                                    "max": step * 1.2},
                   "backward_seconds": {"median": 0.040, "mean": 0.041, "p90": 0.044, "min": 0.039, "max": 0.05},
                   "data_wait_seconds": {"median": 0.002, "mean": 0.002, "p90": 0.003, "min": 0.0, "max": 0.01},
                   "stall_ratio": 0.02, "steps_per_second": 1 / step, "samples_per_second": 64 / step},
        # DDP's all-reduce wait and the threads' wait for a CPU, at full float precision.
        "system": {"ddp": {"allreduce_wait_seconds": 0.0123456789, "steady": True},
                   "host": {"step_cpu_wait_seconds": 0.000812345678}},
    }
    findings = [{"rule": "host-syncs", "severity": "medium", "gain": 0.04}]
    return compact(snapshot, findings, final=False)


def environ(rank: int, world: int) -> dict:
    return {"LOCAL_RANK": str(rank % PER_NODE), "LOCAL_WORLD_SIZE": str(PER_NODE),
            "GROUP_RANK": str(rank // PER_NODE), "GROUP_WORLD_SIZE": str(world // PER_NODE)}


def named(view: list[dict], own: dict, straggler: int | None, slow_node: int | None) -> tuple[str, float]:
    began = time.perf_counter()
    found = {f.rule: f for f in evaluate(own, ranks=view).findings}
    seconds = time.perf_counter() - began
    if straggler is not None:
        finding = found.get("rank-straggler")
        ok = finding is not None and finding.evidence["rank"] == straggler
        return ("yes" if ok else "NO"), seconds
    finding = found.get("node-straggler")
    ok = finding is not None and finding.evidence["node"] == slow_node
    return ("yes" if ok else "NO"), seconds


def two_levels(port: int, world: int, straggler: int | None, slow_node: int | None, pool) -> dict:
    clients = [TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT) for _ in range(8)]
    leaders = {rank: RankExchange(lambda *a: None, store=TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT),
                                  rank=rank, world_size=world, environ=environ(rank, world))
               for rank in range(0, world, PER_NODE)}
    try:
        payloads = {rank: summary(rank, world, straggler, slow_node) for rank in range(world)}
        others = [rank for rank in range(world) if rank not in leaders]

        def publish(rank: int) -> None:
            client = clients[rank % len(clients)]
            client.set(RANK_KEY.format(node=rank // PER_NODE, local=rank % PER_NODE),
                       json.dumps(payloads[rank], separators=(",", ":")).encode())

        list(pool.map(publish, others))
        # The leaders (not rank 0) gather their nodes and publish, in parallel as on a cluster.
        list(pool.map(lambda rank: leaders[rank].exchange(payloads[rank], wait=120), [r for r in leaders if r]))
        rank0 = leaders[0]
        ops, read = rank0.operations, rank0.bytes_read
        tracemalloc.start()
        began = time.perf_counter()
        rank0.exchange(payloads[0], wait=120)
        view = rank0.peer_snapshots()
        elapsed = time.perf_counter() - began
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        verdict, rules = named(view, payloads[0], straggler, slow_node)
        return {"seconds": elapsed, "operations": rank0.operations - ops, "bytes": rank0.bytes_read - read,
                "memory": memory, "rules": rules, "named": verdict, "heard": len(view)}
    finally:
        for exchange in leaders.values():
            exchange.close()


def flat(port: int, world: int, straggler: int | None, slow_node: int | None, pool) -> dict:
    clients = [TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT) for _ in range(8)]
    payloads = {rank: summary(rank, world, straggler, slow_node) for rank in range(world)}

    def publish(rank: int) -> None:
        clients[rank % len(clients)].set(FLAT_KEY.format(rank=rank), json.dumps(payloads[rank]).encode())

    list(pool.map(publish, range(1, world)))
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    tracemalloc.start()
    began = time.perf_counter()
    peers, operations, read = {}, 0, 0
    for rank in range(1, min(world, FLAT_MAX_PEERS)):  # the old exchange's reads
        key = FLAT_KEY.format(rank=rank)
        operations += 2
        if store.check([key]):
            raw = store.get(key)
            read += len(raw)
            peers[rank] = json.loads(raw)
    view = [payloads[0]] + [peers[rank] for rank in sorted(peers)]
    elapsed = time.perf_counter() - began
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    verdict, rules = named(view[1:], payloads[0], straggler, slow_node)
    return {"seconds": elapsed, "operations": operations, "bytes": read, "memory": memory, "rules": rules,
            "named": verdict, "heard": len(view)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.rounds} rounds per cell, medians; nodes of {PER_NODE} ranks; one TCPStore server on loopback")
    print(f"  {'ranks':>6} {'scheme':<11} {'rank-0 exchange':>16} {'store ops':>10} {'KB read':>9} "
          f"{'rank-0 MB':>10} {'rules':>9} {'heard':>6} {'straggler':>10} {'slow node':>10} {'B/rank':>7}"
          f"  (two levels: the node summaries' rows, under NODE_ROW_BUDGET={NODE_ROW_BUDGET} B a rank)")
    with ThreadPoolExecutor(16) as pool:
        for world in args.worlds:
            for name, scheme in (("two levels", two_levels), ("flat (old)", flat)):
                cells = []
                for _ in range(args.rounds):
                    straggler = world - PER_NODE - 3 if world > PER_NODE else world - 3  # the last node but one's
                    slow_node = 1 if world >= 3 * PER_NODE else None
                    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
                    rank_case = scheme(server.port, world, straggler, None, pool)
                    node_case = (scheme(server.port, world, None, slow_node, pool) if slow_node is not None
                                 else {"named": "n/a"})
                    del server
                    cells.append((rank_case, node_case))
                rank_cases = [cell[0] for cell in cells]

                def med(key: str) -> float:
                    return statistics.median(case[key] for case in rank_cases)

                verdicts = {cell[0]["named"] for cell in cells}
                nodes = {cell[1]["named"] for cell in cells}
                if name == "flat (old)":
                    nodes = {"no rule"}
                print(f"  {world:>6} {name:<11} {med('seconds') * 1e3:>13.1f} ms {med('operations'):>10,.0f} "
                      f"{med('bytes') / 1024:>9,.1f} {med('memory') / 2**20:>10.2f} {med('rules') * 1e3:>6.1f} ms "
                      f"{med('heard'):>6,.0f} {'/'.join(sorted(verdicts)):>10} {'/'.join(sorted(nodes)):>10} "
                      f"{med('bytes') / world:>7,.0f}")


if __name__ == "__main__":
    main()
