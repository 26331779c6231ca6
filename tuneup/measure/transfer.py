"""What shipping one batch from a DataLoader worker to the training process costs, measured
once on this machine with the job's own batch layout (its tensors' shapes and dtypes): the
other half of whether loader workers can help (the data-stall rule), beside what making a
batch costs.

A worker hands each batch to the training process through torch's reductions
(torch/multiprocessing/reductions.py, the file_descriptor strategy, Linux's default): for
every tensor, `reduce_storage` moves its storage into shared memory (`_share_fd_cpu_`: a new
shared segment and a copy of the bytes) and wraps the descriptor in multiprocessing's
`DupFd`; the training process, unpickling, calls `rebuild_storage_fd`, whose `df.detach()`
opens a new authenticated connection to the worker's resource-sharer thread for each
storage (multiprocessing/resource_sharer.py `get_connection`: a `Client` with the process
authkey, an HMAC challenge each way), receives the descriptor (`recv_handle`) and maps it
(`_new_shared_fd_cpu`). Per tensor, that is a few hundred microseconds of the training
process's own time, whatever the batch's size: a batch that takes less to make than to ship
is made faster in the training process than in a worker.

Here the same steps run in this process, with torch's and multiprocessing's own functions: a
tensor of each of the batch's shapes is moved into shared memory, its descriptor registered
with a private `_ResourceSharer` (its own listener thread and socket, stopped afterwards: the
process-wide one that a job's own torch.multiprocessing use relies on is never touched), then
received through `get_connection`/`recv_handle` and mapped, as the training process does. On
the training thread between two steps (recorder.py says why), once: about a millisecond for
a small batch; the fastest of REPS (one for a batch over MAX_BYTES): each shipment hands off
between threads twice, and on a machine busy with other work the scheduler can keep a thread
waiting for milliseconds at any handoff (two tensors of 256 bytes measured 4-5 ms as the
median of five beside three busy processes, 0.5 ms idle), which says nothing of the cost of
shipping a batch; the fastest shipment does. Not measured: the queue pipe's few hundred
bytes of pickled metadata a batch (small beside a connection per tensor).
"""

from __future__ import annotations

import os
from multiprocessing import reduction
from multiprocessing.resource_sharer import _ResourceSharer
from time import perf_counter
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

REPS = 5
MAX_TENSORS = 64  # a batch's tensors measured (a dict of many features: the first 64)
MAX_BYTES = 4 << 20  # a batch larger than this is measured once, not REPS times


def layout(batch: Any) -> list[tuple[tuple[int, ...], torch.dtype]] | None:
    """The CPU tensors of a batch, as (shape, dtype): what a worker would ship (None: none)."""
    try:
        tensors = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    except Exception:
        return None
    found = [(tuple(t.shape), t.dtype) for t in tensors[:MAX_TENSORS] if t.device.type == "cpu"]
    return found or None


def _round_trip(sharer: _ResourceSharer, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[float, float]:
    """One tensor, worker to training process: (the worker's seconds, the training process's)."""
    made = torch.zeros(shape, dtype=dtype)  # the worker's batch (its pages touched, as a collated batch's)
    storage = made.untyped_storage()
    if storage.nbytes() == 0:  # an empty storage is pickled as such (reductions.rebuild_storage_empty)
        return 0.0, 0.0
    began = perf_counter()
    fd, size = storage._share_fd_cpu_()  # reduce_storage: into shared memory
    handle = os.dup(fd)  # DupFd

    def send(conn: Any, pid: int) -> None:
        reduction.send_handle(conn, handle, pid)

    def close() -> None:
        os.close(handle)

    ident = sharer.register(send, close)
    worker = perf_counter() - began
    began = perf_counter()
    with _ResourceSharer.get_connection(ident) as connection:  # rebuild_storage_fd: df.detach()
        received = reduction.recv_handle(connection)
    try:
        shared = torch.UntypedStorage._new_shared_fd_cpu(received, size)
    finally:
        os.close(received)
    torch.empty((0,), dtype=dtype).set_(shared, 0, shape, made.stride())  # rebuild_tensor
    main = perf_counter() - began
    return worker, main


def measure(batch_layout: list[tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    """The fastest of REPS shipments of a batch of this layout (see the module docstring): the
    training process's seconds (`main_seconds`), the worker's (`worker_seconds`), its bytes
    and tensors."""
    nbytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in batch_layout)
    reps = REPS if nbytes <= MAX_BYTES else 1
    sharer = _ResourceSharer()
    workers, mains = [], []
    try:
        for _ in range(reps):
            worker = main = 0.0
            for shape, dtype in batch_layout:
                w, m = _round_trip(sharer, shape, dtype)
                worker, main = worker + w, main + m
            workers.append(worker)
            mains.append(main)
    finally:
        sharer.stop(timeout=5)
    return {"main_seconds": min(mains), "worker_seconds": min(workers), "bytes": nbytes,
            "tensors": len(batch_layout), "reps": reps}
