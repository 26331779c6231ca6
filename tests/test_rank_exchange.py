"""The two-level rank exchange (measure/ranks.py) against a real TCPStore on loopback: ranks
publish under their node, node leaders publish one summary each, rank 0 reads the nodes only.
The ranks are simulated (one RankExchange each, with its own store connection and the
environment torchrun would give it); the real torchrun path is tests/test_distributed.py."""

from __future__ import annotations

import time

import pytest
from torch.distributed import TCPStore

from tuneup.diagnose import evaluate
from tuneup.measure.ranks import RankExchange, Topology, compact
from tuneup.report.ranks import rank_summary


def snapshot(rank: int, local: int, step: float = 0.010, backward: float = 0.004, host: str = "node-a",
             wait: float | None = None, cpu_wait: float | None = None):
    """A rank's snapshot; `wait`: its all-reduce wait as DDP's timers give it (measure/ddp.py);
    `cpu_wait`: its threads' run-queue wait per step (measure/host.py)."""
    system = {"ddp": {"allreduce_wait_seconds": wait}} if wait is not None else {}
    if cpu_wait is not None:
        system["host"] = {"step_cpu_wait_seconds": cpu_wait}
    return {"run": {"rank": rank, "local_rank": local, "run_id": "r", "host": host, "pid": 1000 + rank},
            "window": {"steps": 100, "step_seconds": {"median": step}, "backward_seconds": {"median": backward},
                       "data_wait_seconds": {"median": 0.0}, "stall_ratio": 0.0, "steps_per_second": 1 / step,
                       "samples_per_second": 32 / step},
            "system": system}


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=__import__("datetime").timedelta(seconds=10))
    yield server


def fleet(store, nodes: int, per_node: int, environ=None):
    exchanges = []
    for rank in range(nodes * per_node):
        env = environ(rank) if environ else {"LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
                                             "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes)}
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=__import__("datetime").timedelta(seconds=10))
        exchanges.append(RankExchange(lambda *a: None, store=client, rank=rank, world_size=nodes * per_node,
                                      environ=env))
    return exchanges


def one_round(exchanges, times, final=False, skip=()):
    """Every rank publishes (rank 0 last: it reads what the leaders published)."""
    order = sorted(exchanges, key=lambda e: (e.rank == 0, e.topology.leader))
    for exchange in order:
        if exchange.rank in skip:
            continue
        step, backward, *waits = times(exchange.rank)
        wait, cpu_wait = (list(waits) + [None, None])[:2]
        summary = compact(snapshot(exchange.rank, exchange.topology.local_rank, step, backward,
                                   host=f"host-{exchange.topology.node}", wait=wait, cpu_wait=cpu_wait), [], final)
        assert exchange.exchange(summary, wait=30, final_within=0.6 if final else 0.0)


def close_all(exchanges):
    for exchange in exchanges:
        exchange.close()


def test_rank_0_reads_nodes_not_ranks_and_names_a_straggler_with_its_node(store):
    # Ground truth: 4 nodes of 8 ranks; every rank spends 6 ms outside the backward, rank 13
    # (node 1, local rank 5) 9 ms.
    exchanges = fleet(store, nodes=4, per_node=8)
    try:
        one_round(exchanges, lambda r: (0.013, 0.004) if r == 13 else (0.010, 0.004))
        rank0 = exchanges[0]
        before = rank0.operations
        one_round(exchanges, lambda r: (0.013, 0.004) if r == 13 else (0.010, 0.004))
        # Its own set; its node's 7 other ranks, then the 3 other nodes: each list one check()
        # and one multi_get() once every key exists, however many ranks and nodes there are.
        assert rank0.operations - before == 1 + 2 + 2
        peers = rank0.peer_snapshots()
        assert sorted(p["run"]["rank"] for p in peers) == list(range(32))
        found = {f.rule: f for f in evaluate(snapshot(0, 0, host="host-0"), ranks=peers).findings}
        straggler = found["rank-straggler"]
        assert straggler.evidence["rank"] == 13 and straggler.evidence["node"] == 1
        assert "rank 13 (node 1, host-1)" in straggler.observed
        assert "node-straggler" not in found
    finally:
        close_all(exchanges)


def test_a_slow_node_is_its_own_finding(store):
    exchanges = fleet(store, nodes=4, per_node=4)
    try:
        times = lambda r: (0.014, 0.004) if r // 4 == 2 else (0.010, 0.004)  # noqa: E731 - node 2 all slow
        one_round(exchanges, times)
        one_round(exchanges, times)
        peers = exchanges[0].peer_snapshots()
        found = {f.rule: f for f in evaluate(snapshot(0, 0), ranks=peers).findings}
        node = found["node-straggler"]
        assert node.evidence["node"] == 2 and node.evidence["ranks"] == [8, 9, 10, 11]
        assert "every rank of node 2 (host-2)" in node.observed
    finally:
        close_all(exchanges)


def test_a_rank_slow_in_its_backward_is_named_by_the_others_allreduce_wait(store):
    # Ground truth: 2 nodes of 4 ranks, DDP. Rank 6 computes its backward 5 ms slower; the
    # all-reduce evens the ranks out, so every rank's step (12 ms) and backward (8 ms) are the
    # same, and the 5 ms show only as the other ranks' wait in the all-reduce (5.2 ms; rank 6
    # itself 0.2 ms). Step less backward cannot tell; step less the wait can.
    exchanges = fleet(store, nodes=2, per_node=4)
    try:
        one_round(exchanges, lambda r: (0.012, 0.008, 0.0002 if r == 6 else 0.0052))
        peers = exchanges[0].peer_snapshots()
        assert {p["run"]["rank"]: p["ddp"]["allreduce_wait_seconds"] for p in peers}[6] == pytest.approx(0.0002)
        own = snapshot(0, 0, 0.012, 0.008, host="host-0", wait=0.0052)
        straggler = {f.rule: f for f in evaluate(own, ranks=peers).findings}["rank-straggler"]
        assert straggler.evidence["rank"] == 6 and straggler.evidence["basis"] == "allreduce_wait"
        assert straggler.evidence["rank_seconds"] == pytest.approx(0.0118)
        assert straggler.evidence["others_allreduce_wait_seconds"] == pytest.approx(0.0052)
        assert "in DDP's all-reduce it waits 200 µs per step, the other ranks 5.2 ms" in straggler.observed
        table = rank_summary(peers, 8, [])
        assert "all-reduce" in table.splitlines()[1]
        assert table.splitlines()[2 + 6].split()[3:7] == ["12.0", "ms", "11.8", "ms"]
        # Without the waits (no DDP timers) the same figures show no straggler: the old basis.
        one_round(exchanges, lambda r: (0.012, 0.008))
        blind = evaluate(snapshot(0, 0, 0.012, 0.008, host="host-0"), ranks=exchanges[0].peer_snapshots())
        assert "rank-straggler" not in {f.rule for f in blind.findings}
    finally:
        close_all(exchanges)


def test_a_longer_wait_for_a_cpu_alone_names_no_straggler_and_shows_in_the_rank_table(store):
    # Ground truth: 4 ranks on one node, the same work, the same 10 ms steps and 3 ms all-reduce
    # waits (own time 7 ms each). Rank 2's threads wait 4 ms a step for a CPU, the others 0.5 ms.
    # No rank's own time stands out: no rank holds the others back, and a CPU wait alone names
    # none (CI's busy host gave ranks at the same pace 4.6 against 2.8 ms, with 2.0 and 2.5 ms
    # all-reduce waits). The wait travels through the node summary's rows into the rank table.
    exchanges = fleet(store, nodes=1, per_node=4)
    try:
        one_round(exchanges, lambda r: (0.010, 0.004, 0.003, 0.004 if r == 2 else 0.0005))
        peers = exchanges[0].peer_snapshots()
        assert {p["run"]["rank"]: p["host"]["step_cpu_wait_seconds"] for p in peers} == \
            {0: 0.0005, 1: 0.0005, 2: 0.004, 3: 0.0005}  # through the node summary's rows
        own = snapshot(0, 0, 0.010, 0.004, wait=0.003, cpu_wait=0.0005)
        assert "rank-straggler" not in {f.rule for f in evaluate(own, ranks=peers).findings}
        table = rank_summary(peers, 4, []).splitlines()
        assert "cpu wait" in table[1] and table[2 + 2].split()[9:11] == ["4.0", "ms"]
    finally:
        close_all(exchanges)


def test_a_straggler_whose_excess_is_its_wait_for_a_cpu_is_told_to_free_its_cores():
    # Ground truth: rank 3 waits 0.5 ms in the all-reduce, the others 3 ms: its own time 9.5 ms
    # against 7 ms (median), 2.5 ms more. Its threads wait 3 ms a step for a CPU, the others
    # 0.5: the 2.5 ms are that wait (share 1.0), and its host is the cause. With 0.8 ms of wait
    # (share 0.12) the excess is its own work, and the fix looks there.
    def ranks(starved_wait):
        return [compact(snapshot(r, r, 0.010, 0.004, host="host-0", wait=0.0005 if r == 3 else 0.003,
                                 cpu_wait=starved_wait if r == 3 else 0.0005), [], True) for r in range(4)]

    rows = ranks(0.003)
    straggler = {f.rule: f for f in evaluate(rows[0], ranks=rows[1:]).findings}["rank-straggler"]
    assert straggler.evidence["rank"] == 3 and straggler.evidence["basis"] == "allreduce_wait"
    assert straggler.evidence["cpu_wait_share"] == pytest.approx(1.0)
    assert "its threads wait 3.0 ms per step for a CPU (runnable, not running), the other ranks 500 µs" in straggler.observed
    assert "cores of its own" in straggler.fix and straggler.gain == pytest.approx(0.25)
    rows = ranks(0.0008)
    straggler = {f.rule: f for f in evaluate(rows[0], ranks=rows[1:]).findings}["rank-straggler"]
    assert straggler.evidence["cpu_wait_share"] == pytest.approx(0.12)
    assert "for a CPU" not in straggler.observed and "uneven work" in straggler.fix
    rows[2]["host"]["step_cpu_wait_seconds"] = None  # a rank that cannot tell (no schedstat)
    straggler = {f.rule: f for f in evaluate(rows[0], ranks=rows[1:]).findings}["rank-straggler"]
    assert straggler.evidence["cpu_wait_share"] is None and straggler.evidence["rank"] == 3


def test_final_exchange_waits_a_bounded_time_for_a_rank_that_never_reports(store):
    exchanges = fleet(store, nodes=2, per_node=4)
    try:
        one_round(exchanges, lambda r: (0.010, 0.004))
        began = time.monotonic()
        one_round(exchanges, lambda r: (0.010, 0.004), final=True, skip={6})  # rank 6 died
        assert time.monotonic() - began < 10
        rows = exchanges[0].peer_snapshots()
        finals = {row["run"]["rank"]: row["final"] for row in rows}
        assert finals[6] is False and all(finals[r] for r in finals if r != 6)
        table = rank_summary(rows, 8, [])
        assert "last heard" in table.splitlines()[2 + 6] and "no straggler" in table
    finally:
        close_all(exchanges)


def test_without_torchruns_topology_a_large_job_is_grouped_and_said_to_be(store):
    topology = Topology.of(200, 512, environ={})
    assert (topology.node, topology.local_rank, topology.local_world_size, topology.nodes, topology.assumed) == \
        (25, 0, 8, 64, True)
    assert Topology.of(5, 16, environ={}).nodes == 1  # small: one node
    torchrun = Topology.of(13, 32, environ={"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1",
                                              "GROUP_WORLD_SIZE": "4"})
    assert (torchrun.node, torchrun.local_rank, torchrun.nodes, torchrun.assumed) == (1, 5, 4, False)


def test_the_rank_table_has_a_line_per_node_at_fleet_size():
    rows = []
    for rank in range(512):
        row = compact(snapshot(rank, rank % 8, 0.020 if rank == 300 else 0.010, host=f"host-{rank // 8}"), [], True)
        row["run"]["node"] = rank // 8
        rows.append(row)
    found = evaluate(rows[0], ranks=rows[1:]).findings
    table = rank_summary(rows, 512, [f.to_dict() for f in found])
    lines = table.splitlines()
    assert len(lines) == 1 + 1 + 64 + 1  # title, header, a line per node, the straggler
    assert any(line.split()[0] == "37" and "(rank 300)" in line for line in lines[2:66])
    assert lines[-1].startswith("  straggler: rank 300 (node 37, host-37)")


def test_the_median_of_the_other_nodes_is_exact_with_ties():
    import random
    import statistics
    from collections import Counter

    from tuneup.diagnose.rules.distributed import _median_without

    generator = random.Random(7)
    for _ in range(500):
        values = sorted(generator.choice([generator.random(), 0.5, 0.25]) for _ in range(generator.randint(3, 40)))
        removed = sorted(generator.sample(values, generator.randint(1, len(values) - 2)))
        rest = list((Counter(values) - Counter(removed)).elements())
        assert _median_without(values, removed) == pytest.approx(statistics.median(rest))
