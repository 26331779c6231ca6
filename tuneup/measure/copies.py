"""Which CUDA syncs are blocking host-to-device copies, told from the line that made them.

`x.to("cuda")` / `x.cuda()` / `dst.copy_(src)` from pageable host memory without
`non_blocking=True` copies through `at::cuda::memcpy_and_sync` (aten/src/ATen/native/cuda/
Copy.cu), which reports itself to sync debug mode like any other sync
(c10/cuda/CUDAFunctions.h `warn_or_error_on_sync`, one message for all). Such a copy is not a
read the loop can drop by keeping a value on the device: its fix is pinned memory and
`non_blocking=True` (the pageable-copies rule), so it is a kind of its own.

The warning carries no op name, so the kind comes from the user's line: the call expression
the frame is executing (its code's position table, Python 3.11+: `co_positions()` at
`f_lasti`), parsed. `.cuda(...)` is a host-to-device copy. `.to(...)`/`.copy_(...)` is one
unless it names the CPU as its target (`.to("cpu")`, a device-to-host read the host needs);
where the receiver (`.to`) or source (`.copy_`) is a plain name, its device decides. Nothing
here runs off a sampled step's sync.
"""

from __future__ import annotations

import ast
import linecache
from types import FrameType
from typing import Any

import torch

_COPY_METHODS = frozenset({"to", "cuda", "copy_"})
_calls: dict[tuple[Any, int], tuple[str | None, bool] | None] = {}  # (code, lasti): the copy call there
_MAX_CALLS = 1024


def is_blocking_copy(frame: FrameType | None) -> bool:
    """Whether the sync reported while `frame` executes its current call is a host-to-device
    copy (see the module docstring). False where it cannot be told."""
    if frame is None:
        return False
    key = (frame.f_code, frame.f_lasti)
    call = _calls.get(key, ...)
    if call is ...:
        call = _call_at(frame)
        if len(_calls) < _MAX_CALLS:
            _calls[key] = call
    if call is None:
        return False
    host_name, to_cpu = call
    if to_cpu:
        return False
    if host_name is None:
        return True  # `.cuda()`, or `.to(device)` with a receiver we cannot name: the usual idiom
    value = frame.f_locals.get(host_name, frame.f_globals.get(host_name))
    try:
        device = getattr(value, "device", None)  # a tensor's, or a batch object's
    except Exception:
        device = None
    return not isinstance(device, torch.device) or device.type == "cpu"


def _call_at(frame: FrameType) -> tuple[str | None, bool] | None:
    """(the name whose tensor is copied from or None, whether the target is the CPU) of the
    copy call `frame` is executing; None if it is not one."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None or frame.f_lasti < 0:
        return None  # Python 3.10: no position table
    try:
        line, end_line, column, end_column = list(positions())[frame.f_lasti // 2]
    except (IndexError, ValueError):
        return None
    if None in (line, end_line, column, end_column):
        return None
    lines = [linecache.getline(frame.f_code.co_filename, number) for number in range(line, end_line + 1)]
    if not all(lines):
        return None
    if line == end_line:
        text = lines[0][column:end_column]
    else:
        text = lines[0][column:] + "".join(lines[1:-1]) + lines[-1][:end_column]
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr not in _COPY_METHODS:
        return None
    method = node.func.attr
    if method == "copy_":
        source = node.args[0] if node.args else None
        return (source.id if isinstance(source, ast.Name) else None), False
    receiver = node.func.value
    return (receiver.id if isinstance(receiver, ast.Name) else None), method == "to" and _names_cpu(node)


def _names_cpu(call: ast.Call) -> bool:
    """`.to("cpu")`, `.to(device="cpu")`, `.to(torch.device("cpu"))`."""
    targets = list(call.args[:1]) + [keyword.value for keyword in call.keywords if keyword.arg == "device"]
    for target in targets:
        if isinstance(target, ast.Call) and target.args:  # torch.device("cpu")
            target = target.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str) and target.value.split(":")[0] == "cpu":
            return True
    return False
