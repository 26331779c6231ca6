"""The node daemon (`tuneup daemon`): one endpoint for every tuneup agent on the node.

    /metrics               every live agent's series (each with its `run_id`), the node's
                           GPUs (tuneup_node_gpu_*) and the daemon's own health
    /api/agents            the live agents, as JSON
    /api/run               every running job's events and findings (`tuneup report URL`, `watch`)
    /jobs/<run_id>/api/run one job's (what `tuneup report URL/jobs/<run_id>` reads)
    /api/health            liveness

Agents are found through their registry entries (export/discovery.py) at every request, so
agents that start or die between scrapes are simply there or not: a dead or hung agent is an
`tuneup_daemon_agent_up 0` for as long as its entry lasts, never an error for the others.
Agents are read over their own loopback HTTP endpoints, in parallel, with a timeout; their
expositions are parsed with prometheus-client's parser and merged family by family.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..fetch import get
from ..measure.gpu import NoGpus, open_gpus
from . import discovery
from .metrics import Families, gpu_families, gpu_info
from .server import HttpEndpoint, json_response, text_response

READ_TIMEOUT = 2.0  # per agent; a hung agent costs one scrape this long, never more
MAX_PARALLEL = 16

log = logging.getLogger("tuneup.daemon")


class NodeGpus:
    """The node's GPUs through NVML, read at scrape time; an NVML error turns them off with
    one log line (the agents' own GPU series go on)."""

    def __init__(self, module: str, enabled: bool) -> None:
        self.module = module
        self.enabled = enabled
        self.backend: Any = NoGpus("not opened yet")
        self.lock = threading.Lock()

    def open(self) -> None:
        if not self.enabled:
            return  # --no-gpu: asked for, nothing to say
        self.backend = open_gpus(self.module, every_device=True)
        if not self.backend.available:
            log.info("node GPU metrics off: %s", self.backend.reason)

    def collect(self) -> Iterator[Metric]:
        if not self.backend.available:
            return
        with self.lock:
            try:
                samples = self.backend.sample()
            except Exception as exc:
                log.warning("node GPU metrics turned off after an NVML error: %s", exc)
                self.backend.close()
                self.backend.available = False
                return
        families = Families((), ())
        yield gpu_info("tuneup_node_gpu", self.backend.devices, families)
        yield from gpu_families("tuneup_node_gpu", samples, families)

    def close(self) -> None:
        self.backend.close()


class NodeDaemon:
    def __init__(self, registry_dir: Path | None = None, nvml_module: str = "pynvml", gpu: bool = True,
                 timeout: float = READ_TIMEOUT) -> None:
        self.registry_dir = registry_dir
        self.timeout = timeout
        self.gpus = NodeGpus(nvml_module, gpu)
        self.pool = ThreadPoolExecutor(MAX_PARALLEL, thread_name_prefix="tuneup-daemon-read")
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(_AgentsCollector(self))
        ProcessCollector(namespace="tuneup_daemon", registry=self.metrics)
        self._metrics_app = make_wsgi_app(self.metrics)
        self.endpoint = HttpEndpoint(self.route)
        self.hostname = socket.gethostname()

    # --- the agents -----------------------------------------------------------------

    def agents(self) -> list[dict[str, Any]]:
        return [entry for entry in discovery.live_agents(self.registry_dir) if entry.get("url")]

    def _get(self, url: str) -> bytes:
        return get(url, self.timeout)

    def read_all(self, path: str, agents: list[dict[str, Any]]) -> list[tuple[dict[str, Any], bytes | None, str | None, float]]:
        """GET `path` from every agent in parallel: (entry, body or None, error or None, seconds)."""
        def read(entry: dict[str, Any]) -> tuple[dict[str, Any], bytes | None, str | None, float]:
            began = time.perf_counter()
            try:
                body = self._get(str(entry["url"]).rstrip("/") + path)
                return entry, body, None, time.perf_counter() - began
            except (OSError, ValueError) as exc:  # fetch.FetchError is an OSError
                reason = getattr(exc, "reason", exc)
                return entry, None, f"{type(exc).__name__}: {reason}", time.perf_counter() - began

        return list(self.pool.map(read, agents))

    # --- HTTP -----------------------------------------------------------------------

    def route(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        try:
            if path == "/metrics":
                return self._metrics_app(environ, start_response)
            if path == "/api/health":
                return json_response(start_response, {"ok": True, "daemon": True})
            if path == "/api/agents":
                return json_response(start_response, {"daemon": True, "host": self.hostname,
                                                      "agents": self.agents()})
            if path == "/api/run":
                return json_response(start_response, self.jobs())
            if path.startswith("/jobs/") and path.endswith("/api/run"):
                return self.one_job(path[len("/jobs/"):-len("/api/run")].strip("/"), start_response)
            if path == "/":
                return text_response(start_response, "tuneup node daemon: /metrics (Prometheus, every job on this "
                                                      "node), /api/agents, /api/run (tuneup report/watch), "
                                                      "/jobs/<run_id>/api/run, /api/health\n")
        except Exception as exc:  # a request never takes the daemon down
            log.exception("request %s failed", path)
            return json_response(start_response, {"error": f"{type(exc).__name__}: {exc}"}, "500 Internal Server Error")
        return json_response(start_response, {"error": f"no such endpoint: {path}"}, "404 Not Found")

    def jobs(self) -> dict[str, Any]:
        """Every running job's /api/run, with its registry entry."""
        jobs = []
        for entry, body, error, _ in self.read_all("/api/run", self.agents()):
            job: dict[str, Any] = {"run_id": entry.get("run_id"), "group": entry.get("group") or entry.get("run_id"),
                                   "agent": entry, "path": f"/jobs/{entry.get('run_id')}"}
            if body is not None:
                try:
                    job["payload"] = json.loads(body)
                except ValueError:
                    error = "the agent did not answer JSON"
            if error is not None:
                job["error"] = error
            jobs.append(job)
        return {"daemon": True, "host": self.hostname, "jobs": jobs}

    def one_job(self, run_id: str, start_response: Callable) -> Iterable[bytes]:
        entry = next((a for a in self.agents() if str(a.get("run_id")) == run_id), None)
        if entry is None:
            return json_response(start_response, {"error": f"no running job with run id {run_id!r} on this node"},
                                 "404 Not Found")
        (_, body, error, _), = self.read_all("/api/run", [entry])
        if body is None:
            return json_response(start_response, {"error": f"the job's agent did not answer: {error}"},
                                 "502 Bad Gateway")
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    # --- life -----------------------------------------------------------------------

    def start(self, host: str, port: int) -> str:
        self.endpoint.start(host, port, fallback=False)
        self.gpus.open()
        return str(self.endpoint.url)

    def stop(self) -> None:
        self.endpoint.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.gpus.close()


class _AgentsCollector(Collector):
    """At scrape time: every live agent's exposition, each series labelled with its run id,
    merged family by family; then the daemon's own gauges and the node's GPUs."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        agents = self.daemon.agents()
        merged: dict[str, Metric] = {}
        up = GaugeMetricFamily("tuneup_daemon_agent_up", "1 when the last read of the agent answered",
                               labels=["run_id", "pid"])
        took = GaugeMetricFamily("tuneup_daemon_agent_scrape_seconds", "How long reading the agent took",
                                 labels=["run_id", "pid"])
        for entry, body, error, seconds in self.daemon.read_all("/metrics", agents):
            run_id, pid = str(entry.get("run_id")), str(entry.get("pid"))
            families = None
            if body is not None:
                try:
                    families = list(text_string_to_metric_families(body.decode("utf-8")))
                except Exception as exc:  # a torn or foreign exposition: that agent only
                    error = f"unreadable exposition: {exc}"
            up.add_metric([run_id, pid], 1.0 if families is not None else 0.0)
            took.add_metric([run_id, pid], seconds)
            if families is None:
                log.debug("agent %s (pid %s) not read: %s", run_id, pid, error)
                continue
            for family in families:
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                elif target.type != family.type:
                    continue  # two versions disagreeing on a family's type: keep the first's
                for sample in family.samples:
                    target.add_sample(sample.name, dict(sample.labels, run_id=run_id), sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from merged.values()
        yield GaugeMetricFamily("tuneup_daemon_agents", "Live tuneup agents found on the node", value=len(agents))
        yield up
        yield took
        yield from self.daemon.gpus.collect()
