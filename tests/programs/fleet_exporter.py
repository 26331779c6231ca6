"""A fleet of tuneup agents for Prometheus: many ranks' series, served the way the node daemon
serves a node (one target per node, each rank's series with its run_id), made from one real
agent's exposition.

    python fleet_exporter.py --template METRICS.txt --nodes 64 --per-node 8 --straggler 77 \
        --slow-node 5 --drop-at 45

`--template` is what a real agent's /metrics answered (tests/test_fleet_prometheus.py scrapes
one from tests/programs/export_job.py): every rank exports exactly its families and series,
relabelled (rank, local_rank, run_id, one training_job for the fleet). Values move as a running
job's do: counters grow at the template's own rate (its value over the agent's uptime), gauges
stay. Injected, as DDP would show them:
  - every rank waits WAIT x its step in the all-reduce (tuneup_ddp_allreduce_wait_seconds), the
    straggler hardly at all (it is the one the others wait for), the slow node's ranks half as
    long (they arrive late too);
  - rank 0 carries the cross-rank findings its agent would raise (rank-straggler, node-straggler);
  - after --drop-at seconds every rank trains THROUGHPUT_AFTER_DROP of its samples per second
    (the job slowed down: TuneupJobThroughputDropped).

Prints one JSON line ({"ports": [...], "series_per_rank": N}) once every node is served.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families

WAIT = 0.3  # all-reduce wait per step, as a share of the step, of a rank on time
STRAGGLER_WAIT = 0.01
SLOW_NODE_WAIT = 0.15
THROUGHPUT_AFTER_DROP = 0.05
CUMULATIVE = ("_total", "_count", "_sum", "_bucket")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--template", required=True)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--straggler", type=int, default=-1)
    parser.add_argument("--slow-node", type=int, default=-1)
    parser.add_argument("--drop-at", type=float, default=0.0, help="seconds; 0: never")
    parser.add_argument("--training-job", default="fleet:10.0.0.1:29500")
    return parser.parse_args(argv)


def label_text(labels: dict[str, str]) -> str:
    return ",".join(f'{key}="{value}"' for key, value in labels.items())


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        text = open(args.template, encoding="utf-8").read()
        self.families = [f for f in text_string_to_metric_families(text)]
        samples = {s.name: s.value for f in self.families for s in f.samples}
        self.uptime = max(1.0, samples["tuneup_last_step_time_seconds"] - samples["tuneup_run_start_time_seconds"])
        self.step = samples["tuneup_step_seconds_sum"] / max(1.0, samples["tuneup_step_seconds_count"])
        self.series_per_rank = sum(len(f.samples) for f in self.families if not f.name.endswith("_created"))
        self.started = time.time()

    def progress(self, now: float, throughput: bool) -> float:
        """How far a counter has grown since the template, as a multiple of its template value."""
        elapsed = now - self.started
        drop = self.args.drop_at
        if throughput and drop and elapsed > drop:
            elapsed = drop + THROUGHPUT_AFTER_DROP * (elapsed - drop)
        return (self.uptime + elapsed) / self.uptime

    def rank_labels(self, rank: int) -> dict[str, str]:
        return {"rank": str(rank), "local_rank": str(rank % self.args.per_node), "run_id": f"r{rank:05d}",
                "training_job": self.args.training_job}

    def wait(self, rank: int) -> float:
        if rank == self.args.straggler:
            return STRAGGLER_WAIT * self.step
        if rank // self.args.per_node == self.args.slow_node:
            return SLOW_NODE_WAIT * self.step
        return WAIT * self.step

    def exposition(self, node: int) -> bytes:
        now = time.time()
        grown, samples_grown = self.progress(now, False), self.progress(now, True)
        ranks = range(node * self.args.per_node, (node + 1) * self.args.per_node)
        out: list[str] = []
        for family in self.families:
            # The text format's names (prometheus-client's parser drops counters' _total, infos' _info).
            name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
            kind = {"info": "gauge", "stateset": "gauge", "unknown": "untyped"}.get(family.type, family.type)
            out.append(f"# TYPE {name} {kind}")
            for rank in ranks:
                mine = self.rank_labels(rank)
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    value = sample.value
                    if sample.name.endswith(CUMULATIVE):
                        value *= samples_grown if sample.name == "tuneup_samples_total" else grown
                    if sample.name == "tuneup_ddp_allreduce_wait_seconds":
                        value = self.wait(rank)
                    if sample.name == "tuneup_last_step_time_seconds":
                        value = now
                    # The process's own series (process_*, python_*) carry no rank: run_id keeps them apart.
                    labels = {**sample.labels, **{k: v for k, v in mine.items() if k in sample.labels or k == "run_id"}}
                    out.append(f"{sample.name}{{{label_text(labels)}}} {value!r}")
                if rank == 0 and family.name in ("tuneup_finding_active", "tuneup_finding_gain_ratio"):
                    for rule in ("rank-straggler", "node-straggler"):  # rank 0 compares the ranks
                        extra = dict(mine, rule=rule, **({"severity": "high"} if family.name == "tuneup_finding_active"
                                                        else {}))
                        out.append(f"{family.name}{{{label_text(extra)}}} "
                                   f"{1.0 if family.name == 'tuneup_finding_active' else 0.15}")
        return ("\n".join(out) + "\n").encode()


def serve(fleet: Fleet, node: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = fleet.exposition(node)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    fleet = Fleet(args)
    servers = [serve(fleet, node) for node in range(args.nodes)]
    print(json.dumps({"ports": [s.server_address[1] for s in servers], "series_per_rank": fleet.series_per_rank,
                      "step_seconds": fleet.step}), flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
