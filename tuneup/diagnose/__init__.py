"""Diagnose: turn a run's measurements into ranked findings (the catalog: docs/rules.md).

    findings = evaluate(snapshot)        # snapshot: Agent.snapshot() or RunHistory.snapshot()

Each rule lives in `rules/<area>.py`; `rule.py` defines what a rule and a finding are.
"""

from typing import Any

__all__ = ["RULES", "Evaluation", "Evidence", "Facts", "Finding", "Missing", "Rule", "evaluate"]
_IN_ENGINE = ("Evaluation", "evaluate")


def __getattr__(name: str) -> Any:
    """The names above, imported on first use: a live agent loads the rules on its background
    thread, not inside attach()."""
    if name not in __all__:
        raise AttributeError(f"module 'tuneup.diagnose' has no attribute {name!r}")
    from . import engine, rule  # the engine imports rules/, which fills RULES

    return getattr(engine if name in _IN_ENGINE else rule, name)
