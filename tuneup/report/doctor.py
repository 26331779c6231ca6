"""`tuneup doctor`: what this environment offers tuneup and the job (torch build, CUDA,
cuDNN, NVML and driver, TF32 and bf16 support, CPU, run directory, port)."""

from __future__ import annotations

import os
import platform
import socket
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._version import __version__
from ..measure.config import float32_matmul_precision, hardware, tf32_allowed
from ..measure.host import usable_cores
from ..options import Options, agent_port, resolve

Check = tuple[str, str, str]  # (what, status: ok | warn | fail | info, detail)
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "cyan"}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch() -> list[Check]:
    import torch

    checks: list[Check] = [("python", "ok", f"{platform.python_version()} ({sys.executable})"),
                           ("tuneup", "ok", __version__),
                           ("torch", "ok", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none, CPU-only'})")]
    if not torch.cuda.is_available():
        checks.append(("CUDA", "info", "no CUDA device available: GPU rules and GPU timings stay silent"))
        return checks
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        bf16 = "bf16 and TF32 Tensor Cores" if major >= 8 else ("fp16 Tensor Cores, no bf16" if major >= 7 else "no Tensor Cores")
        checks.append((f"cuda:{index}", "ok", f"{name}, sm_{major}{minor}: {bf16}"))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    checks.append(("cuDNN", "ok" if cudnn else "warn", str(cudnn) if cudnn else "not available"))
    precision = float32_matmul_precision()  # (torch's getters raise where a job mixed its TF32 APIs)
    tf32 = precision != "highest" or tf32_allowed("matmul")
    status = "ok" if tf32 or torch.cuda.get_device_capability(0)[0] < 8 else "warn"
    checks.append(("TF32 matmuls", status, f"float32_matmul_precision={precision!r}"
                   + ("" if tf32 else ": fp32 matmuls skip TF32 (torch.set_float32_matmul_precision('high'))")))
    return checks


def _nvml() -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return [("NVML", "info", "nvidia-ml-py is not installed: no GPU sampling (pip install nvidia-ml-py)")]
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return [("NVML", "info", f"no NVIDIA driver ({type(exc).__name__}): GPU sampling is off, all else works")]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        return [("NVML", "ok", f"driver {driver}, {count} GPU(s) visible")]
    finally:
        pynvml.nvmlShutdown()


def _options() -> tuple[Options, list[str]]:
    """The agent's options as TUNEUP_* variables set them here, and the warnings a bad one
    gives (doctor shows them as rows instead of printing them)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = resolve({})
    return options, [str(w.message).removeprefix("tuneup: ") for w in caught]


def _settings() -> list[Check]:
    return [(message.split("=", 1)[0].removeprefix("ignoring "), "warn", message) for message in _options()[1]]


def _cpu() -> list[Check]:
    override = _options()[0].cpu_bf16
    info = hardware(override)
    detected = "AVX512-BF16/AMX present" if info["cpu_bf16_detected"] else "no AVX512-BF16/AMX"
    if info["cpu_bf16"]:
        effect = ("fp32 jobs on the CPU are advised bf16 autocast (amp-off) where it saves time on their "
                  "model, timed once; apply mode may try it")
    else:
        effect = "amp-off stays silent for jobs on the CPU (bf16 autocast is usually slower without bf16 units)"
    if override is None:
        bf16 = ("CPU bf16", "ok", f"{detected} (detected; TUNEUP_CPU_BF16=0/1 overrides it): {effect}")
    else:
        bf16 = ("CPU bf16", "info", f"treated as {'present' if override else 'absent'} by TUNEUP_CPU_BF16 "
                                f"(detected: {detected}): {effect}")
    return [("CPU", "ok", f"{usable_cores()} usable cores, {info['cpu_capability']}"), bf16]


def _run_dir() -> list[Check]:
    target = Path(os.environ.get("TUNEUP_RUN_DIR") or "tuneup-runs").resolve()
    probe = target if target.exists() else target.parent
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return [("run directory", "fail", f"cannot write in {probe} ({exc.strerror}): set TUNEUP_RUN_DIR to a writable place")]
    return [("run directory", "ok", f"{target} is writable")]


def _port() -> list[Check]:
    local_rank = os.environ.get("LOCAL_RANK")
    port = agent_port(_options()[0], int(local_rank) if local_rank and local_rank.isdigit() else None)
    if port == 0:
        return [("HTTP port", "ok", "TUNEUP_PORT=0: agents listen on any free port")]
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return [("HTTP port", "info", f"127.0.0.1:{port} is in use (another job?): agents will pick a free port")]
    return [("HTTP port", "ok", f"127.0.0.1:{port} is free for the agent's endpoint")]


def _packages() -> list[Check]:
    names = ("psutil", "prometheus-client", "nvidia-ml-py", "typer", "rich")
    return [("packages", "ok", ", ".join(f"{name} {_version(name)}" for name in names))]


SECTIONS: tuple[Callable[[], list[Check]], ...] = (_torch, _nvml, _cpu, _packages, _run_dir, _port, _settings)


def run_checks(console: Console) -> int:
    """Print the checks; returns how many failed."""
    table = Table(title="tuneup doctor", show_edge=False, pad_edge=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    failed = 0
    for section in SECTIONS:
        try:
            checks = section()
        except Exception as exc:
            checks = [(section.__name__.strip("_"), "fail", f"{type(exc).__name__}: {exc}")]
        for what, status, detail in checks:
            failed += status == "fail"
            table.add_row(what, Text(status, style=_STYLE[status]), Text(detail))
    console.print(table)
    return failed
