"""The catalog of actions apply mode can take, by id (TUNEUP_ACTIONS picks among them)."""

from ...options import ACTION_IDS, DEFAULT_ACTIONS, OPT_IN_ACTIONS
from .amp import Amp
from .compile import Compile
from .cudnn_benchmark import CudnnBenchmark
from .dataloader import DataLoaderTuning
from .gc_freeze import GcFreeze
from .zero_grad import ZeroGradSetToNone

ACTIONS = {action.id: action for action in (DataLoaderTuning, Amp, CudnnBenchmark, ZeroGradSetToNone, GcFreeze, Compile)}
# The option's ids, checked without torch (options.py), are these; what apply mode may take
# unless told otherwise ("all", DEFAULT_ACTIONS) is every action but the opt-in ones.
assert tuple(ACTIONS) == ACTION_IDS and tuple(n for n, a in ACTIONS.items() if a.opt_in) == OPT_IN_ACTIONS

__all__ = ["ACTIONS", "DEFAULT_ACTIONS"]
