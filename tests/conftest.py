"""Shared fixtures: every test starts and ends with no agent attached."""

from __future__ import annotations

import contextlib
import gc
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
# The machine as the whole suite treats it. The advice depends on whether the CPU has bf16
# units (amp-off), so TUNEUP_CPU_BF16=0 (or 1) set when the suite starts runs every test, and
# every job a test starts, as on a CPU without (with) them, through tuneup's documented
# cpu_bf16 option; unset, tuneup reads the CPU. Tests whose expectation depends on it pin it.
MACHINE = ("TUNEUP_CPU_BF16",)
SESSION = ("TUNEUP_PORT", "TUNEUP_REGISTRY_DIR")  # set per test by no_agent_left


def child_env(**variables: str | None) -> dict[str, str]:
    """The environment of a process a test starts: none of the caller's TUNEUP_* settings but
    the machine's (MACHINE, as the test sees it) and this test's (SESSION: a free port, a
    private registry), so that no job a test starts takes the default port 9477 from a job
    another test runs beside it (pytest -n 2); this checkout first on PYTHONPATH. A variable
    given None is removed (TUNEUP_PORT=None: the default port, for the test of it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEUP_")}
    env.update({k: os.environ[k] for k in MACHINE + SESSION if k in os.environ})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    for name, value in variables.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@contextlib.contextmanager
def one_intra_op_thread():
    """torch on one intra-op thread for the block (as decorator: for the call), then the
    thread count it had. For jobs whose premise is timing: with two threads on a machine busy
    with other processes, each op's threads wait for one another to be scheduled, and the
    second one spins after every op while the loop waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes spinning on the CPU for the block, as other jobs on a shared machine;
    killed and reaped after it."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


def free_port() -> int:
    """A loopback port free right now (for a server a test starts itself)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_on_free_port(argv, identify, cwd: Path, attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """A server that cannot be told "any port" and say which (Prometheus, the Pushgateway), on a
    free loopback port: (process, base URL). `argv(port)` is its command line; `identify(base)`
    is true once the answer comes from this server and no other.

    A port picked here and released can be taken before the server binds it (the simulated
    fleet binds hundreds): the server then exits, and the other process's answers must not be
    read as its own. It is started again on another port."""
    import time

    for _ in range(attempts):
        port = free_port()
        server = subprocess.Popen(argv(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if identify(base):
                    return server, base
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not listening yet, or another process's answer
            time.sleep(0.2)
        server.kill()
        server.wait(20)
    raise AssertionError(f"{argv(0)[0]} did not start on a free port in {attempts} attempts")


def get_json(url: str, timeout: float = 10) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def start_pushgateway(binary: str, folder: Path) -> tuple[subprocess.Popen, str]:
    return serve_on_free_port(lambda port: [binary, f"--web.listen-address=127.0.0.1:{port}"],
                              lambda base: get_json(f"{base}/api/v1/status")["data"]["build_information"]["version"],
                              folder)


def start_daemon(registry_dir: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen, str]:
    """`tuneup daemon` on any free port (--port 0: a port picked here could be taken before it
    binds), as deployed: (process, its URL, read from the line it prints at start)."""
    import re

    daemon = subprocess.Popen([sys.executable, "-m", "tuneup", "daemon", "--port", "0", "--registry-dir",
                               str(registry_dir), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env)
    for line in daemon.stdout:
        found = re.search(r"serving .* at (http://\S+)/metrics", line)
        if found:
            return daemon, found.group(1)
    daemon.wait(10)
    raise AssertionError(f"the daemon did not start (exit {daemon.returncode})")


def wait_for(predicate, timeout: float = 60.0):
    """Poll `predicate` (a connection refused counts as not yet) until it returns something
    true, which is returned; fails the test after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError("timed out")


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
        if name.startswith("TUNEUP_") and name not in MACHINE:
            monkeypatch.delenv(name)
    # Agents in tests listen on a free port and announce themselves in a private registry.
    monkeypatch.setenv("TUNEUP_PORT", "0")
    monkeypatch.setenv("TUNEUP_REGISTRY_DIR", str(tmp_path_factory.mktemp("registry")))
    yield
    # Nothing of tuneup's may outlive its agent on this thread: a profile function or a
    # torch function mode left behind would slow (and change) every test after this one.
    assert sys.getprofile() is None, "a profile function was left behind"
    assert not torch.overrides._get_current_function_mode_stack(), "a torch function mode was left behind"
    agent = tuneup.current()
    if agent is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent.detach()
        tuneup.session._forget(agent)
        pytest.fail("the test left an agent attached")


@pytest.fixture(autouse=True)
def run_logs_fit_their_schemas(request, tmp_path):
    """Every run log a test's jobs wrote (events*.jsonl under its tmp_path: attach, `tuneup run`,
    torchrun ranks, the framework callbacks, the fake-NVML GPU sampler) reads back with no line
    skipped and no note: the schemas that guard `tuneup report` (tuneup/records.py) raise no
    false alarm on what tuneup itself writes. Tests that damage a log on purpose say so with
    the `damaged_log` marker. An unreadable log (a job killed before its first line) is the
    test's own business."""
    yield
    if request.node.get_closest_marker("damaged_log"):
        return
    from tuneup.export.runlog import RunLogError, read_log

    for path in sorted(tmp_path.rglob("events*.jsonl")):
        try:
            record = read_log(path)
        except RunLogError:
            continue
        assert record.skipped_lines == 0 and not record.notes(), (path, record.notes())


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def run_program(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
                **kwargs) -> subprocess.CompletedProcess:
    """Run tests/programs/<name> in a fresh interpreter (for faults that end a process)."""
    full_env = child_env(**(env or {}))
    return subprocess.run(
        [sys.executable, str(PROGRAMS / name), *args],
        env=full_env, capture_output=True, text=True, timeout=timeout, **kwargs,
    )


@pytest.fixture
def heap_as_a_script_has():
    """The harness's own objects (pytest's, the tests run before) frozen out of the
    collector while the job runs (test_advice, test_apply). A full collection walks every
    live object; in pytest's heap that took long enough, landing in the allocation-heavy
    DataLoader fetch, to lift a 4% data stall over the 10% threshold (the same job as a
    script: 3-5%). gc.freeze() moves
    what exists now out of the collector's reach, as a training script that freezes its setup
    would; the job's own allocations are collected as usual."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def fresh_dynamo():
    """Dynamo as in a fresh process (reset, its counters cleared): a frame converted by an
    earlier test of this process would keep the pre-hook in place for good
    (CompileProbe.quiet), and these tests would see nothing move."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def pre_hook_in_place(agent) -> bool:
    """Whether torch calls tuneup's step pre-hook now (its global registry holds it)."""
    from torch.optim import optimizer as registry

    return agent.recorder.optimizer._hooks[0] in registry._global_optimizer_pre_hooks.values()


@pytest.fixture
def one_rank():
    """A process group of one rank on gloo, as `torchrun --nproc_per_node=1` gives a DDP script
    (a TCPStore on a free loopback port: no fixed port, none left behind)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
