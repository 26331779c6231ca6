"""Pushing the agent's metrics to a Prometheus Pushgateway: for jobs too short (or too
firewalled) to be scraped. prometheus-client's own `push_to_gateway` builds the request;
tuneup's fetch.push_handler sends it under one deadline.

The group is `job=<push_job>, instance=<host>, rank=<rank>`: a job's next run replaces its
previous values (what a batch job wants from a Pushgateway), ranks never overwrite each
other. Pushes run on their own daemon thread every `push_interval` and once more at detach,
so the final counters land. An unreachable gateway costs one warning; pushing goes on trying.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

from prometheus_client import CollectorRegistry, push_to_gateway

from .. import redact
from ..fetch import push_handler

TIMEOUT = 5.0
FINAL_TIMEOUT = 2.0  # detach must not hold up the end of the job


class Pusher:
    def __init__(self, gateway: str, job: str, registry: CollectorRegistry, rank: int | None, interval: float,
                 warn: Callable[[str, str], None]) -> None:
        self.gateway = gateway
        self.job = job
        self.registry = registry
        self.interval = interval
        self.warn = warn
        self.grouping = {"instance": socket.gethostname(), "rank": str(rank or 0)}
        self.pushes = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tuneup-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.push(TIMEOUT)

    def push(self, timeout: float) -> bool:
        try:
            push_to_gateway(self.gateway, job=self.job, registry=self.registry, grouping_key=self.grouping,
                            timeout=timeout, handler=push_handler)  # one deadline per push: a slow
            # gateway cannot hold the job's exit (prometheus-client's own timeout is per read)
        except Exception as exc:
            self.failures += 1
            self.warn("push", f"cannot push metrics to the Pushgateway at {redact.url(self.gateway)} "
                              f"({type(exc).__name__}: {exc}); training goes on and pushing keeps trying "
                              "(check TUNEUP_PUSH_GATEWAY)")
            return False
        self.pushes += 1
        return True

    def cancel(self) -> None:
        """Stop the thread; push nothing more."""
        self._stop.set()

    def stop(self) -> None:
        """Stop the thread and push the final values once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT + 1)
        self.push(FINAL_TIMEOUT)
