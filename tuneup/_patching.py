"""Reversible changes to other people's objects.

Every attribute the agent replaces and every hook it registers goes through a PatchSet,
so `detach()` can put each object back exactly as it was (an inherited attribute is
deleted again rather than copied onto the subclass).
"""

from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


class PatchSet:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace `owner.name` with `make(original)`; undo restores the exact prior state."""
        own = vars(owner).get(name, _MISSING)
        replacement = make(getattr(owner, name))
        setattr(owner, name, replacement)

        def undo() -> None:
            if vars(owner).get(name, _MISSING) is not replacement:
                # Someone wrapped us after we patched; leave their wrapper in place. Ours
                # checks whether the agent is active, so it passes calls straight through.
                return
            if own is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

        self._undo.append(undo)

    def add_handle(self, handle: Any) -> None:
        """Keep a RemovableHandle (torch hooks) for removal at undo time."""
        self._undo.append(handle.remove)

    def undo_all(self) -> list[BaseException]:
        """Undo in reverse order; never raises, returns what failed."""
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # pragma: no cover - defensive
                errors.append(exc)
        return errors

    def __len__(self) -> int:
        return len(self._undo)
