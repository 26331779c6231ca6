"""Diagnosis while the job runs: the rules over the run's history every few background ticks,
and, in a distributed job, the exchange of each rank's summary through the job's store so
that rank 0's rules see every rank (the straggler rule) and it can print the rank table at
the end.

Runs on the agent's background thread (and once at detach). What it needs of the rest is
handed in: the read model (`state`, where the evaluation goes), `emit` for events, `warn`,
`print_ranks` for the table.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .._patching import unwind
from ..measure.ranks import FLEET_WAIT_FACTOR, RankExchange, compact

FINDINGS_EVERY_TICKS = 5  # the rules run every ~5 s with the default 1 s interval
RANKS_WAIT = 2.0  # seconds detach waits for one store operation
RANKS_FINAL_WAIT = 5.0  # seconds rank 0 waits for every rank's final summary


class LiveDiagnosis:
    def __init__(self, state: Any, silence: tuple[str, ...], emit: Callable[[dict[str, Any]], None],
                 warn: Callable[[str, str], None],
                 print_ranks: Callable[[list[dict[str, Any]], int, list[dict[str, Any]], str | None], None]) -> None:
        self.state = state
        self.silence = silence
        self.emit, self.warn, self.print_ranks = emit, warn, print_ranks
        self.ranks = RankExchange(warn)  # the other ranks' summaries, through the job's store
        self._logged: tuple = ()
        self._finished = False

    def guard_destroy(self, patches: Any, before: Callable[[], None]) -> None:
        """torch.distributed.destroy_process_group takes the store with it: `before()` (the
        final exchange) runs first, for the default group only; its failure is one warning."""
        import torch

        if not torch.distributed.is_available():
            return
        from torch.distributed import distributed_c10d

        def guarded(original: Any) -> Any:
            def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
                if not args and kwargs.get("group") is None:
                    try:
                        before()
                    except Exception as exc:
                        self.warn("ranks", f"the final cross-rank summary failed: {type(exc).__name__}: {exc}")
                try:
                    return original(*args, **kwargs)
                except BaseException as exc:
                    unwind(exc)  # the job's own traceback (_patching.py)
                    raise

            return destroy_process_group

        for owner in (torch.distributed, distributed_c10d):
            patches.replace(owner, "destroy_process_group", guarded)

    @staticmethod
    def due(tick: int, final: bool, eager: bool) -> bool:
        """Whether this tick runs the rules; `eager`: apply mode may still act, so it wants
        them fresh every tick (they cost well under a millisecond)."""
        return final or eager or tick % FINDINGS_EVERY_TICKS == 1

    def run(self, snapshot: dict[str, Any] | None = None, final: bool = False) -> None:
        """Run the rules over the history; log what changed. In a distributed job, publish this
        rank's summary for the others; rank 0 reads theirs."""
        from .engine import evaluate  # the rules: loaded at the first evaluation, not at attach

        ranks, state = self.ranks, self.state
        try:
            if snapshot is None:
                snapshot = state.history.snapshot(state.window_steps)
            peers = ranks.peer_snapshots() if ranks.rank == 0 else []  # rows name their node
            state.evaluation = evaluate(snapshot, ranks=peers, silence=self.silence)
        except Exception as exc:
            self.warn("rules", f"advice rules stopped after an internal error: {type(exc).__name__}: {exc}")
            return
        found = state.findings()
        if not final and ranks.connect():
            ranks.exchange(compact(snapshot, found, final=False))  # rank 0's reads: at the next evaluation
        current = tuple((f["rule"], f["severity"]) for f in found)
        if current != self._logged:
            self._logged = current
            self.emit({"event": "findings", "time": time.time(), "findings": found})

    def finish(self) -> None:
        """The end of a distributed run: publish this rank's final summary; rank 0 waits a few
        seconds for the others' (no collective: the store), evaluates the rules across every
        rank once more, logs the ranks and prints the table."""
        if self._finished or not self.ranks.active:
            return
        self._finished = True
        try:
            self._finish()
        finally:
            self.ranks.close()

    def _finish(self) -> None:
        ranks, state = self.ranks, self.state
        snapshot = state.history.snapshot(state.window_steps)
        if ranks.group_alive():  # the job may have destroyed its process group already
            # Every rank publishes; node leaders wait for their ranks, rank 0 for the nodes.
            ranks.exchange(compact(snapshot, state.findings(), final=True),
                           wait=RANKS_WAIT + FLEET_WAIT_FACTOR * RANKS_FINAL_WAIT, final_within=RANKS_FINAL_WAIT)
        if ranks.rank != 0:
            return
        self.run(snapshot, final=True)  # across every rank's final summary
        found = state.findings()
        everyone = ranks.peer_snapshots() or [compact(snapshot, found, final=True)]
        self.emit({"event": "ranks", "time": time.time(), "world_size": ranks.world_size, "ranks": everyone,
                   "topology": ranks.topology_summary(),
                   "findings": [f for f in found if f["rule"] in ("rank-straggler", "node-straggler")]})
        self.print_ranks(everyone, ranks.world_size, found, state.run_dir if state.run_log else None)
