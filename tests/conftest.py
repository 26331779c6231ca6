"""Shared fixtures: every test starts and ends with no agent attached."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tuneup

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "programs"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_agent_left(monkeypatch, tmp_path_factory):
    for name in list(os.environ):
        if name.startswith("TUNEUP_"):
            monkeypatch.delenv(name)
    # Agents in tests listen on a free port and announce themselves in a private registry.
    monkeypatch.setenv("TUNEUP_PORT", "0")
    monkeypatch.setenv("TUNEUP_REGISTRY_DIR", str(tmp_path_factory.mktemp("registry")))
    yield
    agent = tuneup.current()
    if agent is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent.detach()
        tuneup._forget(agent)
        pytest.fail("the test left an agent attached")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def run_program(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
                **kwargs) -> subprocess.CompletedProcess:
    """Run tests/programs/<name> in a fresh interpreter (for faults that end a process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEUP_")}
    full_env.update({k: os.environ[k] for k in ("TUNEUP_PORT", "TUNEUP_REGISTRY_DIR") if k in os.environ})
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(PROGRAMS / name), *args],
        env=full_env, capture_output=True, text=True, timeout=timeout, **kwargs,
    )
