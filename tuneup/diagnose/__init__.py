"""Diagnose: turn a run's measurements into ranked findings (the catalog: docs/rules.md).

    findings = evaluate(snapshot)        # snapshot: Agent.snapshot() or RunHistory.snapshot()

Each rule lives in `rules/<area>.py`; `rule.py` defines what a rule and a finding are.
"""

from .engine import Evaluation, evaluate
from .rule import RULES, Evidence, Facts, Finding, Missing, Rule

__all__ = ["RULES", "Evaluation", "Evidence", "Facts", "Finding", "Missing", "Rule", "evaluate"]
