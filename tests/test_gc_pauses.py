"""Python's full garbage collections, timed on a real job (tests/programs/tabular_rows.py: a
tabular classifier collating 512 sample tuples a batch in the main process) and explained
(the gc-pauses rule); with the fix the rule names (gc.freeze() before the loop) they stop
mattering. Ground truth is the script's own gc.callbacks timer over its loop, not tuneup's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import child_env
from tuneup.diagnose.rules.code import GC_SHARE, MIN_FULL_COLLECTIONS

PROGRAM = Path(__file__).parent / "programs" / "tabular_rows.py"


def run(tmp_path: Path, *args: str) -> tuple[dict, dict, list[dict]]:
    """The script under `tuneup run`: (its own JSON line, tuneup's last gc section, the report's findings)."""
    run_dir = tmp_path / "run"
    # One intra-op thread: beside the suite's other processes two would spin for each other
    # (a 2 s job took 53 s), and the script's shape, not torch's threading, is under test.
    env = child_env(PYTHONPATH=None, TUNEUP_RUN_DIR=str(run_dir), TUNEUP_PORT="0", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "tuneup", "run", str(PROGRAM), *args], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    truth = json.loads(result.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    collector = [e["habits"]["gc"] for e in events if (e.get("habits") or {}).get("gc")][-1]
    report = subprocess.run([sys.executable, "-m", "tuneup", "report", str(run_dir), "--format", "json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    return truth, collector, json.loads(report.stdout)["findings"]


def test_full_collections_are_timed_and_gc_freeze_is_the_fix(tmp_path):
    truth, collector, findings = run(tmp_path / "plain", "--steps", "1200")
    # The script's full collections, each one seen (tuneup's count runs on to its detach: one
    # more may fall between the script's last step and the interpreter's exit).
    assert truth["full_collections"] >= MIN_FULL_COLLECTIONS, truth
    assert truth["full_collections"] <= collector["collections"][2] <= truth["full_collections"] + 1, (truth, collector)
    # Their time, by tuneup's callback (run before the script's at the start, and at the stop).
    assert collector["seconds"][2] >= truth["full_seconds"] * 0.95, (truth, collector)
    assert collector["seconds"][2] <= truth["full_seconds"] * 1.1 + 0.2 * (collector["collections"][2]
                                                                         > truth["full_collections"]), (truth, collector)
    share = truth["full_seconds"] / truth["seconds"]
    fired = {f["rule"]: f for f in findings}
    if share >= 2 * GC_SHARE:  # (a machine busy enough to stretch the steps can dilute it: by the script's clock)
        finding = fired["gc-pauses"]
        assert finding["evidence"]["full_collections"] == collector["collections"][2]
        assert finding["gain"] == pytest.approx(share, rel=0.35), (finding["gain"], share)
        assert "gc.freeze()" in finding["fix"] and "gc.collect()" in finding["fix"]
        assert f"{collector['collections'][2]} full garbage collections took" in finding["observed"]
    elif share < GC_SHARE / 2:
        assert "gc-pauses" not in fired

    frozen_truth, frozen, frozen_findings = run(tmp_path / "frozen", "--steps", "1200", "--freeze")
    # The fix: what existed before the loop is out of the collector's reach. Full collections
    # still come (more often: the oldest generation is small now), each a fraction as long.
    assert frozen["frozen"] > 100_000, frozen
    assert frozen["collections"][2] >= frozen_truth["full_collections"]
    assert frozen["full_median_seconds"] is None or \
        frozen["full_median_seconds"] < collector["full_median_seconds"] / 10, (frozen, collector)
    assert frozen_truth["full_seconds"] / frozen_truth["seconds"] < GC_SHARE / 2, frozen_truth
    assert "gc-pauses" not in {f["rule"] for f in frozen_findings}


def test_collections_count_from_the_first_step_outside_evaluation_and_leave_with_detach(run_dir):
    """In process: full collections (gc.collect(): generation 2) before the first step, inside
    an evaluation phase and inside tuneup's own work at a close (a listener, as a precision
    trial is) are not the training's; those inside training steps are, each timed; detach takes
    the callback out of gc.callbacks again."""
    import gc

    import torch

    import tuneup
    from benchmarks.scenarios import mlp

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 64), torch.randn(8, 1)
    before = list(gc.callbacks)
    with tuneup.attach(run_dir=run_dir, interval=60) as agent:
        collector = agent.recorder.collector
        assert collector._callback in gc.callbacks
        own = []

        def own_work(step):  # tuneup's own work at a close (listeners run on detail steps)
            if step >= 14 and not own:
                own.append(step)
                gc.collect()

        agent.recorder.timeline.add_listener("own work", own_work)
        gc.collect()  # set-up: no step yet
        for step in range(30):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if step in (10, 20):
                gc.collect()  # two full collections inside training steps
            if step == 25:  # an evaluation phase: forwards of the trained model in eval() mode
                model.eval()
                with torch.no_grad():
                    model(x)
                    gc.collect()
                    model(x)
                model.train()
        summary = collector.summary()
        with urllib.request.urlopen(agent.server.url + "/metrics", timeout=10) as response:
            scraped = {(sample.name, sample.labels.get("generation")): sample.value
                       for family in text_string_to_metric_families(response.read().decode())
                       for sample in family.samples}
    assert own and summary["collections"][2] == 2, (own, summary)
    assert scraped[("tuneup_gc_collections_total", "2")] == 2
    assert scraped[("tuneup_gc_pause_seconds_total", "2")] == pytest.approx(summary["seconds"][2])
    assert 0.0 < summary["seconds"][2] and summary["full_max_seconds"] <= summary["seconds"][2]
    assert summary["full_steps"][0] in (11, 12) and summary["full_steps"][1] in (21, 22), summary
    assert gc.callbacks == before


def test_a_failing_collector_turns_itself_off_with_one_warning(run_dir):
    """Its callback raising (here: the step ring gone) never reaches the job or the collector:
    one warning, the probe off and out of gc.callbacks, training goes on."""
    import gc

    import torch

    import tuneup
    from benchmarks.scenarios import mlp

    model = mlp(hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 64), torch.randn(8, 1)
    with pytest.warns(tuneup.TuneupWarning, match="gc probe turned off") as caught:
        with tuneup.attach(run_dir=run_dir, interval=60) as agent:
            collector = agent.recorder.collector
            for step in range(20):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                if step == 5:
                    collector.timeline = None  # the callback's next stop raises
                    gc.collect()
                    gc.collect()
            assert agent.recorder.timeline.ring.count >= 18
    assert len([w for w in caught if "gc probe" in str(w.message)]) == 1
    assert collector._callback not in gc.callbacks and not collector.on


def test_apply_mode_freezes_the_heap_keeps_it_for_shorter_pauses_and_leaves_no_trace(run_dir, capsys, monkeypatch):
    """The same script, in this process, plain and then under apply mode (the gc-freeze action
    alone). Ground truth from the first test: full collections every few hundred steps, each
    walking the whole heap. Apply mode waits for two of them (their spacing sizes the trial),
    freezes the heap (gc.collect(), gc.freeze()) for two spacings, and keeps it where the full
    collections in the trial took at most half the time a step they took before: the script's
    own timer then sees shorter ones. Nothing numeric changes (the last loss is the plain run's,
    bit for bit); detach unfreezes (gc.get_freeze_count() back to 0)."""
    import gc
    import math
    import runpy

    import tuneup

    def script(steps: int) -> dict:
        monkeypatch.setattr(sys, "argv", [str(PROGRAM), "--steps", str(steps)])
        runpy.run_path(str(PROGRAM), run_name="__main__")
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert gc.get_freeze_count() == 0
    callbacks = list(gc.callbacks)
    try:
        # Sized from the plain run: the trial waits for two full collections, then holds two of
        # their spacings. In a pytest worker's heap (what earlier tests imported) they come further
        # apart than in a fresh process (in CI 2,400 steps ended before the trial did).
        steps = 2400
        plain = script(steps)
        spacing = steps / max(1, plain["full_collections"])
        if 6 * spacing > steps:
            steps = min(12_000, 200 * math.ceil(6 * spacing / 200))
            plain = script(steps)
        with tuneup.attach(mode="apply", actions=["gc-freeze"], run_dir=run_dir, interval=0.2) as agent:
            # The test's own timer of every full collection, with the step it fell in: tuneup keeps
            # its latest 64 (gc_pauses.RECENT_FULL), and in a quiet machine's run the ones after
            # the freeze had pushed out every one from before it.
            ring, timed = agent.recorder.timeline.ring, []

            def full_collections(phase, info):
                if info["generation"] == 2:
                    timed.append((phase, ring.count + 1, time.perf_counter()))

            gc.callbacks.append(full_collections)
            applied = script(steps)
        frozen_after = gc.get_freeze_count()
        pauses = [(step, ended - began) for (start, step, began), (stop, _, ended) in zip(timed, timed[1:])
                  if start == "start" and stop == "stop"]
    finally:
        gc.callbacks[:] = callbacks  # the script's own timers
        gc.unfreeze()
    records = [r for r in agent.actions() if r["action"] == "gc-freeze"]
    assert plain["full_collections"] >= MIN_FULL_COLLECTIONS, plain
    assert records and records[0]["decision"] == "kept", [(r["decision"], r.get("reason")) for r in agent.actions()]
    record = records[0]
    measured = record["measured"]["gc"]
    assert measured["after_seconds_per_step"] <= measured["before_seconds_per_step"] / 2, measured
    assert "a step saved" in record["reason"] and "each before (one every" in record["reason"], record["reason"]
    # The freeze in effect at the loop's end; every full collection after it far shorter than before it
    assert applied["frozen"] > 100_000 and frozen_after == 0, (applied, frozen_after)
    start = record["effective_step"]
    before = [spent for step, spent in pauses if step < start]
    after = [spent for step, spent in pauses if step > start]
    assert before and after and max(after) < min(before) / 5, (before, after)
    # By the script's own clock: its full collections were shorter on average than plain's (those
    # before the freeze as long as plain's, those after it short). Not their total: in a big heap
    # (a pytest worker's) they come so far apart that plain's few all fall before the freeze would.
    assert applied["full_seconds"] / applied["full_collections"] < plain["full_seconds"] / plain["full_collections"], \
        (applied, plain)
    assert applied["last_loss"] == plain["last_loss"] and applied["steps"] == plain["steps"] == steps
