"""The other ranks of a distributed job, without collectives.

Each rank's agent publishes a compact summary of its rolling window into the process group's
key-value store (the TCPStore that torchrun or init_process_group set up: plain TCP to one
server, never a gloo/NCCL collective, never on the training thread), every few seconds and
once more at the end; rank 0 reads the others' from there. That is what the cross-rank rules
(rank-straggler) read live on rank 0, and what rank 0's end-of-run summary across ranks shows.

Every store operation runs on this module's own daemon thread: a store that hangs (its
server gone) can delay neither the training loop nor the agent's sampler, and detach waits
for it at most a few seconds.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any, Callable

KEY = "tuneup/rank/{rank}"
MAX_PEERS = 1024  # rank 0 reads at most this many ranks' summaries


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
    return {
        "run": {key: run.get(key) for key in ("rank", "local_rank", "run_id", "host", "pid", "world_size")},
        "window": {key: window.get(key) for key in keep},
        "findings": [{"rule": f["rule"], "severity": f["severity"], "gain": f.get("gain")} for f in findings],
        "time": time.time(),
        "final": final,
    }


class RankExchange:
    def __init__(self, warn: Callable[[str, str], None]) -> None:
        self.warn = warn
        self.store: Any = None
        self.rank: int | None = None
        self.world_size = 0
        self.peers: dict[int, dict[str, Any]] = {}  # rank -> its latest summary (rank 0 only)
        self.last_read: float | None = None
        self._work: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.on = True

    @property
    def active(self) -> bool:
        return self.on and self.store is not None

    def connect(self) -> bool:
        """Find the process group's store once the job has one (checked on every tick)."""
        if self.store is None and self.on:
            found = default_store()
            if found is not None:
                self.store, self.rank, self.world_size = found
                self._thread = threading.Thread(target=self._serve, name="tuneup-ranks", daemon=True)
                self._thread.start()
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

    def publish(self, summary: dict[str, Any], wait: float | None = None) -> bool:
        payload = json.dumps(summary, default=str).encode()
        return self._run(lambda: self.store.set(KEY.format(rank=self.rank), payload), wait)

    def gather(self, wait: float | None = None, final_within: float = 0.0) -> bool:
        """Rank 0: read every other rank's latest summary (those published so far); with
        `final_within`, keep reading up to that long for every rank's final one."""
        if self.rank != 0:
            return False

        def read() -> None:
            deadline = time.monotonic() + final_within
            while True:
                for rank in range(1, min(self.world_size, MAX_PEERS)):
                    key = KEY.format(rank=rank)
                    if self.store.check([key]):  # never blocks: get() would wait for the key
                        self.peers[rank] = json.loads(self.store.get(key))
                self.last_read = time.time()
                ranks = range(1, min(self.world_size, MAX_PEERS))
                if all(self.peers.get(r, {}).get("final") for r in ranks) or time.monotonic() >= deadline:
                    return
                time.sleep(0.2)

        return self._run(read, wait)

    def peer_snapshots(self) -> list[dict[str, Any]]:
        """The other ranks' summaries in the shape the rules read (run, window)."""
        return [dict(summary) for _, summary in sorted(self.peers.items())]

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
