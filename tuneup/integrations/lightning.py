"""tuneup for PyTorch Lightning: `callbacks=[TuneupCallback()]`, or `tuneup.attach(trainer)`.

The agent attaches at `on_fit_start`; at `on_train_start` (the optimizers, the GradScaler of a
"16-mixed" precision plugin and the training DataLoaders exist by then) it is focused on
exactly those objects and the LightningModule, so the validation loop's loaders are not
counted as training data wait; the trainer's precision, gradient accumulation and strategy go
to the run log. At `on_train_end`
an agent the callback started is detached (its report: `tuneup report <run_dir>`).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback  # type: ignore[no-redef]

from . import loaders_in, unwrap_optimizer


class TuneupCallback(Callback):
    def __init__(self, **options: Any) -> None:
        """`options`: tuneup.attach's keyword options (mode, run_dir, ...)."""
        self.options = options
        self.agent: Any = None
        self._started_here = False
        # Set by tuneup.attach(trainer): the agent it started ends at train end too, so code after
        # fit()/train() (a checkpoint digest, an export) is not counted as the last step.
        self.ends_measurement = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach before the fit loop starts iterating (it does so before on_train_start)."""
        from ..session import attach, current

        before = current()
        self.agent = attach((), self.options)
        self._started_here = before is None or not before.attached

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.agent is None:
            self.on_fit_start(trainer, pl_module)
        loaders = loaders_in(trainer.train_dataloader)
        optimizers = [unwrap_optimizer(o) for o in trainer.optimizers]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.agent.focus(models=[pl_module], loaders=loaders, optimizers=optimizers,
                         scalers=[scaler] if scaler is not None else [])
        self.agent.note_framework({
            "framework": "lightning",
            "version": _version(),
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "strategy": type(trainer.strategy).__name__,
            "devices": trainer.num_devices,
            "grad_scaler": scaler is not None,
        })

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.agent is not None and (self._started_here or self.ends_measurement):
            self.agent.detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)


def _version() -> str | None:
    try:
        import lightning

        return lightning.__version__
    except ImportError:
        import pytorch_lightning

        return pytorch_lightning.__version__
