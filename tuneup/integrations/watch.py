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
import importlib.abc
import importlib.util
import sys
from typing import Any

def watch_trainers(agent: Any) -> None:
    """Once per agent, while it is attached: its PatchSet undoes the watch at detach."""
    if not agent.enabled or not agent.attached or any(
            isinstance(finder, TrainerWatch) and finder.patches is agent.patches for finder in sys.meta_path):
        return
    TrainerWatch(agent.patches, lambda: agent.attached, agent.state.warn).install()


# The modules that define the trainers (their class is `Trainer` in each).
TRAINER_MODULES = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer", "transformers.trainer")


class TrainerWatch(importlib.abc.MetaPathFinder):
    def __init__(self, patches: Any, active: Any, warn: Any) -> None:
        self.patches = patches
        self.active = active  # () -> whether the agent is attached
        self.warn = warn
        self._finding = False

    def install(self) -> None:
        for name in TRAINER_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                self._patch(module)
        sys.meta_path.insert(0, self)
        self.patches.add_handle(self)  # undo: remove()

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TRAINER_MODULES or self._finding:
            return None
        self._finding = True  # the normal finders find it; this one steps aside meanwhile
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self._patch)
        return spec

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


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, and the trainer class patched once the module has run."""

    def __init__(self, loader: Any, after: Any) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = self.loader  # the module keeps its own loader (reloads, resources)
        self.loader.exec_module(module)
        self.after(module)
