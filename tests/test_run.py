"""The zero-code launcher (`tuneup run`): a script runs exactly as under plain python, measured.

Every test starts real interpreters: the launcher execs one, whose start-up imports the bootstrap.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env
from tuneup.launch import LaunchError, exec_script

# The launcher process, as the CLI will run it; ROOT first so that it works from a plain checkout too.
LAUNCHER = ("import sys; sys.path.insert(0, {root!r}); from tuneup.launch import exec_script; "
            "exec_script(sys.argv[1], sys.argv[2:], module={module})")

TRAIN = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    DATA = TensorDataset(torch.randn(240, 8), torch.randn(240, 1))

    def train(**loader_options):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for inputs, targets in DataLoader(DATA, batch_size=8, **loader_options):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
""")


def environment(tmp_path: Path, **variables: str) -> dict[str, str]:
    return child_env(**{"PYTHONPATH": None, "TUNEUP_RUN_DIR": str(tmp_path / "run"), "TUNEUP_PORT": "0", **variables})


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def launcher(target: str | Path, *args: str, module: bool = False) -> list[str]:
    return [sys.executable, "-c", LAUNCHER.format(root=str(ROOT), module=module), str(target), *args]


def launch(target: str | Path, *args: str, env: dict[str, str], module: bool = False,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(launcher(target, *args, module=module), env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def plain(*command: str | Path, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, command)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def end_event(run_dir: Path) -> dict:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "end"
    return events[-1]


def test_script_sees_what_plain_python_gives_it(tmp_path):
    script = write(tmp_path / "job" / "show.py", """
        import json, os, sys
        import tuneup
        agent = tuneup.current()
        print(json.dumps({"argv": sys.argv, "name": __name__, "file": __file__, "path": sys.path,
                          "pid": os.getpid(), "attached": agent is not None and agent.attached,
                          "launch_vars": sorted(k for k in os.environ if k.startswith("TUNEUP_LAUNCH")),
                          "pythonpath": os.environ.get("PYTHONPATH")}))
    """)
    env = environment(tmp_path)
    args = ("a", "--b", "c d")
    expected = json.loads(plain(script, *args, env=env).stdout)
    process = subprocess.Popen(launcher(script, *args), env=env, stdout=subprocess.PIPE, text=True)
    seen = json.loads(process.communicate(timeout=120)[0])

    assert seen["argv"] == expected["argv"] == [str(script), *args]
    assert seen["name"] == "__main__" and seen["file"] == expected["file"]
    assert seen["path"][0] == expected["path"][0] == str(script.parent)
    # Unchanged, apart from the checkout appended where tuneup is not installed.
    assert seen["path"] in (expected["path"], expected["path"] + [str(ROOT)])
    assert seen["pid"] == process.pid, "exec must keep the pid (torchrun supervises this process)"
    assert seen["attached"] and (tmp_path / "run" / "events.jsonl").exists()
    assert seen["launch_vars"] == [] and seen["pythonpath"] is None


@pytest.mark.parametrize("source, status, last_line", [
    ("import sys\nsys.exit(3)\n", 3, None),
    ("import sys\nsys.exit('bad input file')\n", 1, "bad input file"),
    ("def load():\n    raise ValueError('boom')\nload()\n", 1, "ValueError: boom"),
])
def test_exit_status_and_traceback_are_plain_pythons(tmp_path, source, status, last_line):
    script = tmp_path / "fails.py"
    script.write_text(source)
    env = environment(tmp_path)
    expected = plain(script, env=env)
    result = launch(script, env=env)

    assert result.returncode == expected.returncode == status
    assert result.stderr == expected.stderr
    if last_line is not None:
        assert result.stderr.splitlines()[-1] == last_line
    if "raise" in source:
        assert f'File "{script}", line 2, in load' in result.stderr
        assert f'File "{script}", line 3, in <module>' in result.stderr
        text = result.stderr.replace(str(script), "")
        assert "sitecustomize" not in text and "tuneup" not in text


def test_training_job_is_measured(tmp_path):
    script = write(tmp_path / "train.py", TRAIN + "\ntrain()\nprint('trained')\n")
    result = launch(script, env=environment(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "trained\n"
    assert end_event(tmp_path / "run")["totals"]["steps"] == 30


def test_a_clean_end_says_the_findings_and_the_report_command_in_one_line(tmp_path):
    script = write(tmp_path / "train.py", TRAIN + "\ntrain()\n")
    result = launch(script, env=environment(tmp_path))
    assert result.returncode == 0 and result.stdout == "", result.stderr
    line, = result.stderr.splitlines()  # nothing else: no warning from the summary's own reads after detach
    said = re.fullmatch(r"tuneup: (\d+) findings? in 30 steps \((.*)\); the advice: tuneup report (.*)", line)
    assert said and said[3] == str(tmp_path / "run"), line
    # The command it gives prints those findings' advice, the same ones in the same order.
    report = subprocess.run([sys.executable, "-m", "tuneup", "report", said[3], "-f", "json"], env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    rules = [finding["rule"] for finding in json.loads(report.stdout)["findings"]]
    assert int(said[1]) == len(rules) >= 1 and said[2].split(", ")[:4] == rules[:4], (line, rules)
    # After a traceback the job's error stays the last line; a run without steps says nothing.
    failing = write(tmp_path / "fails.py", TRAIN + "\ntrain()\nraise ValueError('after training')\n")
    failed = launch(failing, env=environment(tmp_path))
    assert failed.returncode == 1 and failed.stderr.splitlines()[-1] == "ValueError: after training", failed.stderr


def test_children_do_not_inherit_the_bootstrap(tmp_path):
    script = write(tmp_path / "parent.py", """
        import subprocess, sys
        subprocess.run([sys.executable, "-c", "import os,sys; print(os.environ.get('PYTHONPATH')); "
                        "print('sitecustomize' in sys.modules and 'tuneup' in "
                        "(getattr(sys.modules['sitecustomize'], '__file__', '') or ''))"], check=True)
    """)
    result = launch(script, env=environment(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["None", "False"]


def test_spawned_loader_workers_run_clean(tmp_path):
    script = write(tmp_path / "workers.py", TRAIN + textwrap.dedent("""
        def report(worker_id):
            import os
            # One write a line: two workers' print()s (text, then newline) interleaved in the pipe.
            os.write(1, f"worker {worker_id} PYTHONPATH={os.environ.get('PYTHONPATH')}\\n".encode())

        if __name__ == "__main__":
            train(num_workers=2, multiprocessing_context="spawn", worker_init_fn=report)
    """))
    result = launch(script, env=environment(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["worker 0 PYTHONPATH=None", "worker 1 PYTHONPATH=None"]
    assert end_event(tmp_path / "run")["totals"]["steps"] == 30
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["events.jsonl"]


def test_user_sitecustomize_still_runs(tmp_path):
    site_dir = tmp_path / "site"
    write(site_dir / "sitecustomize.py", "import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    script = write(tmp_path / "job.py", """
        import os, sys
        import tuneup
        print(os.environ.get("USER_SITECUSTOMIZE"), os.environ["PYTHONPATH"], tuneup.current().attached)
        print(sys.modules["sitecustomize"].__file__)
    """)
    result = launch(script, env=environment(tmp_path, PYTHONPATH=str(site_dir)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"ran {site_dir} True", str(site_dir / "sitecustomize.py")]


def test_a_failed_attach_is_one_line_and_the_script_still_runs(tmp_path):
    site_dir = tmp_path / "site"
    write(site_dir / "sitecustomize.py", """
        import sys
        if sys.argv[0].endswith("job.py"):  # in the script's process, not the launcher's
            sys.modules["tuneup"] = None  # importing tuneup now fails
    """)
    script = write(tmp_path / "job.py", "print('ran')\n")
    result = launch(script, env=environment(tmp_path, PYTHONPATH=str(site_dir)))
    assert result.returncode == 0 and result.stdout == "ran\n"
    [line] = result.stderr.splitlines()
    assert line.startswith("tuneup: could not attach: ") and "import of tuneup halted" in line


def test_module_mode_passes_argv_and_exit_status(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "job.py", "import sys\nprint(__name__, sys.argv)\nsys.exit(4)\n")
    env = environment(tmp_path)
    expected = plain("-m", "pkg.job", "x", "--y", env=env, cwd=tmp_path)
    result = launch("pkg.job", "x", "--y", env=env, module=True, cwd=tmp_path)
    assert result.returncode == expected.returncode == 4
    assert result.stdout == expected.stdout == f"__main__ {[str(tmp_path / 'pkg' / 'job.py'), 'x', '--y']}\n"


def test_a_missing_module_is_reported_by_python(tmp_path):
    env = environment(tmp_path)
    expected = plain("-m", "no_such_module", env=env, cwd=tmp_path)
    result = launch("no_such_module", env=env, module=True, cwd=tmp_path)
    assert result.returncode == expected.returncode == 1
    assert result.stderr == expected.stderr and "No module named no_such_module" in result.stderr


def test_a_directory_with_main_runs_like_python_runs_it(tmp_path):
    app = tmp_path / "app"
    write(app / "__main__.py", "import sys\nprint(sys.argv)\n")
    result = launch(app, "go", env=environment(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{[str(app), 'go']}\n"


@pytest.mark.parametrize("target, module, words", [
    ("missing.py", False, ["'missing.py'", "check the path"]),
    (".", False, ["'.'", "directory", "script's path"]),
    ("", True, ["-m", "module name"]),
    ("  ", True, ["-m", "module name"]),
])
def test_bad_targets_fail_before_exec_in_one_line(tmp_path, monkeypatch, target, module, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError) as error:
        exec_script(target, ["--flag"], module=module)
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words)


def test_the_launcher_checks_run_options_without_importing_torch():
    # The launcher imports no torch of its own: the job's interpreter, exec'd next, imports it
    # anyway. Checking --actions once imported apply mode's actions (and so torch) here as well.
    code = ("import sys; sys.modules['torch'] = None; from tuneup.launch.command import run_environment\n"
            "print(run_environment(True, 'dataloader,gc-freeze')['TUNEUP_ACTIONS'])\n"
            "try:\n    run_environment(True, 'all,nope')\nexcept ValueError as exc:\n    print(exc)")
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    chosen, refused = result.stdout.splitlines()
    assert chosen == "dataloader,gc-freeze"
    assert refused.startswith("--actions: unknown action 'nope' (the actions are: dataloader, amp,"), refused
    from tuneup.act.actions import ACTIONS, DEFAULT_ACTIONS  # the ids checked are the actions'
    assert ", ".join(DEFAULT_ACTIONS) in refused and all(name in refused for name in ACTIONS)


def test_disable_leaves_the_script_unmeasured(tmp_path):
    script = write(tmp_path / "job.py", """
        import tuneup
        agent = tuneup.current()
        print(agent is not None and not agent.enabled)
    """)
    result = launch(script, env=environment(tmp_path, TUNEUP_DISABLE="1"))
    assert result.returncode == 0 and result.stdout == "True\n", result.stderr
    assert not (tmp_path / "run").exists()


def test_run_apply_tunes_the_unchanged_script(tmp_path):
    script = write(tmp_path / "job" / "slow.py", """
        import time
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Slow(Dataset):
            def __len__(self):
                return 4096

            def __getitem__(self, index):
                time.sleep(0.0006)  # a read from slow storage
                return torch.full((8,), float(index % 7)), torch.ones(1)

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        for step, (inputs, targets) in enumerate(DataLoader(Slow(), batch_size=16, shuffle=True)):
            optimizer.zero_grad()
            time.sleep(0.006)  # the model's compute, on a GPU as the host sees it
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            if step == 250:
                break
        print("trained")
    """)
    # The premise (a worker overlaps the reads with the step) is built of sleeps and one intra-op
    # thread: with the step's compute spun on the CPU, beside two busy processes the kept change
    # was lost in the full suite (the worker and the spin compete for the same cores).
    env = environment(tmp_path, TUNEUP_INTERVAL="0.2", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "tuneup", "run", "--apply", "--actions", "dataloader", str(script)],
                            env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "trained", result.stderr
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[0]["mode"] == "apply"
    kept = [e for e in events if e["event"] == "action" and e["decision"] == "kept"]
    assert kept and kept[0]["change"].startswith("num_workers 0 -> "), [e for e in events if e["event"] == "action"]
    assert kept[-1]["undone"]["reason"] == "detach"
