"""The report document: everything a report shows, as plain data (JSON-able), built from
runs' event histories. Every output format (text, markdown, json, html) renders this one
document, so they cannot disagree.

    {"tuneup": version, "schema": 1, "generated_at": epoch seconds, "source": str,
     "notes": [str, ...],   # what the report leaves out of its sources, and why
     "runs": [{"rank": int|None, "snapshot": {...}, "series": {...}, "evaluation": {...}}],
     "findings": [finding, ...]}   # across ranks, ranked by estimated gain; each with "applied":
                                   # what apply mode did about it (apply_outcome), or None

`snapshot` has the shape of Agent.snapshot() (see measure.history), `series` holds the
per-interval values the html plots draw, `findings` the rules' findings (diagnose.rule).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

from .._version import __version__
from ..diagnose import evaluate
from ..measure.history import RunHistory

SCHEMA = 1


def build(histories: Sequence[RunHistory], *, source: str, silence: Iterable[str] = (),
          window_steps: int = 1000) -> dict[str, Any]:
    silence = tuple(silence)
    snapshots = [history.snapshot(window_steps) for history in histories]
    runs = []
    merged: dict[str, dict[str, Any]] = {}
    for index, (history, snapshot) in enumerate(zip(histories, snapshots)):
        others = snapshots[:index] + snapshots[index + 1:]
        evaluation = evaluate(snapshot, ranks=others, silence=silence).to_dict()
        runs.append({"rank": snapshot["run"].get("rank"), "snapshot": snapshot,
                     "series": history.series(), "evaluation": evaluation})
        for finding in evaluation["findings"]:
            # A rule that fires on several ranks is one finding, shown with its ranks and
            # the evidence of the rank where it costs most.
            kept = merged.get(finding["rule"])
            ranks = (kept["ranks"] if kept else []) + [finding["rank"]]
            if kept is None or (finding["gain"] or 0) > (kept["gain"] or 0):
                merged[finding["rule"]] = dict(finding)
            merged[finding["rule"]]["ranks"] = [r for r in ranks if r is not None]
    findings = sorted(merged.values(), key=lambda f: (-(f["gain"] or 0), ("high", "medium", "low").index(f["severity"]), f["rule"]))
    for finding in findings:
        finding["applied"] = apply_outcome(finding["rule"], [run["snapshot"] for run in runs])
    notes = [note for history in histories for note in history.notes]
    return {"tuneup": __version__, "schema": SCHEMA, "generated_at": time.time(), "source": source,
            "silenced": list(silence), "notes": notes, "runs": runs, "findings": findings}


def apply_outcome(rule: str, snapshots: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """What apply mode did about a finding of `rule` in this run: its latest kept change of an
    action that fixes the rule, else its latest decision on one (tried and not kept, not
    applicable, stopped); None where it did nothing (advise mode, a run log from before
    records named the rules they fix)."""
    decided = [record for snapshot in snapshots for record in snapshot.get("actions") or []
               if rule in (record.get("fixes") or ()) and record.get("decision") not in (None, "trying")]
    if not decided:
        return None
    kept = [record for record in decided if record["decision"] in ("kept", "set at start")]
    record = (kept or decided)[-1]
    return {key: record.get(key) for key in ("id", "action", "change", "decision", "reason", "applied_step",
                                            "effective_step", "undone", "slower")}
