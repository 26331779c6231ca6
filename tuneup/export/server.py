"""The agent's loopback HTTP endpoint: Prometheus metrics and the run for the CLI.

    /metrics     Prometheus exposition (prometheus-client's own WSGI app)
    /api/run     the run's events and current findings, as JSON (`tuneup report URL`, `watch`)
    /api/health  liveness

Served by the standard library's WSGI server on a daemon thread, one thread per request
(as prometheus-client's own start_http_server does), bound to 127.0.0.1 unless asked. A
busy port is reported once and the agent serves on a free port instead, so the job goes on
and the registry still tells the CLI and the node daemon where to find it.

Every endpoint (the agent's and the node daemon's) is read-only and answers only requests
addressed to this machine (`guarded`): GET and HEAD, else 405 with `Allow`; a `Host` header
that names another machine gets 403, as Jupyter and TensorBoard answer it, so a web page the
user opens cannot read the endpoints through DNS rebinding (its requests carry the attacker's
host name). Allowed: loopback names, IP addresses (DNS cannot rebind an address), the address
the endpoint is bound to, this machine's host name, and the names in TUNEUP_ALLOWED_HOSTS
(comma-separated: a Kubernetes service name that Prometheus scrapes, say). No CORS headers.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import selectors
import socket
import socketserver
import threading
import time
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .runlog import json_safe

RunPayload = Callable[[], dict[str, Any]]
METHODS = ("GET", "HEAD")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _host_name(header: str) -> str:
    """The name in a Host header, without its port and brackets, lower case."""
    name = header.strip().lower()
    if name.startswith("["):  # [::1]:9477
        return name[1:name.find("]")] if "]" in name else name[1:]
    if name.count(":") == 1:
        name = name.split(":", 1)[0]
    return name.rstrip(".")


def allowed_host(header: str | None, bound: str, extra: Iterable[str] = ()) -> bool:
    """Whether a request's Host header names this machine (see the module docstring)."""
    if not header:
        return True  # a client that sends none is no browser: every browser sends it
    name = _host_name(header)
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    known = {bound.lower(), socket.gethostname().lower(), *(host.strip().lower() for host in extra)}
    return name in known - {""}


def guarded(app: Callable, bound: str) -> Callable:
    """`app`, read-only and for this machine's names only (see the module docstring)."""
    extra = tuple(part for part in os.environ.get("TUNEUP_ALLOWED_HOSTS", "").split(",") if part.strip())

    def guard(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in METHODS:
            body = f"tuneup endpoints are read-only: {method} is not served (use GET)\n".encode()
            start_response("405 Method Not Allowed", [("Allow", ", ".join(METHODS)), ("Content-Length", str(len(body))),
                                                      ("Content-Type", "text/plain; charset=utf-8")])
            return [body]
        host = environ.get("HTTP_HOST")
        if not allowed_host(host, bound, extra):
            body = (f"tuneup: Host {host!r} is not this machine: refused (DNS rebinding protection; "
                    "add the name to TUNEUP_ALLOWED_HOSTS if it is yours)\n").encode()
            start_response("403 Forbidden", [("Content-Length", str(len(body))),
                                             ("Content-Type", "text/plain; charset=utf-8")])
            return [body]
        answer = app(environ, start_response)
        if method == "HEAD":  # the GET's status and headers, no body
            close = getattr(answer, "close", None)
            if close is not None:
                close()
            return []
        return answer

    return guard


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    timeout = 0  # handle_request() is called once select() says a request is there


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # never write to the job's stderr
        pass


def json_response(start_response: Callable, payload: Any, status: str = "200 OK") -> Iterable[bytes]:
    body = json.dumps(payload, default=str, allow_nan=False).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def text_response(start_response: Callable, text: str, status: str = "200 OK") -> Iterable[bytes]:
    body = text.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


class HttpEndpoint:
    """A WSGI app served on a daemon thread; `url` is where it listens once started."""

    def __init__(self, app: Callable[[dict[str, Any], Callable], Iterable[bytes]]) -> None:
        self.app = app
        self._server: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def start(self, host: str, port: int, fallback: bool = True) -> str | None:
        """Listen on host:port, or (with `fallback`) on a free port when that one is taken.
        Returns a note for the user when the requested port was busy."""
        note = None
        app = guarded(self.app, host)
        try:
            self._server = make_server(host, port, app, _ThreadingServer, _QuietHandler)
        except OSError as exc:
            if not fallback or exc.errno != errno.EADDRINUSE or port == 0:
                raise
            self._server = make_server(host, 0, app, _ThreadingServer, _QuietHandler)
            note = (f"port {port} on {host} is in use (another job?); serving on port "
                    f"{self._server.server_port} instead (set TUNEUP_PORT to choose one)")
        self.url = f"http://{_url_host(host)}:{self._server.server_port}"
        self._wake_read, self._wake_write = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, args=(self._server, self._wake_read),
                                        name="tuneup-http", daemon=True)
        self._thread.start()
        return note

    @staticmethod
    def _serve(server: _ThreadingServer, wake: socket.socket) -> None:
        """Answer requests until `wake` becomes readable. Unlike serve_forever, which polls
        (and so makes stop() wait up to a poll interval, and wakes the process 20 times a
        second), this sleeps in select() until a request or the stop comes."""
        with selectors.DefaultSelector() as selector:
            selector.register(server, selectors.EVENT_READ)
            selector.register(wake, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is wake:
                        return
                    server.handle_request()  # ready: it accepts without waiting (timeout 0)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._wake_write.send(b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        server.server_close()
        self._wake_read.close()
        self._wake_write.close()

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited sockets, touch nothing else."""
        if self._server is not None:
            for sock in (self._server.socket, self._wake_read, self._wake_write):
                try:
                    sock.close()
                except OSError:
                    pass
            self._server = None


class CachedApp:
    """prometheus-client's WSGI app, its answers kept for `seconds` per (format, encoding)
    asked for. The agent's figures change once per sampling interval: scrapers asking more
    often than that (several Prometheus replicas, a `watch curl`) get the same bytes without
    rendering them again on the training process's GIL."""

    def __init__(self, app: Callable, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        self._lock = threading.Lock()
        self._kept: dict[tuple, tuple[float, str, list, bytes]] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        key = (environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""), environ.get("QUERY_STRING", ""))
        with self._lock:  # one render at a time; the others wait for it and reuse it
            now = time.monotonic()
            kept = self._kept.get(key)
            if kept is None or now - kept[0] >= self.seconds:
                answer: list[Any] = []

                def capture(status: str, headers: list, exc_info: Any = None) -> None:
                    answer[:] = [status, headers]

                body = b"".join(self.app(environ, capture))
                kept = self._kept[key] = (now, answer[0], answer[1], body)
        start_response(kept[1], kept[2])
        return [kept[3]]


class Throttled:
    """Answers at most one request per `gap` seconds, the others wait their turn (asleep,
    without the GIL). An agent lives in the training process: however hard something polls
    it, the loop keeps the interpreter (20 answers a second is far beyond what Prometheus or
    `tuneup watch` ask for)."""

    def __init__(self, app: Callable, gap: float) -> None:
        self.app = app
        self.gap = gap
        self._lock = threading.Lock()
        self._last = 0.0

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        with self._lock:
            wait = self._last + self.gap - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._last = time.monotonic()
        return self.app(environ, start_response)


ANSWER_GAP = 0.05


class AgentServer(HttpEndpoint):
    """Serves one agent."""

    def __init__(self, run_payload: RunPayload, registry: Callable[[], Any], fresh_for: float = 0.0) -> None:
        """`registry()`: the Prometheus registry to serve, asked for at the first scrape (a job
        nobody scrapes never imports prometheus-client's exposition)."""
        super().__init__(Throttled(self.route, ANSWER_GAP))
        self._run_payload = run_payload
        self._registry = registry
        self._fresh_for = fresh_for
        self._metrics_app: Callable | None = None

    def _metrics(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        if self._metrics_app is None:
            from prometheus_client import make_wsgi_app

            app = make_wsgi_app(self._registry())
            self._metrics_app = CachedApp(app, self._fresh_for) if self._fresh_for > 0 else app
        return self._metrics_app(environ, start_response)

    def route(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/api/run":
            try:
                return json_response(start_response, json_safe(self._run_payload()))
            except Exception as exc:  # never let a request take the agent down
                return json_response(start_response, {"error": f"{type(exc).__name__}: {exc}"},
                                     "500 Internal Server Error")
        if path == "/api/health":
            return json_response(start_response, {"ok": True})
        if path == "/":
            return text_response(start_response, "tuneup agent: /metrics (Prometheus), /api/run (tuneup report/watch), "
                                                  "/api/health\n")
        return json_response(start_response, {"error": f"no such endpoint: {path}"}, "404 Not Found")


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
