"""tuneup reading another process's endpoint (`tuneup report/watch URL`, the node daemon): one
deadline over the whole request and a cap on the body, whatever the server does.

Ground truth: the servers below are written to misbehave in one way each (an answer trickled a
byte at a time, a body larger than the cap, headers that never end), on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from tests.conftest import child_env
from tuneup import fetch


class Misbehaving:
    """A TCP server on a free loopback port that answers every connection with `answer(conn)`."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        try:
            conn.recv(65536)
            self.answer(conn, self.stopped)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()


def trickle_body(conn, stopped):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    while not stopped.wait(0.2):
        conn.sendall(b" ")  # a byte every 0.2 s: every read returns well inside a per-read timeout


def trickle_headers(conn, stopped):
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stopped.wait(0.2):
        conn.sendall(b"X: y\r\n")


def too_large(conn, stopped):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")  # no length: read to the end
    block = b" " * 65536
    for _ in range(64):  # 4 MiB
        conn.sendall(block)


@pytest.fixture
def server(request):
    made = Misbehaving(request.param)
    yield made
    made.close()


@pytest.mark.parametrize("server", [trickle_body, trickle_headers], indirect=True)
def test_a_trickling_server_gets_one_deadline_for_the_whole_request(server):
    # The message comes only from the deadline's path (fetch.request: the timer shut the
    # socket). Run aside so that a hang fails the test instead of holding the suite.
    raised = []

    def fetch_it():
        with pytest.raises(fetch.FetchError, match=r"no complete answer within 1 s"):
            fetch.get(server.url + "/api/run", timeout=1.0)
        raised.append(True)

    worker = threading.Thread(target=fetch_it, daemon=True)
    worker.start()
    worker.join(120)  # the servers would go on for ever
    assert raised == [True]


@pytest.mark.parametrize("server", [too_large], indirect=True)
def test_a_body_over_the_cap_is_refused_without_reading_it_whole(server):
    with pytest.raises(fetch.FetchError, match=r"over the 1048576-byte limit"):
        fetch.get(server.url + "/api/run", timeout=30.0, max_bytes=1 << 20)


@pytest.mark.parametrize("url, says", [
    ("http://[::1", "not a valid URL"),
    ("http://127.0.0.1:abc/", "not a valid URL"),
    ("ftp://127.0.0.1/", r"not an http\(s\) URL"),
    ("http://127.0.0.1:1/" + "a" * 10000, "path is too long"),
])
def test_a_bad_url_is_named(url, says):
    with pytest.raises(fetch.FetchError, match=says):
        fetch.get(url, timeout=5.0)


@pytest.mark.parametrize("server", [trickle_body], indirect=True)
def test_report_against_a_trickling_server_ends_with_one_line(server):
    result = subprocess.run([sys.executable, "-m", "tuneup", "report", server.url], capture_output=True, text=True,
                            env=child_env(), timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("tuneup: ") and result.stderr.count("\n") == 1, result.stderr
    assert "no complete answer within 5 s" in result.stderr and "Traceback" not in result.stderr


JOB = """
import torch, tuneup
from torch import nn
tuneup.attach(push_gateway={gateway!r}, push_interval=1.0, serve=False, log=False)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(0)
for step in range(40):
    optimizer.zero_grad()
    loss = model(torch.randn(16, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
print("trained", round(loss.item(), 6))
"""


@pytest.mark.parametrize("server", [trickle_body, trickle_headers], indirect=True)
def test_a_trickling_pushgateway_cannot_keep_the_job_from_exiting(server, tmp_path):
    # Ground truth: the job trains 40 steps and prints its last loss; the gateway never
    # completes an answer. Its exit is bounded by push.py's join (TIMEOUT + 1 s) and the final
    # push (FINAL_TIMEOUT).
    script = tmp_path / "job.py"
    script.write_text(JOB.format(gateway=server.url))
    plain = subprocess.run([sys.executable, "-c", JOB.replace("tuneup.attach(", "(lambda **_: None)(")
                            .format(gateway=server.url)], capture_output=True, text=True, env=child_env(), timeout=120)
    # A hang is the 120 s timeout (before: for ever, with headers that never end).
    tuned = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=child_env(), timeout=120)
    assert (tuned.returncode, tuned.stdout) == (plain.returncode, plain.stdout) == (0, plain.stdout)
    assert "cannot push metrics to the Pushgateway" in tuned.stderr
