"""Rank 0's end-of-run summary across the ranks of a distributed job (plain text on stderr:
it is printed while the job exits, beside the job's own output)."""

from __future__ import annotations

import sys

import time
from typing import Any

from ..diagnose.rules.distributed import own_time
from ..format import percent, seconds


def rank_summary(summaries: list[dict[str, Any]], world_size: int, findings: list[dict[str, Any]],
                 run_dir: str | None = None) -> str:
    """`summaries`: every rank's compact summary (measure/ranks.py), rank 0's first;
    `findings`: rank 0's findings, evaluated across the ranks; `run_dir`: rank 0's."""
    seen = {s["run"]["rank"]: s for s in summaries if (s.get("run") or {}).get("rank") is not None}
    where = f"tuneup report {run_dir}" if run_dir else "tuneup report <a rank's run directory>"
    lines = [f"tuneup: summary across {world_size} ranks, from rank 0 (the advice with its evidence: {where})"]
    header = f"  {'rank':>4}  {'host':<16} {'steps/s':>8} {'step':>9} {'own time':>9} {'data stall':>10}  findings"
    lines.append(header)
    now = time.time()
    for rank in range(world_size):
        summary = seen.get(rank)
        if summary is None:
            lines.append(f"  {rank:>4}  {'':<16} {'–':>8} {'–':>9} {'–':>9} {'–':>10}  no summary from this rank")
            continue
        window = summary.get("window") or {}
        step = (window.get("step_seconds") or {}).get("median")
        rate = window.get("steps_per_second")
        rules = ", ".join(f["rule"] for f in summary.get("findings") or [] if f["rule"] != "rank-straggler") or "none"
        state = "" if summary.get("final") else f" (last heard {now - summary.get('time', now):.0f} s ago: ended early?)"
        lines.append(f"  {rank:>4}  {str((summary.get('run') or {}).get('host') or '')[:16]:<16} "
                     f"{'–' if rate is None else f'{rate:,.1f}':>8} {seconds(step):>9} {seconds(own_time(summary)):>9} "
                     f"{percent(window.get('stall_ratio')):>10}  {rules}{state}")
    straggler = next((f for f in findings if f["rule"] == "rank-straggler"), None)
    if straggler is not None:
        lines.append(f"  straggler: {straggler['observed']}")
    else:
        lines.append("  no straggler: every rank's time outside the all-reduce is within 15% of the median rank's")
    return "\n".join(lines)


def print_rank_summary(summaries: list[dict[str, Any]], world_size: int, findings: list[dict[str, Any]],
                       run_dir: str | None = None) -> None:
    """The table on rank 0's stderr at the end of a distributed run."""
    sys.stderr.write(rank_summary(summaries, world_size, findings, run_dir) + "\n")
