"""Rank 0's end-of-run summary across the ranks of a distributed job (plain text on stderr:
it is printed while the job exits, beside the job's own output)."""

from __future__ import annotations

import sys

import time
from typing import Any

from ..diagnose.rules.distributed import allreduce_wait, cpu_wait, own_times
from ..format import percent, seconds


PER_RANK_LINES = 64  # up to this many ranks the table has a line per rank; above, a line per node
CROSS_RANK_RULES = ("rank-straggler", "node-straggler")


def rank_summary(summaries: list[dict[str, Any]], world_size: int, findings: list[dict[str, Any]],
                 run_dir: str | None = None) -> str:
    """`summaries`: every rank's compact summary (measure/ranks.py: rows of the node summaries);
    `findings`: rank 0's findings, evaluated across the ranks; `run_dir`: rank 0's."""
    seen = {s["run"]["rank"]: s for s in summaries if (s.get("run") or {}).get("rank") is not None}
    where = f"tuneup report {run_dir}" if run_dir else "tuneup report <a rank's run directory>"
    lines = [f"tuneup: summary across {world_size} ranks, from rank 0 (the advice with its evidence: {where})"]
    times, _ = own_times(seen)
    lines += _per_rank(seen, times, world_size) if world_size <= PER_RANK_LINES else _per_node(seen, times, world_size)
    said = False
    for rule in CROSS_RANK_RULES:
        finding = next((f for f in findings if f["rule"] == rule), None)
        if finding is not None:
            lines.append(f"  {'straggler' if rule == 'rank-straggler' else 'slow node'}: {finding['observed']}")
            said = True
    if not said:
        lines.append("  no straggler: every rank's time outside the all-reduce is within 15% of the median rank's")
    return "\n".join(lines)


def _per_rank(seen: dict[int, dict[str, Any]], times: dict[int, float], world_size: int) -> list[str]:
    """A line per rank; `times`: each rank's own time (own_times). The all-reduce wait column
    is there when DDP's timers gave one: the straggler waits least. The CPU wait column (its
    threads' run-queue wait per step) where a rank measured it: a starved rank's is long."""
    waits = any(allreduce_wait(s) is not None for s in seen.values())
    starved = any(cpu_wait(s) is not None for s in seen.values())

    def wait(text: str) -> str:  # the column, where there is one
        return f" {text:>10}" if waits else ""

    def queued(text: str) -> str:
        return f" {text:>9}" if starved else ""

    lines = [f"  {'rank':>4}  {'host':<16} {'steps/s':>8} {'step':>9} {'own time':>9}{wait('all-reduce')}"
             f"{queued('cpu wait')} {'data stall':>10}  findings"]
    now = time.time()
    for rank in range(world_size):
        summary = seen.get(rank)
        if summary is None:
            lines.append(f"  {rank:>4}  {'':<16} {'–':>8} {'–':>9} {'–':>9}{wait('–')}{queued('–')} {'–':>10}  "
                         "no summary from this rank")
            continue
        window = summary.get("window") or {}
        step = (window.get("step_seconds") or {}).get("median")
        rate = window.get("steps_per_second")
        rules = ", ".join(f["rule"] for f in summary.get("findings") or [] if f["rule"] not in CROSS_RANK_RULES) or "none"
        state = "" if summary.get("final") else f" (last heard {now - summary.get('time', now):.0f} s ago: ended early?)"
        lines.append(f"  {rank:>4}  {str((summary.get('run') or {}).get('host') or '')[:16]:<16} "
                     f"{'–' if rate is None else f'{rate:,.1f}':>8} {seconds(step):>9} {seconds(times.get(rank)):>9}"
                     f"{wait(seconds(allreduce_wait(summary)))}{queued(seconds(cpu_wait(summary)))} "
                     f"{percent(window.get('stall_ratio')):>10}  {rules}{state}")
    return lines


def _per_node(seen: dict[int, dict[str, Any]], times: dict[int, float], world_size: int) -> list[str]:
    """A line per node: how many of its ranks reported, their own times (median, slowest), the
    worst stall, the rules that fired on its ranks."""
    nodes: dict[Any, list[dict[str, Any]]] = {}
    for summary in seen.values():
        run = summary.get("run") or {}
        nodes.setdefault(run["node"] if run.get("node") is not None else run.get("host"), []).append(summary)
    lines = [f"  {'node':>5}  {'host':<16} {'ranks':>7} {'own time':>9} {'slowest':>18} {'worst stall':>11}  findings"]
    for node in sorted(nodes, key=lambda n: (n is None, str(type(n)), n if n is not None else 0)):
        ranks = nodes[node]
        own = sorted((times[s["run"]["rank"]], s["run"]["rank"]) for s in ranks if s["run"]["rank"] in times)
        middle = own[len(own) // 2][0] if own else None
        slowest = f"{seconds(own[-1][0])} (rank {own[-1][1]})" if own else "–"
        stalls = [s["window"].get("stall_ratio") for s in ranks if (s.get("window") or {}).get("stall_ratio") is not None]
        counts: dict[str, int] = {}
        for summary in ranks:
            for finding in summary.get("findings") or []:
                if finding["rule"] not in CROSS_RANK_RULES:
                    counts[finding["rule"]] = counts.get(finding["rule"], 0) + 1
        rules = ", ".join(f"{rule} ({count})" for rule, count in sorted(counts.items(), key=lambda item: -item[1]))
        host = str((ranks[0].get("run") or {}).get("host") or "")[:16]
        lines.append(f"  {'?' if node is None else node:>5}  {host:<16} {len(ranks):>7} {seconds(middle):>9} "
                     f"{slowest:>18} {percent(max(stalls) if stalls else None):>11}  {rules or 'none'}")
    missing = world_size - len(seen)
    if missing:
        lines.append(f"  {missing} of {world_size} ranks sent no summary")
    return lines


def print_rank_summary(summaries: list[dict[str, Any]], world_size: int, findings: list[dict[str, Any]],
                       run_dir: str | None = None) -> None:
    """The table on rank 0's stderr at the end of a distributed run."""
    sys.stderr.write(rank_summary(summaries, world_size, findings, run_dir) + "\n")
