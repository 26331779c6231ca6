"""Which CUDA sync-tracing mechanism is cheaper: sync debug mode or GPU-trace callbacks?

    python benchmarks/bench_cuda_sync_tracing.py   (needs a CUDA GPU)

Both can count syncs; the cheaper is kept. tuneup ships sync debug mode
(`torch.cuda.set_sync_debug_mode("warn")` with its warnings counted and swallowed on sampled
steps) because it can be switched off between samples; `torch._C._activate_gpu_trace()`
cannot be deactivated and then calls into Python on every allocation and event for the rest
of the process. This prints, side by side, the per-step cost of: nothing, sync debug mode on
a sampled step, and the GPU-trace callbacks (measured last, as they stay on).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
from torch import nn

STEPS = 300
ROUNDS = 9


def make():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 512, device="cuda")
    return model, optimizer, x


def loop(model, optimizer, x, steps: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        loss.item()  # one sync per step, so both mechanisms have something to see
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def with_debug_mode(model, optimizer, x, steps: int) -> tuple[float, int]:
    """The loop with torch's sync debug mode on, counting (and swallowing) its warnings."""
    seen = 0
    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.filterwarnings("always", message="called a synchronizing CUDA operation")
        original = warnings.showwarning

        def show(message, *args, **kwargs):
            nonlocal seen
            if "synchronizing CUDA operation" in str(message):
                seen += 1
                sys._getframe(1)  # what tuneup does to find the source line
                return None
            return original(message, *args, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode(1)
        try:
            return loop(model, optimizer, x, steps), seen
        finally:
            torch.cuda.set_sync_debug_mode(0)


def main() -> None:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing measured")
        return
    job = make()
    loop(*job, 50)
    plain, debug, counted = [], [], 0
    for _ in range(ROUNDS):
        plain.append(loop(*job, STEPS))
        seconds, counted = with_debug_mode(*job, STEPS)
        debug.append(seconds)
    base = statistics.median(plain)
    # Printed as each part ends: on an H100 (torch 2.11) nothing came within 25-43 s, so the
    # GPU-trace part, which cannot be switched off, goes last and may be cut short alone.
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {STEPS} steps x {ROUNDS} rounds")
    print(f"  {'mechanism':<34}{'median step':>13}{'added/step':>13}{'syncs seen/step':>17}")
    print(f"  {'none':<34}{base * 1e6:>10.1f} µs{0:>10.1f} µs{'-':>17}")

    def row(name: str, values: list[float], seen: float) -> None:
        median = statistics.median(values)
        print(f"  {name:<34}{median * 1e6:>10.1f} µs{(median - base) * 1e6:>10.1f} µs{seen:>17.2f}", flush=True)

    row("sync debug mode (on every step)", debug, counted / STEPS)
    from torch.cuda import _gpu_trace

    traced_syncs = []
    _gpu_trace.register_callback_for_stream_synchronization(lambda stream: traced_syncs.append(stream))
    torch._C._activate_gpu_trace()
    traced = [loop(*job, STEPS) for _ in range(ROUNDS)]
    row("GPU-trace callbacks (always on)", traced, len(traced_syncs) / (STEPS * ROUNDS))


if __name__ == "__main__":
    main()
