"""tuneup for the Hugging Face Transformers Trainer: `callbacks=[TuneupTrainerCallback()]`,
or `tuneup.attach(trainer)`.

At `on_train_begin` the agent is attached to the Trainer's own model, optimizer (unwrapped
from Accelerate's AcceleratedOptimizer: the torch optimizer whose step hooks fire) and
training DataLoader, so evaluation loaders are left out; the TrainingArguments that decide
speed (fp16/bf16, gradient accumulation, the DataLoader's workers and pinning, torch.compile)
go to the run log. At `on_train_end` an agent the callback started is detached.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from . import loaders_in, unwrap_optimizer


class TuneupTrainerCallback(TrainerCallback):
    def __init__(self, **options: Any) -> None:
        """`options`: tuneup.attach's keyword options (mode, run_dir, ...)."""
        self.options = options
        self.agent: Any = None
        self._started_here = False
        # Set by tuneup.attach(trainer): the agent it started ends at train end too, so code after
        # fit()/train() (a checkpoint digest, an export) is not counted as the last step.
        self.ends_measurement = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        from ..session import attach, current

        before = current()
        self.agent = attach((), self.options)
        self._started_here = before is None or not before.attached
        self.agent.focus(models=[model] if model is not None else [],
                         loaders=loaders_in(train_dataloader),
                         optimizers=[unwrap_optimizer(optimizer)] if optimizer is not None else [])
        import transformers

        self.agent.note_framework({
            "framework": "transformers",
            "version": transformers.__version__,
            "fp16": bool(getattr(args, "fp16", False)),
            "bf16": bool(getattr(args, "bf16", False)),
            "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
            "dataloader_num_workers": getattr(args, "dataloader_num_workers", None),
            "dataloader_pin_memory": getattr(args, "dataloader_pin_memory", None),
            "torch_compile": bool(getattr(args, "torch_compile", False)),
            "per_device_train_batch_size": getattr(args, "per_device_train_batch_size", None),
        })

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.agent is not None and (self._started_here or self.ends_measurement):
            self.agent.detach()
