"""DDP's all-reduce wait per rank, from DDP's own timers: no hook, no collective, no cost on
the training thread.

In DistributedDataParallel every rank's backward ends waiting for the bucket all-reduces, and
the all-reduce finishes only when the slowest rank has sent its gradients: fast ranks wait,
the straggler hardly does. So the wait names the slow rank where whole step times, equalised
by the all-reduce, cannot (the rank that waits least is the slow one).

DDP measures this itself. Its Reducer times the forward, the backward's compute and the
communication on sampled iterations (iterations 1-10, then every 100th:
`Reducer::should_collect_runtime_stats`, torch/csrc/distributed/c10d/reducer.cpp), and its
Logger keeps the last sampled iteration's durations beside the running averages
(`Logger::set_runtime_stats_and_log`, logger.cpp: ints_map "iteration", "backward_comm_time",
"backward_compute_comm_overlap_time", "backward_compute_time", "forward_compute_time", in
nanoseconds). Communication runs from the first bucket's all-reduce launch to the end of the
last one's; the overlap, from that launch to the end of the backward's compute. Their
difference is the time the rank sat in the all-reduce after its own gradients were done: the
wait. `DistributedDataParallel._get_ddp_logging_data()` copies those maps under the reducer's
mutex with the GIL released (torch/csrc/distributed/c10d/init.cpp: `py::call_guard<
py::gil_scoped_release>`), so reading it from the agent's background thread neither blocks
the training thread nor can deadlock with a Python comm hook.

Not a comm hook of ours: DDP takes one (`Reducer::register_comm_hook`: "register_comm_hook or
register_builtin_comm_hook can only be called once", reducer.cpp), so ours would take the
job's place or be refused; nor per-parameter gradient hooks on the training thread.

Each tick reads every DDP model once; a new sampled iteration adds one entry to the model's
short window, and the summary is the window's median (summed over the DDP models a step runs,
as a GAN's two), but for the wait: its lower quartile, the wait a rank has at (nearly) every
iteration. The ranks wait for a straggler at every iteration, so their lower quartile holds its
delay, while the straggler's is near none. On a crowded host a sampled iteration's wait is
whichever rank the scheduler held back then: two ranks at the same pace beside two busy
processes on 2 cores read waits of 0.02-12 ms at single iterations, on both ranks alike (both
long at once where the all-reduce's own threads waited); medians over four iterations read
4.3 ms on one rank and 0.5 ms on the other and named a straggler, where the lower quartiles
of 16 iterations were 0.3 and 0.4 ms.

The first iterations (bucket rebuild, the ranks meeting for the first time) are left out, and
once the window holds STEADY_SAMPLES iterations past DDP's first ten the figures are over those
alone (`steady`): iterations 3-10 still hold start-up (ranks arriving at their first steps at
different times), and on a loaded machine their waits outweighed the steady state's seven
samples of an 800-step run, reading a wait longer than the step itself, and in a 300-step run
of two ranks at the same pace named one a straggler. Three, not two: two iterations (a 300-step
run's 100 and 200) are too few to tell a rank held back once from one that always is.
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Any, Iterable

FIRST_ITERATION = 3  # DDP's iterations 1-2 hold the bucket rebuild and the ranks' first meeting
WINDOW = 16  # sampled iterations the figures are over (the last ~1,000 steps past the first ten)
EARLY_ITERATIONS = 10  # DDP samples iterations 1-10, then every 100th (kDDPRuntimeLoggingSampleRate)
STEADY_SAMPLES = 3  # sampled iterations past the first ten that make the figures theirs alone
NANOSECONDS = 1e-9


def is_ddp(model: Any) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, DistributedDataParallel)


class AllReduceWait:
    """The last sampled iterations of each DDP model's timers, read off the training thread."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # id(model) -> the last sampled iteration read
        self._samples: dict[int, deque[dict[str, float]]] = {}  # id(model) -> its window

    def sample(self, models: Iterable[Any]) -> dict[str, Any] | None:
        """Read each DDP model's last sampled iteration; the window's figures (None: no DDP)."""
        ddp = [model for model in models if is_ddp(model)]
        if not ddp:
            return None
        for model in ddp:
            self._read(model)
        return self.summary()

    def _read(self, model: Any) -> None:
        data = model._get_ddp_logging_data()
        iteration = data.get("iteration")
        comm, overlap = data.get("backward_comm_time"), data.get("backward_compute_comm_overlap_time")
        if not isinstance(iteration, int) or iteration < FIRST_ITERATION or self._seen.get(id(model)) == iteration:
            return
        self._seen[id(model)] = iteration
        if not isinstance(comm, int) or not isinstance(overlap, int) or comm <= 0:
            return  # a sampled iteration without timings (a device DDP does not time)
        self._samples.setdefault(id(model), deque(maxlen=WINDOW)).append({
            "iteration": iteration,
            "wait": max(0, comm - overlap) * NANOSECONDS,
            "comm": comm * NANOSECONDS,
            "backward_compute": max(0, data.get("backward_compute_time") or 0) * NANOSECONDS,
            "forward": max(0, data.get("forward_compute_time") or 0) * NANOSECONDS,
        })

    def summary(self) -> dict[str, Any]:
        windows = [_steady(list(window)) for window in self._samples.values() if window]
        if not windows:
            return {"iterations_sampled": 0}
        out: dict[str, Any] = {"iterations_sampled": max(len(w) for w in windows),
                               "last_iteration": max(w[-1]["iteration"] for w in windows),
                               # past the start-up (iteration 100 and on, STEADY_SAMPLES of them)
                               "steady": all(w[0]["iteration"] > EARLY_ITERATIONS for w in windows)}
        # The wait a rank has at (nearly) every iteration: its lower quartile (see the module's notes).
        out["allreduce_wait_seconds"] = sum(lower_quartile([s["wait"] for s in w]) for w in windows)
        for key, name in (("comm", "allreduce_seconds"), ("backward_compute", "backward_compute_seconds"),
                          ("forward", "forward_seconds")):
            out[name] = sum(median(s[key] for s in w) for w in windows)
        return out


def lower_quartile(values: list[float]) -> float:
    """The value a quarter of the way up the sorted `values` (the smallest of up to four)."""
    return sorted(values)[(len(values) - 1) // 4]


def _steady(window: list[dict[str, float]]) -> list[dict[str, float]]:
    """The window's iterations past DDP's first ten, where it has STEADY_SAMPLES of them."""
    steady = [s for s in window if s["iteration"] > EARLY_ITERATIONS]
    return steady if len(steady) >= STEADY_SAMPLES else window
