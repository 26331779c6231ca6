"""Run every rule over a run's measurements and rank what fires.

Rules are independent and guarded: a rule whose inputs were not measured stays silent, and
a rule that fails (a bug, or measurements of a shape it did not expect) is listed under
`errors` instead of taking the others, the report or the training job down with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from . import rules as _catalog  # noqa: F401  (registers the rules)
from .rule import MIN_GAIN, RULES, SEVERITIES, Facts, Finding, Missing

_SEVERITY_ORDER = {name: index for index, name in enumerate(SEVERITIES)}


@dataclass
class Evaluation:
    findings: list[Finding]
    unmeasured: list[str] = field(default_factory=list)  # rules whose inputs were not measured
    wanting: dict[str, str] = field(default_factory=dict)  # those rules: what each wanted (Missing's message)
    passed: list[str] = field(default_factory=list)  # rules whose thresholds were not crossed
    silenced: list[str] = field(default_factory=list)  # rules the user turned off (silence=)
    errors: dict[str, str] = field(default_factory=dict)
    # Passed rules whose threshold was crossed with a gain under MIN_GAIN: rule -> that gain.
    slight: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [f.to_dict() for f in self.findings], "unmeasured": self.unmeasured,
                "wanting": self.wanting, "passed": self.passed, "slight": self.slight,
                "silenced": self.silenced, "errors": self.errors}


def unknown_rules(ids: Iterable[str]) -> list[str]:
    return [rule_id for rule_id in ids if rule_id not in RULES]


def _key(finding: Finding) -> tuple:
    # By estimated gain first; findings without a measurable gain after those with one,
    # by severity.
    return (-(finding.gain or 0.0), _SEVERITY_ORDER[finding.severity], finding.rule)


def evaluate(snapshot: dict[str, Any], *, ranks: Iterable[dict[str, Any]] = (),
             silence: Iterable[str] = ()) -> Evaluation:
    """Findings for one run (`ranks`: the other ranks' snapshots of the same job)."""
    silence = set(silence)
    facts = Facts(snapshot, ranks)
    rank = (snapshot.get("run") or {}).get("rank")
    result = Evaluation(findings=[])
    for rule_id, rule in RULES.items():
        if rule_id in silence:
            result.silenced.append(rule_id)
            continue
        try:
            evidence = rule.check(facts)
        except Missing as missing:
            result.unmeasured.append(rule_id)
            result.wanting[rule_id] = str(missing) or "its input"
            continue
        except Exception as exc:  # a rule must never take the others down
            result.errors[rule_id] = f"{type(exc).__name__}: {exc}"
            continue
        if evidence is None:
            result.passed.append(rule_id)
        elif evidence.gain is not None and evidence.gain < MIN_GAIN:
            result.passed.append(rule_id)
            result.slight[rule_id] = evidence.gain
        else:
            result.findings.append(rule.finding(evidence, rank))
    result.findings.sort(key=_key)
    return result
