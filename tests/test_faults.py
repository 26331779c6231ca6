"""The fault matrix: whatever breaks, the job behaves exactly as it would without the agent."""

from __future__ import annotations

import collections
import json
import linecache
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import tuneup
from benchmarks.scenarios import SlowDataset, loader_for, mlp, train
from tests.conftest import PROGRAMS, child_env, run_program
from tuneup.export.runlog import read_log


def agent_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "tuneup:" in line]


def last_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.strip()][-1]


@pytest.mark.parametrize("workers", [0, 2])
def test_exception_in_the_users_dataset_passes_through_unchanged(tmp_path, workers):
    args = ["--workers", str(workers), "--fail-at", "37", "--run-dir", str(tmp_path / "run")]
    plain = run_program("fault_job.py", "--agent", "off", *args)
    measured = run_program("fault_job.py", "--agent", "on", *args)
    assert plain.returncode == measured.returncode == 1
    assert "ValueError: corrupt sample 37" in plain.stderr
    assert last_line(measured.stderr) == last_line(plain.stderr)
    assert measured.stdout == plain.stdout  # the same steps ran before the failure
    assert agent_lines(measured.stderr) == []
    record = read_log(tmp_path / "run" / "events.jsonl")
    assert record.last("end") is not None  # atexit still closed the run log


@pytest.mark.parametrize("workers", [0, 2])
def test_keyboard_interrupt_mid_epoch_behaves_as_without_the_agent(tmp_path, workers):
    def interrupted(agent: str) -> subprocess.CompletedProcess:
        env = child_env()
        process = subprocess.Popen(
            [sys.executable, str(PROGRAMS / "fault_job.py"), "--agent", agent, "--workers", str(workers),
             "--steps", "100000", "--latency", "0.001", "--run-dir", str(tmp_path / agent)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
            # A test run started in the background (nohup, CI runners) ignores SIGINT, and
            # children inherit that: give the job Ctrl-C's default back, as a terminal would.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        for line in process.stdout:
            if line.strip() == "step 20":
                os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
                break
        out, err = process.communicate(timeout=60)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    plain, measured = interrupted("off"), interrupted("on")
    assert plain.returncode == measured.returncode != 0
    assert last_line(measured.stderr) == last_line(plain.stderr) == "KeyboardInterrupt"
    assert agent_lines(measured.stderr) == []
    record = read_log(tmp_path / "on" / "events.jsonl")
    assert record.last("end")["totals"]["steps"] >= 20


def read_only_prefix(directory) -> list[str]:
    """Run under a private mount namespace where `directory` is mounted read-only (root)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return []
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to make a read-only mount as root")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    d = str(directory)
    return ["unshare", "-m", "sh", "-c",
            f'mount --bind "{d}" "{d}" && mount -o remount,bind,ro "{d}" && exec "$@"', "sh"]


def test_read_only_run_directory_warns_once_and_training_goes_on(tmp_path):
    run_dir = tmp_path / "readonly"
    run_dir.mkdir()
    prefix = read_only_prefix(run_dir)
    env = child_env()
    result = subprocess.run(
        [*prefix, sys.executable, str(PROGRAMS / "fault_job.py"), "--agent", "on", "--snapshot",
         "--run-dir", str(run_dir / "run")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "done steps=40" in result.stdout
    warnings_seen = agent_lines(result.stderr)
    assert len(warnings_seen) == 1
    assert "run log turned off" in warnings_seen[0]
    assert ("Read-only file system" in warnings_seen[0]) or ("Permission denied" in warnings_seen[0])
    totals = json.loads(result.stdout.strip().splitlines()[-1])
    assert totals["steps"] == 40  # measuring went on in memory


def warned(loader, steps: int, **options):
    """Train an MLP `steps` steps on `loader` under attach(**options), every warning recorded:
    (tuneup's warnings, the agent, the loop's ground truth)."""
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(**options) as agent:
            truth = train(loader, model, optimizer, steps=steps)
    return [w for w in caught if issubclass(w.category, tuneup.TuneupWarning)], agent, truth


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_warns_once_and_training_goes_on(run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    ours, agent, truth = warned(loader_for(SlowDataset(size=4096, latency=0.0005)), 40, run_dir=run_dir, interval=0.05)
    assert len(ours) == 1 and "No space left on device" in str(ours[0].message)
    # The run header is written by attach(): the warning names that line of the job's.
    assert ours[0].filename == __file__ and "tuneup.attach(" in linecache.getline(__file__, ours[0].lineno)
    snapshot = agent.snapshot()
    assert snapshot["totals"]["steps"] == truth.steps == 40
    assert snapshot["probes"]["run_log"] == "off"
    assert snapshot["run_log"] is None


Pair = collections.namedtuple("Pair", "x y")


def _as_lists(batch):
    """Collate into a namedtuple: not the plain-tuple fast path, so batch_size() runs."""
    return Pair(torch.stack([x for x, _ in batch]), torch.stack([y for _, y in batch]))


def test_an_internal_probe_error_turns_only_that_probe_off(run_dir, monkeypatch):
    """A bug inside a probe: one warning, the probe goes quiet, training and the rest go on."""
    from tuneup.measure.loader import LoaderProbe

    def broken(*args):
        raise RuntimeError("simulated probe bug")

    monkeypatch.setattr(LoaderProbe, "batch_size", broken)
    # A batch shape the fast path does not handle, so batch_size() runs (and fails).
    ours, agent, truth = warned(loader_for(SlowDataset(size=512), collate_fn=_as_lists), 20, run_dir=run_dir)
    assert [str(w.message) for w in ours] == [
        "tuneup: dataloader probe turned off after an internal error: RuntimeError: simulated probe bug"]
    # Named at the job's own line that fetched the batch (the loop in train()), not at tuneup's
    # or torch's code between it and the probe.
    line = linecache.getline(ours[0].filename, ours[0].lineno)
    assert ours[0].filename == train.__code__.co_filename and "next(iterator)" in line, (ours[0].filename, line)
    snapshot = agent.snapshot()
    assert snapshot["probes"]["dataloader"] == "off"
    assert snapshot["probes"]["optimizer"] == "on"
    assert snapshot["totals"]["steps"] == truth.steps == 20


def test_warnings_made_errors_by_the_job_never_raise_tuneups_into_it(run_dir, monkeypatch):
    """A job that runs with warnings.simplefilter("error") (or -W error): a probe's failure
    inside its loop and a busy port at attach() are shown, and the job trains on, as it does
    without tuneup. Before, the probe's warning raised out of the job's next(iterator), and the
    port's out of attach()."""
    import socket

    from tuneup.measure.loader import LoaderProbe

    def broken(*args):
        raise RuntimeError("simulated probe bug")

    monkeypatch.setattr(LoaderProbe, "batch_size", broken)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, *rest, **kw: shown.append((category, message)))
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with socket.socket() as busy, warnings.catch_warnings():
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        warnings.simplefilter("error")
        with tuneup.attach(run_dir=run_dir, port=busy.getsockname()[1]) as agent:
            truth = train(loader_for(SlowDataset(size=512), collate_fn=_as_lists), model, optimizer, steps=20)
    ours = [str(message) for category, message in shown if category is tuneup.TuneupWarning]
    assert any("in use" in message for message in ours), ours
    assert any("dataloader probe turned off" in message and "simulated probe bug" in message for message in ours), ours
    assert all("probe turned off" not in message.split("error: ", 1)[-1] for message in ours), ours  # no cascade
    assert agent.snapshot()["totals"]["steps"] == truth.steps == 20


def test_a_probe_failing_on_tuneups_own_thread_warns_in_one_line(run_dir, monkeypatch):
    """The host sampler fails on the agent's thread, where no line of the job's led to it: the
    warning is attributed to tuneup itself, so Python prints it as one line with no source line
    under it; training goes on."""
    from tuneup.measure.host import HostProbe

    def broken(self, *args, **kwargs):
        raise RuntimeError("simulated sampler bug")

    monkeypatch.setattr(HostProbe, "sample", broken)
    ours, agent, truth = warned(loader_for(SlowDataset(size=4096, latency=0.0005)), 40, run_dir=run_dir, interval=0.05)
    assert len(ours) == 1 and "simulated sampler bug" in str(ours[0].message), [str(w.message) for w in ours]
    assert (ours[0].filename, ours[0].lineno) == ("tuneup", 0)
    shown = warnings.formatwarning(ours[0].message, ours[0].category, ours[0].filename, ours[0].lineno)
    assert shown.count("\n") == 1 and shown.startswith("tuneup:0: TuneupWarning: tuneup: "), shown
    assert agent.snapshot()["totals"]["steps"] == truth.steps == 40


def test_a_failing_close_listener_stops_sync_sampling_cleanly(run_dir, monkeypatch):
    """A bug in the work done at a step close: one warning, and no sampled step stays open
    (host reads would otherwise be counted, and on CUDA sync debug mode left on, forever)."""
    from tuneup.measure.recorder import Recorder

    def broken(self, step):
        raise RuntimeError("simulated listener bug")

    monkeypatch.setattr(Recorder, "_lifecycle", broken)
    loader, model, optimizer = (loader_for(SlowDataset(size=4096)), mlp(hidden=16), None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, sync_sample_every=1) as agent:
            train(loader, model, optimizer, steps=50, host_reads=1)
            assert not agent.recorder.syncs.sampling and not agent.recorder.syncs.counting_reads
    ours = [str(w.message) for w in caught if issubclass(w.category, tuneup.TuneupWarning)]
    assert ours == ["tuneup: step_close probe turned off after an internal error: RuntimeError: simulated listener bug"]
    probes = agent.snapshot()["probes"]
    assert probes["step_close"] == "off"
    assert probes["syncs"] == "stopped: the step_close listener failed"
    assert agent.snapshot()["totals"]["steps"] == 50


def _scaled_job(steps: int) -> list[float]:
    """A loop touching every replacement: the model's forward, Tensor.backward, zero_grad,
    GradScaler's scale/step/update and host reads (the losses it returns)."""
    torch.manual_seed(0)
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    losses = []
    for x, y in loader_for(SlowDataset(size=512)):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        if len(losses) == steps:
            return losses
    return losses


@pytest.mark.parametrize("module, name, probe", [
    ("tuneup.measure.model", "ModelProbe.tracing", "model"),  # the model class's forward
    ("tuneup.measure.model", "ModelProbe.clock", "model"),  # forward and Tensor.backward
    ("tuneup.measure.optimizer", "OptimizerProbe.clock", "optimizer"),  # zero_grad and the step hooks
    ("tuneup.measure.scaler", "ScalerProbe._measured", "grad_scaler"),  # GradScaler.scale, step and update
    ("tuneup.measure.syncs", "user_frame", "syncs"),  # Tensor host reads
])
def test_a_failing_replacement_turns_its_probe_off_and_never_reaches_the_job(run_dir, monkeypatch, module, name,
                                                                             probe):
    import importlib

    plain = _scaled_job(24)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated probe bug")

    owner = importlib.import_module(module)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, attribute, broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tuneup.attach(run_dir=run_dir, sync_sample_every=1) as agent:
            losses = _scaled_job(24)
    ours = [str(w.message) for w in caught if issubclass(w.category, tuneup.TuneupWarning)]
    assert losses == plain  # the job went on exactly as without tuneup
    assert ours == [f"tuneup: {probe} probe turned off after an internal error: RuntimeError: simulated probe bug"]
    assert agent.snapshot()["probes"][probe] == "off"


def test_a_ctrl_c_in_the_fetchs_bookkeeping_leaves_no_frame_of_tuneups_in_the_traceback(run_dir, monkeypatch):
    """SIGINT's handler raises KeyboardInterrupt wherever the training thread is: here in the
    bookkeeping after a fetch (the loader probe's clock read that ends the data wait, on the
    fifth fetch: hotpath.py loader_next). The traceback the job sees goes from its loop to the handler, as without tuneup."""
    import traceback

    from tuneup.measure.loader import LoaderProbe

    ends = []

    def interrupted_clock():
        caller = sys._getframe(1)
        if "tl.data_wait += clock()" in linecache.getline(caller.f_code.co_filename, caller.f_lineno):
            ends.append(caller.f_lineno)
            if len(ends) == 5:  # the read that ends the fifth fetch's data wait
                raise KeyboardInterrupt
        return time.perf_counter()

    monkeypatch.setattr(LoaderProbe, "clock", staticmethod(interrupted_clock))
    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tuneup.attach(run_dir=run_dir), pytest.raises(KeyboardInterrupt) as raised:
        train(loader_for(SlowDataset(size=512)), model, optimizer, steps=20)
    files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert len(ends) == 5 and files[-1] == __file__, files
    assert not [f for f in files if f"{os.sep}tuneup{os.sep}" in f], files


def test_a_run_directory_that_is_a_file_is_said_so_once_and_training_goes_on(tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("the user's file\n")
    result = subprocess.run([sys.executable, str(PROGRAMS / "fault_job.py"), "--agent", "on", "--snapshot",
                             "--run-dir", str(taken)], capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 0 and "done steps=40" in result.stdout, result.stderr
    [warning] = agent_lines(result.stderr)
    assert f"cannot write {taken}: it or a folder above it is a file, not a directory" in warning, warning
    assert taken.read_text() == "the user's file\n"  # untouched
