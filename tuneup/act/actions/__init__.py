"""The catalog of actions apply mode can take, by id (TUNEUP_ACTIONS picks among them)."""

from .amp import Amp
from .cudnn_benchmark import CudnnBenchmark
from .dataloader import DataLoaderTuning
from .zero_grad import ZeroGradSetToNone

ACTIONS = {action.id: action for action in (DataLoaderTuning, Amp, CudnnBenchmark, ZeroGradSetToNone)}

__all__ = ["ACTIONS"]
