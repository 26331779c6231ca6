"""The README's promise: a job under tuneup prints the traceback it prints without it, to the
character: an exception in the model's forward, in a backward and in a Dataset (in the main
process and in DataLoader worker processes), on the first step (while tuneup finds the
models) and later, and a Ctrl-C (SIGINT to the process group) while the job waits in each.

Ground truth is the same script under plain python (tests/programs/failing_train.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, child_env
from tuneup._patching import measured

PROGRAM = str(ROOT / "tests" / "programs" / "failing_train.py")

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 keeps a wrapper's frame (see "
                                                                    "_patching.unwind)")


def environment(tmp_path, **variables):
    return child_env(PYTHONPATH=None, TUNEUP_RUN_DIR=str(tmp_path / "run"), TUNEUP_PORT="0", **variables)


def under(how, *args):
    """The command line: plain python, `tuneup run`, or the script's own tuneup.attach()."""
    if how == "run":
        return [sys.executable, "-m", "tuneup", "run", PROGRAM, *args]
    return [sys.executable, PROGRAM, *args, *(["--attach"] if how == "attach" else [])]


def failed(*commands, env):
    """(exit status, stderr) of each command, run side by side (the suite's time)."""
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for command in commands]
    results = []
    for process in processes:
        _, err = process.communicate(timeout=180)
        results.append((process.returncode, err))
    return results


@pytest.mark.parametrize("args", [
    ("--fail", "forward"),  # the first step: tuneup is finding the models
    ("--fail", "backward"),
    ("--fail", "backward", "--at", "9"),
    ("--fail", "dataset"),
    ("--fail", "dataset", "--at", "9", "--workers", "2"),  # raised in a worker, re-raised in the job
    # inside optimizer.step(closure), where tuneup wraps the closure (and the forward at step 9,
    # past model discovery, on its hooks: as --fail forward --at 9 was without a closure)
    ("--fail", "forward", "--at", "9", "--closure"),
    ("--fail", "backward", "--at", "9", "--closure"),
], ids=lambda args: "-".join(a.lstrip("-") for a in args))
def test_an_exception_prints_the_traceback_it_prints_without_tuneup(tmp_path, args):
    env = environment(tmp_path)
    (status, expected), tuned = failed(under("python", *args), under("run", *args), env=env)
    assert status == 1 and expected.strip().splitlines()[-1].endswith(" failed")  # the script did fail there
    assert tuned == (status, expected)
    assert (tmp_path / "run" / "events.jsonl").exists()  # and tuneup was measuring it


@pytest.mark.parametrize("args", [("--fail", "forward"), ("--fail", "dataset", "--at", "9", "--workers", "2")],
                         ids=("forward", "dataset-workers"))
def test_attached_in_the_script_the_traceback_is_the_same(tmp_path, args):
    env = environment(tmp_path)
    expected, attached = failed(under("python", *args), under("attach", *args), env=env)
    assert attached == expected
    assert (tmp_path / "run" / "events.jsonl").exists()


def interrupted(command, marker, env):
    """Run until the script waits at its marker, then Ctrl-C it (SIGINT to its process group,
    DataLoader workers included, as a terminal sends it)."""
    # A suite started in the background (`pytest &` without job control) ignores SIGINT, and
    # its children inherit that: the script is given the default disposition, as a terminal's
    # foreground job has (Python then installs its KeyboardInterrupt handler).
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the script never reached its marker"
            time.sleep(0.05)
        time.sleep(0.2)  # inside its sleep by now
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    marker.unlink()
    return process.returncode, err


@pytest.mark.parametrize("args", [
    ("--fail", "forward"),
    ("--fail", "backward", "--at", "9"),
    ("--fail", "dataset", "--at", "3"),
    ("--fail", "dataset", "--workers", "2"),  # the job waits in the DataLoader's queue
], ids=lambda args: "-".join(a.lstrip("-") for a in args))
def test_ctrl_c_prints_the_traceback_it_prints_without_tuneup(tmp_path, args):
    """And exits as without tuneup: by SIGINT. The agent's first evaluation is a minute away,
    so its detach at exit is the first to import the rules (dataclasses made by exec(), which
    clears CPython's note of the unhandled KeyboardInterrupt: it exited with status 1 where
    a busy machine held the evaluation back, until _patching.keep_the_interrupted_exit)."""
    env = environment(tmp_path, TUNEUP_INTERVAL="60")
    marker = tmp_path / "waiting"
    full = (*args, "--interrupt", "--marker", str(marker))
    status, expected = interrupted(under("python", *full), marker, env)
    assert status == -signal.SIGINT and expected.splitlines()[-1] == "KeyboardInterrupt"
    assert interrupted(under("run", *full), marker, env) == (status, expected)


def test_a_measured_wrapper_leaves_no_frame_in_a_traceback():
    """The mechanism under every wrapper (posing_as): the frame that re-raises is taken off."""
    import traceback

    def inner():
        raise ValueError("from the wrapped function")

    seen = []
    wrapper = measured(inner, lambda args, kwargs: True, lambda *a: seen.append("after"), seen.append)
    with pytest.raises(ValueError) as raised:
        wrapper()
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert frames == ["test_a_measured_wrapper_leaves_no_frame_in_a_traceback", "inner"]
    assert seen == ["after"]  # `after` still ran, and nothing failed


def test_wrappers_of_one_template_each_pose_as_their_own_function():
    """posing_as compiles a template once and moves its code to each original's file and def
    line: two wrappers of one template share no file, line, name or globals."""
    import torch
    from tuneup import _patching

    def first():
        return 1

    def second():
        return 2

    built = [measured(function, lambda args, kwargs: None, lambda *a: None, lambda error: None)
             for function in (first, second, torch.optim.Optimizer.zero_grad)]
    compiled = len(_patching._factories)
    built.append(measured(first, lambda args, kwargs: None, lambda *a: None, lambda error: None))
    assert len(_patching._factories) == compiled  # the same template and names: not compiled again
    for wrapper, original in zip(built, (first, second, torch.optim.Optimizer.zero_grad, first)):
        code, own = wrapper.__code__, original.__code__
        assert (code.co_filename, code.co_firstlineno, code.co_name, getattr(code, "co_qualname", None)) == (
            own.co_filename, own.co_firstlineno, own.co_name, getattr(own, "co_qualname", None))
        assert {line for _, _, line in code.co_lines() if line is not None} == {own.co_firstlineno}
        assert wrapper.__globals__ is original.__globals__ and wrapper.__wrapped__ is original
    assert [wrapper() for wrapper in built[:2]] == [1, 2]
