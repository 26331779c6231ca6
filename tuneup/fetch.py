"""HTTP requests with one deadline over all of each, and a cap on the answer's body.

urllib's `timeout` bounds each socket operation, not the request: a server that answers one
byte a second never times out, and `read()` takes a body of any size. Here the whole request
(connect, headers, body) has one deadline: a timer shuts the socket down when it passes, which
ends any read blocked in it at once; the body is read a chunk at a time (`read1`: what one
receive returns) and refused past `max_bytes`. Used wherever tuneup talks to another process:
`tuneup report/watch URL`, the node daemon's reads of its agents, and pushes to a Pushgateway
(`push_handler`, prometheus-client's handler interface), so a slow gateway cannot keep a
finished job from exiting.
"""

from __future__ import annotations

import http.client
import socket
import threading
from urllib.parse import urlsplit

MAX_BODY = 64 * 1024 * 1024  # a run's /api/run is a few MB at most; /metrics far less


class FetchError(OSError):
    """The request failed: `reason` says how, in words for one line."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def get(url: str, timeout: float, max_bytes: int = MAX_BODY) -> bytes:
    """The body of a 200 answer to GET `url`, within `timeout` seconds in all; FetchError
    otherwise (a bad URL, no answer, an HTTP error status, too slow, too large)."""
    return request(url, timeout, max_bytes=max_bytes, accept=(200,))


def push_handler(url: str, method: str, timeout: float | None, headers: list[tuple[str, str]],
                 data: bytes):
    """prometheus_client's push handler interface (exposition.default_handler's signature):
    the same request, under one deadline (default_handler's urllib timeout is per read)."""
    def handle() -> None:
        request(url, timeout or 30.0, method=method, headers=dict(headers), data=data, max_bytes=1 << 20,
                accept=range(200, 400))

    return handle


def request(url: str, timeout: float, *, method: str = "GET", headers: dict[str, str] | None = None,
            data: bytes | None = None, max_bytes: int = MAX_BODY, accept=(200,)) -> bytes:
    """The body of the answer to `method url`, when its status is in `accept`."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # http://[::1 , http://host:abc/
        raise FetchError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not host:
        raise FetchError("not an http(s) URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if len(path) > 8192:
        raise FetchError("the URL's path is too long")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(host, port, timeout=timeout)
    too_slow = f"no complete answer within {timeout:g} s"
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sock = connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a recv blocked in it returns now
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        connection.request(method, path, body=data, headers={"Accept-Encoding": "identity", **(headers or {})})
        response = connection.getresponse()
        if response.status not in accept:
            raise FetchError(f"HTTP {response.status}", status=response.status)
        declared = response.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > max_bytes:
            raise FetchError(f"its answer is {int(declared)} bytes, over the {max_bytes}-byte limit")
        chunks, size = [], 0
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise FetchError(f"its answer is over the {max_bytes}-byte limit")
            chunks.append(chunk)
        if expired.is_set():  # the shut socket ended the body early
            raise FetchError(too_slow)
        return b"".join(chunks)
    except FetchError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set():
            raise FetchError(too_slow) from None
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise FetchError(str(reason)) from None
    finally:
        timer.cancel()
        connection.close()
