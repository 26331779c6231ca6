"""Prometheus collectors: state the agent already holds, read at scrape time (nothing runs
between scrapes).

`ApplyCollector`: apply mode's decisions and the changes in effect, labelled by action id
(a handful of values) and decision.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

DECISIONS = ("kept", "reverted", "rolled back", "failed", "not applicable")


class ApplyCollector(Collector):
    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        records = [dict(record) for record in list(self.runner.records)]
        state = self.runner.state()
        decided = CounterMetricFamily(
            "tuneup_apply_decisions", "Changes apply mode tried and decided on, by action and decision",
            labels=["action", "decision"])
        for (action, decision), count in sorted(Counter(
                (r["action"], r["decision"]) for r in records if r["decision"] in DECISIONS).items()):
            decided.add_metric([action, decision.replace(" ", "_")], count)
        yield decided
        in_effect = set(state["in_effect"])
        effect = GaugeMetricFamily("tuneup_apply_changes_in_effect",
                                   "Changes apply mode made that are in effect now (on trial or kept)",
                                   labels=["action"])
        trial = GaugeMetricFamily("tuneup_apply_on_trial", "1 while a change of this action is on trial",
                                  labels=["action"])
        speedup = GaugeMetricFamily("tuneup_apply_speedup_ratio",
                                    "Measured speed-up of the kept changes in effect (mean step time before / "
                                    "after, multiplied over the action's changes)", labels=["action"])
        for action in sorted({r["action"] for r in records}):
            mine = [r for r in records if r["action"] == action]
            effect.add_metric([action], sum(1 for r in mine if r["id"] in in_effect))
            trial.add_metric([action], 1 if any(r["id"] == state["on_trial"] for r in mine) else 0)
            ratio = 1.0
            for record in mine:
                if record["id"] in in_effect and record["decision"] == "kept" and record.get("speedup"):
                    ratio *= record["speedup"]
            speedup.add_metric([action], ratio)
        yield effect
        yield trial
        yield speedup
