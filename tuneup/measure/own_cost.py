"""tuneup's own cost off the training thread: the CPU and wall time its background thread
(and a snapshot() that samples before reading) spends on each part of a tick (draining steps, each slow probe, the configuration, the rules,
the outputs, apply mode), so that a user can see what the agent costs the machine, and a
benchmark can say where it goes (on an H100, tuneup added 375 µs of process CPU to each 4.4 ms
step, threads included: this tells NVML's sampling from the rest).

CPU time is the thread's own (time.thread_time), so a part that waits (on NVML, on a lock)
counts its wall time, not its CPU time."""

from __future__ import annotations

from contextlib import contextmanager
from time import perf_counter, thread_time
from typing import Any, Iterator


class OwnCost:
    def __init__(self) -> None:
        self.started = perf_counter()
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as part `name` (parts never nest: each is counted once)."""
        cpu, wall = thread_time(), perf_counter()
        try:
            yield
        finally:
            self.cpu[name] = self.cpu.get(name, 0.0) + thread_time() - cpu
            self.wall[name] = self.wall.get(name, 0.0) + perf_counter() - wall
            self.calls[name] = self.calls.get(name, 0) + 1

    def summary(self) -> dict[str, Any]:
        """{"seconds": since attach, "cpu_seconds", "cpu_share": of one core, "parts": {name:
        {"calls", "cpu_seconds", "wall_seconds"}}}, the parts by CPU time, most first."""
        seconds = perf_counter() - self.started
        total = sum(self.cpu.values())
        ranked = sorted(self.cpu, key=lambda name: -self.cpu[name])
        return {
            "seconds": seconds,
            "cpu_seconds": total,
            "cpu_share": total / seconds if seconds > 0 else None,
            "parts": {name: {"calls": self.calls[name], "cpu_seconds": self.cpu[name], "wall_seconds": self.wall[name]}
                      for name in ranked},
        }
