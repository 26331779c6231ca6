"""Act: safe changes to a running job, made as measured experiments (`mode="apply"`).

    findings (diagnose) → Action.propose() → Change → Experimenter: baseline window → apply →
    trial window → keep or revert → records (run log, report, metrics)

`action.py` says what an action and a change are, `judge.py` how a trial is judged,
`experimenter.py` runs the experiments on the training thread, and `actions/<name>.py` holds
each action: DataLoader tuning, AMP, cudnn.benchmark, zero_grad(set_to_none=True).
"""

from .action import FASTER, NOT_SLOWER, Action, Change, LiveJob
from .experimenter import Experimenter

__all__ = ["FASTER", "NOT_SLOWER", "Action", "Change", "Experimenter", "LiveJob"]
