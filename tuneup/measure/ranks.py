"""The other ranks of a distributed job, without collectives, in two levels: ranks, then nodes.

Each rank's agent publishes a compact summary of its rolling window into the process group's
key-value store (the TCPStore that torchrun or init_process_group set up: plain TCP to one
server, never a gloo/NCCL collective, never on the training thread), every few seconds and
once more at the end, under its node's prefix. Each node's local rank 0 reads its node's ranks
and publishes one node summary (every rank's figures in a few columns); global rank 0 reads the
node summaries only. That is what the cross-rank rules (rank-straggler, node-straggler) read
live on rank 0, and what rank 0's end-of-run summary across ranks shows.

Cost, per exchange (every FINDINGS_EVERY_TICKS ticks, ~5 s): every rank one `set` of its
summary (under 1 KB); a node leader reads its node's ranks and makes one `set`; rank 0 reads
the node summaries. Once every key exists a read of many keys is two store operations (`check`
of the list, then `multi_get`: one round trip); until then one `check` + `get` per key present.
So rank 0's store work grows with the number of nodes, not ranks, and the bytes it reads are
the node summaries: under NODE_ROW_BUDGET bytes per rank (benchmarks/bench_rank_exchange.py
measures ~135 with the all-reduce and CPU waits). No cap on the world size.

Nodes come from torchrun's environment (GROUP_RANK: the node's number, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE: the number of nodes). Without it (mp.spawn, a plain
init_process_group) the job is taken as one node when it has at most FLAT_RANKS ranks, else as
groups of ASSUMED_NODE_RANKS consecutive ranks, and says so (`topology["assumed"]`): a slow
"node" is then not reported, as it is no machine.

Every store operation runs on this module's own daemon thread: a store that hangs (its
server gone) can delay neither the training loop nor the agent's sampler, and detach waits
for it at most a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

RANK_KEY = "tuneup/node/{node}/rank/{local}"
NODE_KEY = "tuneup/node/{node}"
FLAT_RANKS = 64  # without torchrun's topology, up to this many ranks are taken as one node
ASSUMED_NODE_RANKS = 8
FLEET_WAIT_FACTOR = 1.5  # rank 0 waits this many times a leader's wait for the final node summaries
NODE_ROW_BUDGET = 160  # bytes per rank in a node summary (the budget the benchmark checks)
# A rank's row in a node summary, in this order (compact: columns, not keys per rank).
ROW = ("rank", "local_rank", "pid", "steps", "step", "backward", "data_wait", "stall", "rate", "samples_rate",
       "time", "final", "findings", "allreduce_wait", "cpu_wait")


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    node: int
    local_rank: int
    local_world_size: int
    nodes: int
    assumed: bool  # no launcher said which ranks share a machine

    @classmethod
    def of(cls, rank: int, world_size: int, environ: Mapping[str, str] = os.environ) -> "Topology":
        def number(name: str) -> int | None:
            try:
                return int(environ[name])
            except (KeyError, ValueError):
                return None

        local, local_world, node, nodes = (number(name) for name in
                                           ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"))
        if None not in (local, local_world, node) and local_world > 0:
            nodes = nodes if nodes and nodes > 0 else math.ceil(world_size / local_world)
            return cls(rank, world_size, node, local, local_world, nodes, False)
        size = world_size if world_size <= FLAT_RANKS else ASSUMED_NODE_RANKS
        return cls(rank, world_size, rank // size, rank % size, size, math.ceil(world_size / size), True)

    @property
    def leader(self) -> bool:
        return self.local_rank == 0


def default_store() -> tuple[Any, int, int] | None:
    """(store, rank, world size) of the default process group, or None outside one."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    except Exception:
        return None


def compact(snapshot: dict[str, Any], findings: list[dict[str, Any]], final: bool) -> dict[str, Any]:
    """What another rank needs of this one's: its identity, its window's figures, its findings."""
    run = snapshot.get("run") or {}
    window = snapshot.get("window") or {}
    keep = ("steps", "step_seconds", "backward_seconds", "data_wait_seconds", "stall_ratio", "steps_per_second",
            "samples_per_second")
    ddp = (snapshot.get("system") or {}).get("ddp") or {}
    host = (snapshot.get("system") or {}).get("host") or {}
    return {
        "run": {key: run.get(key) for key in ("rank", "local_rank", "run_id", "host", "pid", "world_size")},
        "window": {key: window.get(key) for key in keep},
        # Past DDP's start-up only (ddp.py `steady`): before it, the ranks' first meetings.
        "ddp": {"allreduce_wait_seconds": ddp.get("allreduce_wait_seconds") if ddp.get("steady", True) else None},
        # Its threads' wait for a CPU per step (host.py): a starved rank's is long.
        "host": {"step_cpu_wait_seconds": host.get("step_cpu_wait_seconds")},
        "findings": [{"rule": f["rule"], "severity": f["severity"], "gain": f.get("gain")} for f in findings],
        "time": time.time(),
        "final": final,
    }


def _median(distribution: Any) -> float | None:
    return distribution.get("median") if isinstance(distribution, dict) else None


def node_summary(node: int, summaries: list[dict[str, Any]], expected: int, assumed: bool = False) -> dict[str, Any]:
    """One node's ranks (their compact summaries) as a node summary: a row per rank (ROW).
    `assumed`: the node is a group of ranks, not known to be a machine (see Topology)."""
    rows = []
    hosts = set()
    for summary in summaries:
        run, window = summary.get("run") or {}, summary.get("window") or {}
        hosts.add(run.get("host"))
        rows.append([run.get("rank"), run.get("local_rank"), run.get("pid"), window.get("steps"),
                     _median(window.get("step_seconds")), _median(window.get("backward_seconds")),
                     _median(window.get("data_wait_seconds")), window.get("stall_ratio"),
                     window.get("steps_per_second"), window.get("samples_per_second"),
                     round(summary.get("time") or 0.0, 1), bool(summary.get("final")),
                     [f["rule"] for f in summary.get("findings") or []],
                     (summary.get("ddp") or {}).get("allreduce_wait_seconds"),
                     (summary.get("host") or {}).get("step_cpu_wait_seconds")])
    return {"node": node, "assumed": assumed, "hosts": sorted(str(h) for h in hosts if h), "expected": expected,
            "rows": rows,
            "run_id": next((s["run"].get("run_id") for s in summaries if (s.get("run") or {}).get("run_id")), None),
            "time": time.time(), "final": len(rows) >= expected and all(row[11] for row in rows)}


def expand(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A node summary's rows as per-rank summaries (the shape the rules and the rank table read)."""
    host = summary["hosts"][0] if len(summary.get("hosts") or ()) == 1 else None
    out = []
    for row in summary.get("rows") or []:
        values = dict.fromkeys(ROW)
        values.update(zip(ROW, row))
        out.append({
            # A group of ranks no launcher placed is no machine: the rules then go by host.
            "run": {"rank": values["rank"], "local_rank": values["local_rank"],
                    "node": None if summary.get("assumed") else summary["node"],
                    "host": host, "pid": values["pid"], "run_id": summary.get("run_id")},
            "window": {"steps": values["steps"],
                       "step_seconds": {"median": values["step"]} if values["step"] is not None else None,
                       "backward_seconds": {"median": values["backward"]} if values["backward"] is not None else None,
                       "data_wait_seconds": {"median": values["data_wait"]} if values["data_wait"] is not None else None,
                       "stall_ratio": values["stall"], "steps_per_second": values["rate"],
                       "samples_per_second": values["samples_rate"]},
            "findings": [{"rule": rule} for rule in values["findings"] or ()],
            "ddp": {"allreduce_wait_seconds": values["allreduce_wait"]},
            "host": {"step_cpu_wait_seconds": values["cpu_wait"]},
            "time": values["time"],
            "final": values["final"],
        })
    return out


class RankExchange:
    def __init__(self, warn: Callable[[str, str], None], store: Any = None, rank: int | None = None,
                 world_size: int = 0, environ: Mapping[str, str] = os.environ) -> None:
        """`store`/`rank`/`world_size`: given (a simulation, a test), or found in the job's
        default process group by connect()."""
        self.warn = warn
        self.environ = environ
        self.store: Any = None
        self.rank: int | None = None
        self.world_size = 0
        self.topology: Topology | None = None
        self.own: dict[str, Any] | None = None  # this rank's latest summary
        self.local: dict[int, dict[str, Any]] = {}  # node leader: its node's ranks' summaries, by local rank
        self.nodes: dict[int, dict[str, Any]] = {}  # rank 0: node summaries, by node
        self.last_read: float | None = None
        self.operations = 0  # store calls made (the benchmark's figure)
        self.bytes_read = 0
        self._work: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.on = True
        if store is not None:
            self._use(store, rank or 0, world_size)

    def _use(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.topology = Topology.of(rank, world_size, self.environ)
        self._thread = threading.Thread(target=self._serve, name="tuneup-ranks", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self.on and self.store is not None

    def connect(self) -> bool:
        """Find the process group's store once the job has one (checked on every tick)."""
        if self.store is None and self.on:
            found = default_store()
            if found is not None:
                self._use(*found)
        return self.active

    def group_alive(self) -> bool:
        try:
            import torch.distributed as dist

            return self.active and dist.is_initialized()
        except Exception:
            return False

    def _serve(self) -> None:
        while True:
            job, done = self._work.get()
            if job is None:
                return
            try:
                job()
            except Exception as exc:
                self.warn("ranks", f"cross-rank summaries stopped: the process group's store failed "
                                   f"({type(exc).__name__}: {exc}); each rank still measures itself")
                self.on = False
            finally:
                done.set()

    def _run(self, job: Callable[[], None], wait: float | None) -> bool:
        """Queue a store operation; with `wait`, block at most that long for it."""
        if not self.active:
            return False
        done = threading.Event()
        self._work.put((job, done))
        return done.wait(wait) if wait is not None else True

    # --- the store, counted ----------------------------------------------------------

    def _set(self, key: str, value: dict[str, Any]) -> None:
        self.operations += 1
        self.store.set(key, json.dumps(value, default=str, separators=(",", ":")).encode())

    def _get(self, key: str) -> dict[str, Any] | None:
        self.operations += 2
        if not self.store.check([key]):  # never blocks: get() would wait for the key
            return None
        raw = self.store.get(key)
        self.bytes_read += len(raw)
        return json.loads(raw)

    def _get_many(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The keys that exist, read. When all do (the usual case once every rank has
        published), two store operations in all: check() of the list, then multi_get()
        (torch >= 2.5: a single round trip); else one key at a time, skipping the missing ones
        (multi_get, like get, would wait for them)."""
        if not keys:
            return {}
        multi_get = getattr(self.store, "multi_get", None)
        if multi_get is not None:
            self.operations += 1
            if self.store.check(keys):
                self.operations += 1
                raws = multi_get(keys)
                self.bytes_read += sum(len(raw) for raw in raws)
                return {key: json.loads(raw) for key, raw in zip(keys, raws)}
        found = {}
        for key in keys:
            value = self._get(key)
            if value is not None:
                found[key] = value
        return found

    # --- one exchange ----------------------------------------------------------------

    def exchange(self, summary: dict[str, Any], wait: float | None = None, final_within: float = 0.0) -> bool:
        """Publish this rank's summary; a node leader then gathers its node and publishes the
        node's summary; rank 0 then reads every node's. With `final_within` (the end of the
        run), leaders and rank 0 keep reading up to that long for every final summary."""
        topology = self.topology
        if topology is None:
            return False
        self.own = summary

        def run() -> None:
            self._set(RANK_KEY.format(node=topology.node, local=topology.local_rank), summary)
            if not topology.leader:
                return
            began = time.monotonic()
            deadline = began + final_within  # a leader's wait for its ranks' final summaries
            while True:
                self._gather_node()
                if self._node_done() or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
            mine = node_summary(topology.node, [self.local[i] for i in sorted(self.local)], topology.local_world_size,
                                topology.assumed)
            if topology.rank == 0:
                self.nodes[topology.node] = mine
            else:
                self._set(NODE_KEY.format(node=topology.node), mine)
                return
            deadline = began + FLEET_WAIT_FACTOR * final_within  # the leaders' waits come first
            while True:
                self._gather_nodes()
                if all((self.nodes.get(n) or {}).get("final") for n in range(topology.nodes)) \
                        or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
            self.last_read = time.time()

        return self._run(run, wait)

    def _gather_node(self) -> None:
        topology = self.topology
        self.local[topology.local_rank] = self.own
        wanted = {RANK_KEY.format(node=topology.node, local=local): local for local in range(topology.local_world_size)
                  if local != topology.local_rank and not (self.local.get(local) or {}).get("final")}
        for key, value in self._get_many(list(wanted)).items():
            self.local[wanted[key]] = value

    def _node_done(self) -> bool:
        expected = self.topology.local_world_size
        return len(self.local) >= expected and all(s.get("final") for s in self.local.values())

    def _gather_nodes(self) -> None:
        wanted = {NODE_KEY.format(node=node): node for node in range(self.topology.nodes)
                  if node != self.topology.node and not (self.nodes.get(node) or {}).get("final")}
        for key, value in self._get_many(list(wanted)).items():
            self.nodes[wanted[key]] = value

    # --- what rank 0 knows --------------------------------------------------------------

    def peer_snapshots(self) -> list[dict[str, Any]]:
        """Every rank's summary heard, this one's too (its row carries its node), in the shape
        the rules read (run, window), from the node summaries (rank 0 only)."""
        return [row for node in sorted(self.nodes) for row in expand(self.nodes[node])]

    def topology_summary(self) -> dict[str, Any] | None:
        topology = self.topology
        if topology is None:
            return None
        return {"nodes": topology.nodes, "ranks_per_node": topology.local_world_size, "assumed": topology.assumed,
                "nodes_heard": len(self.nodes)}

    def close(self, wait: float = 1.0) -> None:
        """Stop the worker and let go of the store: the job's process group owns it, and a
        reference held past destroy_process_group keeps it alive into interpreter exit."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._work.put((None, threading.Event()))
            if thread is not threading.current_thread():
                thread.join(wait)
            if thread.is_alive():
                return  # still inside a store call: it keeps the store until it returns
        self.store = None
        self.on = False
