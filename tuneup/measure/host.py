"""Host probe (psutil): CPU and RSS of the training process and of its DataLoader workers,
usable cores (affinity and cgroup quota), torch threads and load; and, on Linux, the CPU
time the job's threads wanted and did not get (their run-queue wait, `RunQueue`)."""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import psutil
import torch


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by a cgroup quota (v2 cpu.max or v1 cfs), or None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def usable_cores() -> float:
    """Cores this process may really use: its CPU affinity, capped by a cgroup quota."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1.0, math.ceil(limit * 100) / 100))
    return cores


class RunQueue:
    """Seconds the threads of some processes spent runnable but waiting for a CPU, summed: the
    CPU time they wanted and did not get. Linux keeps it per thread in /proc/PID/task/TID/
    schedstat, "time spent on the cpu", "time spent waiting on a runqueue" (nanoseconds) and
    timeslices (Documentation/scheduler/sched-stats.rst; psutil does not read it). CPU use alone
    cannot tell a job that wants more cores than it has on a machine busy with other work:
    it gets its share, and its measured use falls. Its use plus its wait is what it wants.
    None where the file is missing (another OS, a kernel without schedstats)."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root
        self._seen: dict[tuple[int, str], int] = {}  # (pid, tid): wait ns at the last reading
        self.available = (root / "self" / "schedstat").exists()
        self.skipped = 0.0  # of the last call's wait, the skipped threads' (seconds)

    def waited(self, pids: Iterable[int], skip: frozenset[int] = frozenset()) -> float | None:
        """Seconds of run-queue wait of the threads of `pids` since the last call (a thread
        seen for the first time counts from the previous call's view: nothing of it); of it,
        the threads whose ids are in `skip` waited `self.skipped`."""
        self.skipped = 0.0
        if not self.available:
            return None
        seen: dict[tuple[int, str], int] = {}
        total = skipped = 0
        for pid in pids:
            try:
                tasks = os.listdir(self.root / str(pid) / "task")
            except OSError:
                continue  # gone
            for tid in tasks:
                try:
                    fields = (self.root / str(pid) / "task" / tid / "schedstat").read_text().split()
                    wait = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue
                key = (pid, tid)
                seen[key] = wait
                grown = wait - self._seen.get(key, wait)
                total += grown
                if int(tid) in skip:
                    skipped += grown
        self._seen = seen
        self.skipped = skipped / 1e9
        return total / 1e9


class ThreadRunQueue:
    """The calling thread's run-queue wait so far, in seconds: the second field of its
    /proc/self/task/TID/schedstat (see RunQueue), read through a file kept open per thread
    (a read is ~1 µs, an open ~9 µs). None where the file is missing. A forked child or
    another thread opens its own (the thread id differs); detach closes it (close())."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root
        self.available = (root / "self" / "schedstat").exists()
        self._tid: int | None = None
        self._file: Any = None

    def waited(self) -> float | None:
        if not self.available:
            return None
        tid, file = threading.get_native_id(), self._file
        try:
            if tid != self._tid or file is None:
                file = self._file = open(self.root / "self" / "task" / str(tid) / "schedstat", "rb", buffering=0)
                self._tid = tid
            return int(os.pread(file.fileno(), 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # (ValueError too: closed by close() meanwhile)
            return None

    def close(self) -> None:
        """Close the open file (detach); a later read opens another."""
        file, self._file, self._tid = self._file, None, None
        if file is not None:
            file.close()


MIN_STEPS = 20  # fewer steps than this give no per-step run-queue wait


class PerStep:
    """A running total per step over about the latest `steps` steps: the total's marks beside
    the closed-step count, back to `steps` steps ago (the rolling window's span)."""

    MARKS = 4096  # a bound on the marks held (a window of many steps closing slowly)

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._marks: deque[tuple[int, float]] = deque(maxlen=self.MARKS)  # (closed steps, total)

    def add(self, closed: int, total: float) -> float | None:
        """The total's growth per step since the mark about `steps` steps before `closed`
        (None: under MIN_STEPS steps marked)."""
        marks = self._marks
        if marks and marks[-1][0] == closed:
            marks.pop()  # no step since: the newer total stands for this step count
        marks.append((closed, total))
        while len(marks) > 1 and marks[1][0] <= closed - self.steps:
            marks.popleft()
        first_steps, first_total = marks[0]
        if closed - first_steps < min(MIN_STEPS, self.steps):
            return None
        return max(0.0, total - first_total) / (closed - first_steps)


def _children_seconds(times: Any) -> float:
    """The CPU seconds of a process's children it has waited for (Linux and macOS; 0 elsewhere)."""
    return getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)


class WorkerTime:
    """The CPU time of a job's DataLoader workers between two samples, from each one's CPU time
    (psutil cpu_times): what a live one used since the last sample, all of it for one born
    since. A worker that exited since is no longer there to ask: the kernel adds an exited
    child's whole CPU time to its parent's once the parent waits for it (the `cutime`/`cstime`
    fields of /proc/PID/stat, psutil's children_user/children_system), as the loader does in
    `_shutdown_workers` (`w.join`). That growth, less what was already counted of the workers
    seen before they went, is the time of the ones never seen: workers that are not persistent
    start again every epoch, and on epochs shorter than the sampling interval psutil's
    per-process readings (cpu_percent: 0.0 on a process's first call) saw none of their work:
    tests/programs/augment_workers.py (8-step epochs) read "2 loader workers using 0.0 cores
    and 0 B" where its own RUSAGE_CHILDREN said 0.54 cores. Counted only where worker
    iterators started (`worker_starts`) or workers were seen, as the job's other children are
    not loader workers (one waited for in such an interval is counted with them)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[psutil.Process, float]] = {}  # pid: (process, CPU seconds counted)
        self._children: float | None = None  # the parent's waited-for children's seconds at the last sample
        self._starts = 0
        self._last_wall = time.time()

    def sample(self, pids: Iterable[int], children: float, starts: int) -> tuple[list[tuple[int, float, int]], float]:
        """([(pid, CPU seconds since the last sample, RSS bytes)] of the live workers, the
        workers' CPU seconds since the last sample, all of them)."""
        now = time.time()
        since, self._last_wall = self._last_wall, now
        known, seen = self._known, {}
        workers, total = [], 0.0
        for pid in pids:
            entry = known.pop(pid, None)
            try:
                process = entry[0] if entry is not None else psutil.Process(pid)
                with process.oneshot():
                    if process.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.ZombieProcess(pid)
                    times = process.cpu_times()
                    rss = process.memory_info().rss
                    created = process.create_time() if entry is None else None
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # (ZombieProcess is a NoSuchProcess)
                if entry is not None:
                    known[pid] = entry  # gone: below
                continue
            spent = times.user + times.system
            if entry is not None:
                grown = spent - entry[1]
            elif created is not None and created >= since:
                grown = spent  # born since the last sample
            else:  # older than that and not seen before (the first sample): its share of the interval
                grown = spent * max(0.0, now - since) / max(now - created, now - since, 1e-9)
            grown = max(0.0, grown)
            seen[pid] = (process, max(spent, entry[1]) if entry is not None else spent)
            workers.append((pid, grown, rss))
            total += grown
        # The ones seen before and not listed now: still there (exiting, a zombie not yet
        # waited for), or waited for, their last counted seconds inside the parent's growth.
        waited_for = 0.0
        for pid, (process, counted) in known.items():
            try:
                spent = sum(process.cpu_times()[:2])
                total += max(0.0, spent - counted)
                seen[pid] = (process, max(spent, counted))
            except psutil.ZombieProcess:  # exited, not waited for yet: its time is not the parent's yet
                seen[pid] = (process, counted)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                waited_for += counted
        grew = 0.0 if self._children is None else children - self._children
        self._children = children
        if starts != self._starts or known or workers:
            total += max(0.0, grew - waited_for)
        self._starts = starts
        self._known = seen
        return workers, total


class HostProbe:
    """`window_steps`: the span of the per-step run-queue wait (the rolling window's)."""

    name = "host"

    def __init__(self, window_steps: int = 1000) -> None:
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only starts the interval
        self._workers = WorkerTime()
        self.cores = usable_cores()
        try:
            self._cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = list(range(psutil.cpu_count() or 1))
        psutil.cpu_percent(None, percpu=True)  # starts the machine-wide interval
        self._own_queue, self._workers_queue = RunQueue(), RunQueue()
        self._own_queue.waited([self.process.pid])
        self._job_waited = 0.0  # the job's threads' run-queue wait since this probe began (not tuneup's)
        self._closed_seen: int | None = None  # the closed-step count at the last sample
        self._per_step = PerStep(window_steps)
        self._last = time.monotonic()

    def sample(self, worker_pids: Iterable[int], closed_steps: int | None = None,
               worker_starts: int = 0) -> dict[str, Any]:
        """`closed_steps`: the steps closed so far, for the wait per step (None: not given);
        `worker_starts`: the iterators with workers started so far (the loader probe's count)."""
        with self.process.oneshot():
            cpu = self.process.cpu_percent(None)
            rss = self.process.memory_info().rss
            threads = self.process.num_threads()
            children = _children_seconds(self.process.cpu_times())
        live, workers_cpu = self._workers.sample(worker_pids, children, worker_starts)
        alive = {pid for pid, _, _ in live}
        try:
            load_1m = os.getloadavg()[0]
        except OSError:
            load_1m = None
        per_cpu = psutil.cpu_percent(None, percpu=True)
        busy = sum(per_cpu[index] for index in self._cpus if index < len(per_cpu)) / 100
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        workers = [{"pid": pid, "cpu_ratio": spent / elapsed if elapsed > 0 else 0.0, "rss_bytes": resident}
                   for pid, spent, resident in live]
        # tuneup's own threads (named tuneup-*), told apart for the job's wait per step (its
        # HTTP server's short-lived request threads keep socketserver's names: counted as the job's).
        ours = frozenset(t.native_id for t in threading.enumerate() if t.name.startswith("tuneup") and t.native_id)
        own_wait = self._own_queue.waited([self.process.pid], skip=ours)
        job_wait = own_wait - self._own_queue.skipped if own_wait is not None else None
        workers_wait = self._workers_queue.waited(alive)
        step_wait = None
        if job_wait is not None and closed_steps is not None:
            # Wait while no step closed (an evaluation, a checkpoint, after the last step: the
            # detach sample) is no step's: left out.
            if closed_steps != self._closed_seen:
                self._job_waited += job_wait
            self._closed_seen = closed_steps
            step_wait = self._per_step.add(closed_steps, self._job_waited)
        return {
            "cpu_ratio": cpu / 100,  # 1.0 = one core busy
            "busy_cores": busy,  # machine-wide, on the cores this process may use
            "rss_bytes": rss,
            "threads": threads,
            "workers": len(workers),
            # All the workers' CPU time since the last sample, the ones that started and ended
            # between two samples included (WorkerTime), over the time between them.
            "workers_cpu_ratio": workers_cpu / elapsed if elapsed > 0 else 0.0,
            # Cores' worth of CPU time wanted and not given (run-queue wait; None: not known).
            # The job's threads' (tuneup's own left out, as from the wait per step below: its
            # sampler waking on a busy machine is not the job wanting cores).
            "wait_cores": job_wait / elapsed if job_wait is not None and elapsed > 0 else None,
            "workers_wait_cores": workers_wait / elapsed if workers_wait is not None and elapsed > 0 else None,
            # The job's threads' run-queue wait per step (summed over the process's threads but
            # tuneup's own) over the rolling window's steps: a rank on a crowded host waits longer
            # than its peers, in its training thread or in its communication threads (gloo's,
            # whose starved work shows in every rank's all-reduce alike). tuneup's threads are
            # left out: rank 0's do more (the cross-rank rules), and on a busy 2-core machine
            # their waits made its sum 1 ms a step longer than its peer's.
            "step_cpu_wait_seconds": step_wait,
            "workers_rss_bytes": sum(w["rss_bytes"] for w in workers),
            "worker_processes": workers,
            "usable_cores": self.cores,
            "torch_threads": torch.get_num_threads(),
            "load_1m": load_1m,
            "memory_available_bytes": psutil.virtual_memory().available,
        }
