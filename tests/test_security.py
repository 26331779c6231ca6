"""What tuneup's endpoints, logs and reports give away (issue: secrets and browsers).

A script started under `tuneup run` with credentials on its command line, beside `tuneup daemon`
and a real Pushgateway on loopback: no secret reaches any output. The endpoints of the agent
and the daemon answer GET and HEAD for this machine's names only; run directories and logs are
their owner's."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS, child_env, start_daemon, start_pushgateway, wait_for
from tuneup import redact
from tuneup.export import discovery

SECRETS = ("SECRET123", "SECRET456", "SECRET789", "SECRETVALUE")
ARGS = ["--secs", "10", "--api-key=SECRET123", "--token", "SECRET456", "--data",
        "https://user:SECRET789@example.com/x", "positional-SECRETVALUE"]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def request(url: str, method: str = "GET", host: str | None = None) -> tuple[int, dict, str]:
    address = url.split("//", 1)[1].split("/", 1)[0]
    name, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(name, int(port), timeout=10)
    connection.request(method, "/api/run", headers={"Host": host} if host else {})
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), response.read().decode(errors="replace")


def start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def leaks(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


@pytest.fixture
def pushgateway(tmp_path):
    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        yield None
        return
    process, url = start_pushgateway(binary, tmp_path)
    yield url
    process.terminate()
    process.wait(10)


def test_a_secret_on_the_command_line_reaches_no_output(tmp_path, pushgateway):
    registry, run_dir = tmp_path / "agents", tmp_path / "runs"
    env = child_env(TUNEUP_REGISTRY_DIR=str(registry), TUNEUP_RUN_DIR=str(run_dir), TUNEUP_PORT="0",
                    TUNEUP_INTERVAL="0.2", TUNEUP_NVML_MODULE="tests.fake_nvml", TUNEUP_REDACT="value:SECRETVALUE",
                    **({"TUNEUP_PUSH_GATEWAY": pushgateway.removeprefix("http://"), "TUNEUP_PUSH_INTERVAL": "1"}
                       if pushgateway else {}))
    daemon, daemon_url = start_daemon(registry, env)
    job = start([sys.executable, "-m", "tuneup", "run", str(PROGRAMS / "secret_args.py"), *ARGS], env)
    outputs: dict[str, str] = {}
    try:
        agent = wait_for(lambda: discovery.live_agents(registry))[0]
        url = agent["url"]
        wait_for(lambda: "tuneup_step_seconds_count" in get(url + "/metrics"))
        outputs["registry"] = "".join(p.read_text() for p in registry.iterdir() if p.is_file())
        outputs["agent /api/run"] = get(url + "/api/run")
        outputs["agent /metrics"] = get(url + "/metrics")
        outputs["daemon /api/agents"] = wait_for(lambda: (lambda text: text if agent["run_id"] in text else None)(
            get(daemon_url + "/api/agents")))
        outputs["daemon /api/run"] = get(daemon_url + "/api/run")
        outputs["daemon /metrics"] = get(daemon_url + "/metrics")
        paths = [job["path"] for job in json.loads(outputs["daemon /api/run"])["jobs"]]
        assert paths == [f"/jobs/{agent['run_id']}"]
        outputs["daemon /jobs/<id>/api/run"] = get(daemon_url + paths[0] + "/api/run")
        live = subprocess.run([sys.executable, "-m", "tuneup", "report", url, "--format", "json"], capture_output=True,
                              text=True, env=env, timeout=60)
        outputs["report URL json"] = live.stdout + live.stderr
        # The endpoints: read-only, this machine's names only (agent and daemon alike).
        for where in (url, daemon_url):
            status, _, body = request(where, host="attacker.example")
            assert status == 403 and "not this machine" in body, (where, status, body)
            assert request(where, host="attacker.example:80")[0] == 403
            for method in ("POST", "PUT", "DELETE"):
                status, headers, _ = request(where, method)
                assert status == 405 and headers.get("Allow") == "GET, HEAD", (where, method, status)
            status, headers, body = request(where, "HEAD")
            assert status == 200 and body == ""
            for host in ("127.0.0.1", "localhost", f"127.0.0.1:{where.rsplit(':', 1)[1]}", socket.gethostname()):
                assert request(where, host=host)[0] == 200, host
            assert "Access-Control-Allow-Origin" not in request(where)[1]
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-2000:]
        assert out.startswith("done ")
    finally:
        job.kill()
        daemon.terminate()
        daemon.wait(10)
    if pushgateway:
        outputs["pushgateway /metrics"] = get(pushgateway + "/metrics")
        assert "tuneup_step_seconds_count" in outputs["pushgateway /metrics"]
    folder = run_dir
    for log in folder.iterdir():
        outputs[f"run log {log.name}"] = log.read_text()
    for format in ("text", "markdown", "json", "html"):
        done = subprocess.run([sys.executable, "-m", "tuneup", "report", str(folder), "--format", format],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs[f"report {format}"] = done.stdout
    assert {name: leaks(text) for name, text in outputs.items() if leaks(text)} == {}
    # The redacted command line is still there, recognizably.
    header = json.loads(next(line for line in outputs[next(k for k in outputs if k.startswith("run log"))].splitlines()))
    assert header["argv"][1:] == ["--secs", "10", "--api-key=<redacted>", "--token", "<redacted>", "--data",
                                  "https://<redacted>@example.com/x", "positional-<redacted>"]
    # Owner-only files on a shared machine.
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(log.stat().st_mode) for log in folder.iterdir()} == {0o600}


@pytest.mark.parametrize("argv, expected", [
    (["--password", "p4ss", "--lr", "0.1"], ["--password", "<redacted>", "--lr", "0.1"]),
    (["--HF_TOKEN=hf_x", "--auth-header", "Bearer x"], ["--HF_TOKEN=<redacted>", "--auth-header", "<redacted>"]),
    (["db.credentials=abc", "trainer.max_steps=10"], ["db.credentials=<redacted>", "trainer.max_steps=10"]),
    (["AWS_SECRET_ACCESS_KEY=x", "--secret-file", "/run/secrets/k"], ["AWS_SECRET_ACCESS_KEY=<redacted>",
                                                                      "--secret-file", "<redacted>"]),
    (["--data", "s3://AKIA:x@bucket/key", "--keep"], ["--data", "s3://<redacted>@bucket/key", "--keep"]),
    (["--flag", "--apikey", "--next"], ["--flag", "--apikey", "--next"]),  # no value to hide
])
def test_command_lines_are_redacted_in_each_form(argv, expected):
    assert redact.argv(argv, {}) == expected


def test_a_wider_mode_for_shared_analysis_is_an_option(tmp_path):
    import tuneup

    with tuneup.attach(run_dir=tmp_path / "run", serve=False, log_shared=True) as agent:
        pass
    path = Path(agent.state.run_log)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and stat.S_IMODE(path.parent.stat().st_mode) == 0o750


def test_the_training_job_label_hides_what_tuneup_redact_lists(monkeypatch):
    from tuneup.measure.state import run_info

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "vault-7.internal")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "exp")
    assert run_info("advise")["training_job"] == "exp:vault-7.internal:29500"
    monkeypatch.setenv("TUNEUP_REDACT", "value:vault-7.internal")
    assert run_info("advise")["training_job"] == "exp:<redacted>:29500"
