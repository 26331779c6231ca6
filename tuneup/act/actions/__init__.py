"""The catalog of actions apply mode can take, by id (TUNEUP_ACTIONS picks among them)."""

from .amp import Amp
from .compile import Compile
from .cudnn_benchmark import CudnnBenchmark
from .dataloader import DataLoaderTuning
from .gc_freeze import GcFreeze
from .zero_grad import ZeroGradSetToNone

ACTIONS = {action.id: action for action in (DataLoaderTuning, Amp, CudnnBenchmark, ZeroGradSetToNone, GcFreeze, Compile)}
# What apply mode may take unless told otherwise ("all"): every action but the opt-in ones.
DEFAULT_ACTIONS = tuple(name for name, action in ACTIONS.items() if not action.opt_in)

__all__ = ["ACTIONS", "DEFAULT_ACTIONS"]
