"""Framework trainers seen as they are built: under `tuneup run` (no code change), or after an
`attach()` not given the trainer, a Lightning or Hugging Face `Trainer` gets tuneup's callback
as `tuneup.attach(trainer)` would give it, so the measurement is the framework's: its training
loaders and not its validation loaders, its settings in the run log, the end at train end.

How: each trainer class's `__init__` is wrapped to call `install(self, {})` once it returns
(subclasses, such as trl's, reach it through `super().__init__`). A framework imported already
is patched at once; one imported later through a finder at the head of `sys.meta_path` that
lets the normal finders find the module and patches the class once the module has run. Nothing
is imported that the job does not import. Detach puts every `__init__` back and removes the
finder (the agent's PatchSet).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from .._patching import AfterImport


def watch_trainers(agent: Any) -> None:
    """Once per agent, while it is attached: its PatchSet undoes the watch at detach."""
    if not agent.enabled or not agent.attached or any(
            isinstance(finder, TrainerWatch) and finder.patches is agent.patches for finder in sys.meta_path):
        return
    TrainerWatch(agent.patches, lambda: agent.attached, agent.state.warn).install()


# The modules that define the trainers (their class is `Trainer` in each).
TRAINER_MODULES = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer", "transformers.trainer")


class TrainerWatch(AfterImport):
    def __init__(self, patches: Any, active: Any, warn: Any) -> None:
        super().__init__(TRAINER_MODULES, self._patch)
        self.patches = patches
        self.active = active  # () -> whether the agent is attached
        self.warn = warn

    def install(self) -> None:  # type: ignore[override]
        for name in TRAINER_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                self._patch(module)
        super().install(self.patches)

    def _patch(self, module: Any) -> None:
        trainer = getattr(module, "Trainer", None)
        if not isinstance(trainer, type) or getattr(trainer.__init__, "_tuneup_watch", False):
            return
        active, warn = self.active, self.warn

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                if active():
                    try:
                        from . import install

                        install(self, {})
                    except Exception as exc:  # the job's trainer is built whatever tuneup's callback does
                        warn("framework", f"the {type(self).__name__}'s integration could not be installed "
                                          f"({type(exc).__name__}: {exc}); its loaders are measured as a plain loop's")

            __init__._tuneup_watch = True  # type: ignore[attr-defined]
            return __init__

        self.patches.replace(trainer, "__init__", wrap)

