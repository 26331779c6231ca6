"""Model probe: forward and backward time, the loss, and which models are being trained.

Auto mode finds the models by watching one step with global module hooks: a module called
while no other module is running is a root. After that step only the roots carry hooks,
so the per-module fast path of nn.Module.__call__ is untouched. The leaf modules' call
order seen during that step is kept for the configuration probe (Conv→BatchNorm checks
need the order modules actually run in, not the order they were declared in).
"""

from __future__ import annotations

import functools
import weakref
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from .._patching import PatchSet
from .steps import StepTimeline

# Autocast is thread-local, so it can only be read on the training thread, inside forward.
_AUTOCAST_DEVICES = ("cpu", "cuda")


def read_autocast() -> dict[str, str | None]:
    """{device: dtype name or None} for the autocast state of the calling thread."""
    state: dict[str, str | None] = {}
    for device in _AUTOCAST_DEVICES:
        try:
            enabled = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if enabled else None
        except (TypeError, RuntimeError, AttributeError):
            continue
        state[device] = str(dtype).replace("torch.", "") if dtype is not None else None
    return state


class ModelProbe:
    name = "model"

    def __init__(self, timeline: StepTimeline, explicit: list[nn.Module] | None) -> None:
        self.on = True
        self.timeline = timeline
        self.explicit = explicit
        self.roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.leaf_order: list[weakref.ref] = []  # leaf modules in call order, first discovery step
        self.autocast: dict[str, str | None] | None = None
        self.read_config_next_forward = True
        self._patches: PatchSet | None = None
        self._discovery: list[Any] = []
        self._candidates: list[nn.Module] = []
        self._depth = 0

    # --- install --------------------------------------------------------------------

    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        patches.replace(torch.autograd, "backward", self._wrap_backward)
        if self.explicit is not None:
            for model in self.explicit:
                self._hook_root(model)
        else:
            self.discover()

    def discover(self) -> None:
        """Watch the next step with global hooks to find root modules (auto mode)."""
        if self.explicit is not None or self._discovery or not self.on:
            return
        self._depth = 0
        self._candidates = []
        self._discovery = [
            module_hooks.register_module_forward_pre_hook(self._discovery_pre),
            module_hooks.register_module_forward_hook(self._discovery_post, always_call=True),
        ]
        self.timeline.add_listener("model-discovery", self._end_discovery)

    def _end_discovery(self, step: int, slot: int) -> None:
        if not self._candidates:
            return  # no forward seen yet: keep watching
        self._stop_discovery()
        for model in self._candidates:
            self._hook_root(model)
        self._candidates = []

    def _stop_discovery(self) -> None:
        for handle in self._discovery:
            handle.remove()
        self._discovery = []
        self.timeline.remove_listener("model-discovery")

    def _hook_root(self, model: nn.Module) -> None:
        if model in self.roots or self._patches is None:
            return
        self.roots.add(model)
        self._patches.add_handle(model.register_forward_pre_hook(self._root_pre))
        self._patches.add_handle(model.register_forward_hook(self._root_post, always_call=True))

    def uninstall_discovery(self) -> None:
        if self._discovery:
            self._stop_discovery()

    # --- hooks ----------------------------------------------------------------------

    def _discovery_pre(self, module: nn.Module, args: Any) -> None:
        if not self.on:
            return
        try:
            if self._depth == 0:
                self.timeline.forward_begin(perf_counter())
                if module not in self._candidates and module not in self.roots:
                    self._candidates.append(module)
                    self._read_config()
            self._depth += 1
            if len(self.leaf_order) < 10_000 and next(module.children(), None) is None:
                if not self.roots:
                    self.leaf_order.append(weakref.ref(module))
        except Exception as exc:
            self.fail(exc)

    def _discovery_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.on:
            return
        try:
            if self._depth > 0:
                self._depth -= 1
                if self._depth == 0:
                    self.timeline.forward_end(perf_counter())
        except Exception as exc:
            self.fail(exc)

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not self.on:
            return
        try:
            self.timeline.forward_begin(perf_counter())
            if self.read_config_next_forward:
                self._read_config()
        except Exception as exc:
            self.fail(exc)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.on:
            return
        try:
            self.timeline.forward_end(perf_counter())
        except Exception as exc:
            self.fail(exc)

    def _read_config(self) -> None:
        self.read_config_next_forward = False
        self.autocast = read_autocast()

    def _wrap_backward(self, original):
        probe = self
        tl = self.timeline

        @functools.wraps(original)
        def backward(tensors, *args, **kwargs):
            if not probe.on:
                return original(tensors, *args, **kwargs)
            began = perf_counter()
            try:
                if (
                    type(tensors) is torch.Tensor
                    and id(tensors) != tl.scaled_loss_id
                    and tensors.dim() == 0
                ):
                    tl.loss = tensors.detach()
            except Exception as exc:
                probe.fail(exc)
            try:
                return original(tensors, *args, **kwargs)
            finally:
                tl.backward_done(began, perf_counter())

        return backward

    def fail(self, exc: BaseException) -> None:
        self.on = False
        self.timeline.forward_depth = 0
        self.timeline.fail(self.name, exc)
