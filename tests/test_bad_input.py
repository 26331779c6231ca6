"""Bad input, generated (issue 20): every command's options, `TUNEUP_*` under `tuneup run`, and
what an endpoint answers `tuneup watch`, each in its own process with a timeout.

For a command: exit 0 (the value happened to be valid) or 2 with one line on stderr naming
the problem; never "internal error" (exit 1 is for tuneup's own bugs), never a hang, memory
bounded. For `TUNEUP_*`: the training job's stdout (its losses) and exit code equal plain
python's, whatever the value. Hypothesis draws the values (fixed seed: CI runs the same
cases); the counts per category are in the session's closing note."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import child_env

MAX_RSS_BYTES = 2 * 1024 ** 3  # a command's peak (torch imported): far under what a runaway read takes
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values people mistype or that break parsers: empty, blank, non-numbers that parse as floats,
# out-of-range numbers, huge, unicode, control characters, paths and URLs gone wrong.
ODD = st.sampled_from(["", " ", "nan", "inf", "-inf", "-1", "0", "1e309", "99999999999999999999", "1.5", "0x10",
                       "yes please", "None", "true", "../..", "/dev/null", "/nonexistent/x", "http://[::1",
                       "http://127.0.0.1:abc/", "x" * 5000, "\u00e9\u00e8", "\U0001f4a5", "a,b,,c", "--help", "-"])
VALUES = st.one_of(ODD, st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                                max_size=12))


def run_measured(argv, *, env, timeout=60.0, cwd=None):
    """Run argv; (exit code, stdout, stderr, peak RSS bytes). A hang is a failure: killed at
    `timeout` with its process group."""
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    out: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda name, pipe: out.__setitem__(name, pipe.read()), args=(name, pipe),
                                daemon=True) for name, pipe in (("out", process.stdout), ("err", process.stderr))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            os.wait4(process.pid, 0)
            pytest.fail(f"{argv[3:]} did not end within {timeout:.0f} s")
        time.sleep(0.02)
    process.returncode = os.waitstatus_to_exitcode(status)
    for reader in readers:
        reader.join(10)
    return (process.returncode, out.get("out", b"").decode(errors="replace"),
            out.get("err", b"").decode(errors="replace"), usage.ru_maxrss * 1024)


def assert_clear(code, stderr, rss, what):
    assert code in (0, 2), (what, code, stderr[-2000:])
    assert "internal error" not in stderr and "Traceback" not in stderr, (what, stderr[-2000:])
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tuneup: "), (what, stderr)
    assert rss < MAX_RSS_BYTES, (what, rss)


def tuneup(*args):
    return [sys.executable, "-m", "tuneup", *args]


# (command, option) -> what else the command needs to reach the option's use without running
# for long: a run directory that does not exist, a port nothing listens on.
NOWHERE = "http://127.0.0.1:9/"
OPTIONS = [
    ("report", "--format", ["/nonexistent-run"]), ("report", "--window", ["/nonexistent-run"]),
    ("report", "--silence", ["/nonexistent-run"]), ("report", "--output", ["/nonexistent-run"]),
    ("report", None, []),  # the target itself
    ("watch", "--interval", [NOWHERE, "--once"]), ("watch", None, ["--once"]),
    # A second option always invalid: a value that happens to be valid does not start a job.
    ("demo", "--steps", ["--workers", "-1"]), ("demo", "--workers", ["--steps", "1"]), ("demo", "--run-dir", ["--steps", "1"]),
    ("daemon", "--port", ["--registry-dir", "/etc/hostname"]), ("daemon", "--host", ["--port", "x"]),
    ("daemon", "--registry-dir", ["--port", "-5"]),
    ("rules", "--format", []), ("run", "--actions", ["--apply", "/nonexistent/train.py"]),
    ("run", None, []),  # the script
]


@settings(max_examples=24, **SETTINGS)
@given(case=st.sampled_from(OPTIONS), value=VALUES)
def test_a_bad_option_value_is_one_line_and_exit_2(case, value, tmp_path):
    command, option, rest = case
    argv = tuneup(command, *rest, *([option, value] if option else [value]))
    code, _, stderr, rss = run_measured(argv, env=child_env(), cwd=tmp_path, timeout=90)
    assert_clear(code, stderr, rss, argv[3:])


JOB = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(30):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    print(f"{step} {loss.item():.6f}")
raise SystemExit(3)
"""

ENVIRONMENT = ["TUNEUP_ACTIONS", "TUNEUP_CPU_BF16", "TUNEUP_DETAIL_EVERY", "TUNEUP_DISABLE", "TUNEUP_GPU",
               "TUNEUP_HOST", "TUNEUP_INTERVAL", "TUNEUP_LOG", "TUNEUP_LOG_MAX_BYTES", "TUNEUP_LOG_SHARED",
               "TUNEUP_MODE", "TUNEUP_NVML_MODULE", "TUNEUP_PORT", "TUNEUP_PUSH_GATEWAY", "TUNEUP_PUSH_INTERVAL",
               "TUNEUP_PUSH_JOB", "TUNEUP_RUN_DIR", "TUNEUP_SERVE", "TUNEUP_SILENCE", "TUNEUP_SYNC_SAMPLE_EVERY",
               "TUNEUP_TRAINING_JOB", "TUNEUP_WINDOW_STEPS", "TUNEUP_REGISTRY_DIR"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's script and what plain python prints and exits with."""
    folder = tmp_path_factory.mktemp("job")
    script = folder / "train.py"
    script.write_text(JOB)
    plain = subprocess.run([sys.executable, str(script)], env=child_env(), capture_output=True, text=True,
                           timeout=120, cwd=folder)
    assert plain.returncode == 3 and len(plain.stdout.splitlines()) == 30, plain.stderr
    return script, plain


@settings(max_examples=8, **SETTINGS)
@given(variable=st.sampled_from(ENVIRONMENT), value=VALUES)
def test_a_bad_tuneup_setting_leaves_the_job_as_plain_python_runs_it(job, variable, value, tmp_path):
    script, plain = job
    env = child_env(**{variable: value, "TUNEUP_RUN_DIR": os.environ.get("TUNEUP_RUN_DIR")})
    if variable != "TUNEUP_RUN_DIR":
        env["TUNEUP_RUN_DIR"] = str(tmp_path / "run")
    code, stdout, stderr, rss = run_measured(tuneup("run", str(script)), env=env, cwd=tmp_path, timeout=120)
    assert (code, stdout) == (plain.returncode, plain.stdout), (variable, value, stderr[-2000:])
    assert "internal error" not in stderr and "Traceback (most recent call last)" not in stderr, stderr[-2000:]
    assert rss < MAX_RSS_BYTES


class Answer(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.server.body
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=12)
EVENT = st.fixed_dictionaries({"event": st.sampled_from(["run", "config", "system", "steps", "warning", "action",
                                                         "end", "other"])}, optional={"x": JSON})
PAYLOADS = st.one_of(
    JSON,
    st.fixed_dictionaries({"events": st.lists(st.one_of(EVENT, JSON), max_size=5)},
                          optional={"attached": JSON, "findings": JSON}),
    st.fixed_dictionaries({"daemon": st.just(True), "jobs": st.lists(
        st.fixed_dictionaries({"path": st.text(max_size=6)}, optional={"payload": JSON, "agent": JSON, "group": JSON}),
        max_size=3)}),
)


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    server.body = b"{}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@settings(max_examples=10, **SETTINGS)
@given(payload=PAYLOADS, command=st.sampled_from(["watch", "report"]))
def test_whatever_an_endpoint_answers_watch_and_report_say_one_line(endpoint, payload, command):
    endpoint.body = json.dumps(payload).encode()
    url = f"http://127.0.0.1:{endpoint.server_address[1]}"
    argv = tuneup(command, url, *(["--once"] if command == "watch" else []))
    code, _, stderr, rss = run_measured(argv, env=child_env(), timeout=60)
    assert_clear(code, stderr, rss, (command, payload))


LONG = "a" * 5000  # over any file system's name limit (ENAMETOOLONG where the OS looks it up)


@pytest.mark.parametrize("args, says", [
    (["report", "http://[::1"], "is not a URL tuneup can read"),
    (["report", LONG], "File name too long"),
    (["run", LONG], "File name too long"),
    (["daemon", "--port", "0", "--no-gpu", "--registry-dir", LONG], "File name too long"),
    (["run", "--bogus", "train.py"], "no option --bogus for tuneup run"),
    (["report", "http://user:secret@127.0.0.1:9/"], "<redacted>@"),
    (["report", "ftp://127.0.0.1/"], "is a ftp URL: tuneup reads a run directory"),
    # Before the demo trains, not a warning after it: the run log asked for cannot be written.
    (["demo", "--run-dir", "/etc/hostname"], "/etc/hostname is not a directory: name a directory"),
    (["demo", "--run-dir", "/etc/hostname/run"], "cannot be made: /etc/hostname is not a directory"),
    (["demo", "--run-dir", LONG], "File name too long"),
])
def test_paths_and_urls_the_os_or_the_parser_refuse_are_one_short_line(args, says, tmp_path):
    """Paths drawn above seldom reach these (the audit found each by hand): a name too long for
    the file system, a URL urllib cannot parse, an option `run` does not have; the line quotes
    the user's text cut short and without a URL's password."""
    code, _, stderr, rss = run_measured(tuneup(*args), env=child_env(), cwd=tmp_path)
    assert code == 2 and says in stderr, stderr
    assert_clear(code, stderr, rss, args)
    assert len(stderr) < 800 and "secret" not in stderr, stderr


def test_a_registry_dir_too_long_for_the_os_is_named_by_watch(tmp_path):
    code, _, stderr, rss = run_measured(tuneup("watch", "--once"), env=child_env(TUNEUP_REGISTRY_DIR=LONG), cwd=tmp_path)
    assert code == 2 and "(TUNEUP_REGISTRY_DIR) cannot be read: File name too long" in stderr, stderr
    assert_clear(code, stderr, rss, "watch")


def as_another_user(argv):
    """argv run by a user who is not root (root reads whatever the mode bits say), or None."""
    if os.getuid() != 0:
        return argv
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--user", "--map-user=1000", "--map-group=1000", "true"],
                                         capture_output=True).returncode != 0:
        return None
    return [unshare, "--user", "--map-user=1000", "--map-group=1000", *argv]


@pytest.mark.parametrize("args, says", [
    (["run", "{locked}/train.py"], "cannot open the script"),
    (["report", "{locked}/run/x"], "cannot read"),
    (["daemon", "--port", "0", "--no-gpu", "--registry-dir", "{locked}/agents"], "cannot be read"),
])
def test_a_path_behind_a_folder_this_user_may_not_search_is_permission_denied(args, says, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "train.py").write_text("print('trained')\n")
    locked.chmod(0)
    try:
        argv = as_another_user(tuneup(*(arg.format(locked=locked) for arg in args)))
        if argv is None:
            pytest.skip("root, and no user namespace to drop it in")
        code, _, stderr, rss = run_measured(argv, env=child_env(), cwd=tmp_path)
    finally:
        locked.chmod(0o755)
    assert code == 2 and says in stderr and "Permission denied" in stderr, stderr
    assert_clear(code, stderr, rss, args)
