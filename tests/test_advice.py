"""The advice engine on real jobs: on each injected-bottleneck scenario the right rule fires
with the right evidence and no unrelated rule fires; rules are silenced by id; a failing
rule never takes the others down; the live agent keeps current findings.

Whether amp-off fires depends on the CPU (bf16 units or not), so scenarios run with the
capability pinned absent and present through the documented cpu_bf16 option: both paths are
exercised on whatever CPU the suite runs on, and neither expectation comes from the machine
the test was written on. Every scenario runs without bf16 units; with them, the clean job and
one of each kind the amp-off trial meets differently (a stalled loader, host reads, a conv
net, autocast already on in fp16 and in bf16, a CPU oversubscribed): amp-off's premise is the
job's measured bf16 gain, timed before and after the run, and that costs each run 8-15 s on
a 2-core machine. The other tests here pin it absent."""

from __future__ import annotations

import copy
import time

import pytest

import tuneup
from benchmarks.advice_scenarios import (CLEAN, SCENARIOS, expected_findings, fired, norms_read,
                                         precision_recall, run_job, run_scenario)
from tuneup.diagnose import RULES, evaluate
from tuneup.diagnose.rule import rule

RESULTS: list[tuple[frozenset[str], set[str]]] = []
CPU_BF16 = {"no bf16": False, "bf16": True}
WITH_BF16 = {"clean", "io-bound loader", "host reads", "conv bias before BN", "fp16 without scaler", "misaligned bf16",
             "oversubscribed CPU"}
RUNS = [pytest.param(scenario, cpu, id=f"{scenario.name}-{cpu}") for scenario in SCENARIOS for cpu in CPU_BF16
        if cpu == "no bf16" or scenario.name in WITH_BF16]
# Evidence each scenario's rule must carry: (rule, evidence key, check).
EVIDENCE = {
    # Ground truth: 64 samples of 0.1 ms sleep a batch in the main process, so at least 6.4 ms
    # of waiting a step, however busy the machine. Not the stall share: a busy machine slows
    # the step's compute and shrinks it (13% measured with two other processes busy).
    "io-bound loader": ("data-stall", lambda e: e["data_wait_seconds"] >= 64 * 0.0001 and e["num_workers"] == 0),
    "host reads": ("host-syncs", lambda e: e["syncs_per_step"] == 2.0
                   and e["top_sources"][0]["location"].startswith("benchmarks/advice_scenarios.py:")),
    "fp16 overflows": ("scaler-skips", lambda e: 0.05 <= e["skip_rate"] <= 0.15),
    "eval with grad": ("eval-with-grad", lambda e: e["eval_forwards_with_grad"] >= 20),
    "numpy copies": ("numpy-copies", lambda e: abs(e["copies_per_step"] - 1.0) < 0.05),
    "raw inputs": ("input-not-normalized", lambda e: e["std"] > 50),
    "conv bias before BN": ("conv-bias-before-bn", lambda e: e["layers"] == ["1"]),
    "corrupt batches": ("no-grad-clipping", lambda e: e["spikes"] >= 1 and e["largest_ratio"] > 10),
    "misaligned bf16": ("tensor-core-alignment", lambda e: e["dtype"] == "bfloat16" and e["count"] >= 2),
}


@pytest.mark.parametrize("scenario, cpu", RUNS)
def test_the_right_rule_fires_and_no_other(scenario, cpu, tmp_path, heap_as_a_script_has):
    cpu_bf16 = CPU_BF16[cpu]
    document = run_scenario(scenario, tmp_path / "run", cpu_bf16=cpu_bf16)
    # What a machine's load can change is judged by the run's own clock (either: too close to tell).
    expected, either = expected_findings(scenario, cpu_bf16, document["truth"], norms_read(document))
    got = fired(document) - either
    evaluation = document["runs"][0]["evaluation"]
    if "data-stall" in expected and "data-stall" in evaluation["slight"]:
        # The stall was seen and its fix judged to save next to nothing: CPU-bound workers on
        # cores the machine's other work keeps busy (issue 21), as on a loaded CI host.
        got.add("data-stall")
    RESULTS.append((expected, got))
    assert got == set(expected), ([(f["rule"], f["observed"]) for f in document["findings"]],
                                  _stall_evidence(document))
    assert not evaluation["errors"]
    assert document["runs"][0]["snapshot"]["config"]["hardware"]["cpu_bf16"] is cpu_bf16
    checks = [EVIDENCE[scenario.name]] if scenario.name in EVIDENCE else []
    if "amp-off" in expected:
        checks.append(("amp-off", lambda e: e["device"] == "cpu" and e["dtype"] == "bfloat16"
                       and 0 < e["compute_share"] <= 1))
    # A finding left to the machine (either: its premise too close to tell) is checked where it fired.
    checks = [(rule_id, check) for rule_id, check in checks if rule_id in expected or rule_id in fired(document)]
    for rule_id, check in checks:
        finding = next(f for f in document["findings"] if f["rule"] == rule_id)
        assert check(finding["evidence"]), finding["evidence"]
        assert finding["observed"] and finding["fix"] and finding["doc"].startswith("https://")
    if "no-grad-clipping" in fired(document):  # the spike it names is one the loop's own norms show
        evidence = next(f for f in document["findings"] if f["rule"] == "no-grad-clipping")["evidence"]
        assert evidence["largest_step"] in document["truth"].spike_steps, evidence


def test_precision_and_recall_over_the_scenarios():
    if len(RESULTS) < len(RUNS):
        pytest.skip("run with the scenario tests (the whole module)")
    precision, recall = precision_recall(RESULTS)
    print(f"\nadvice over {len(RESULTS)} scenario runs: precision {precision:.2f}, recall {recall:.2f}")
    assert precision == 1.0 and recall == 1.0


def test_findings_are_ranked_by_estimated_gain(tmp_path):
    scenario = next(s for s in SCENARIOS if s.name == "oversubscribed CPU")
    document = run_scenario(scenario, tmp_path / "run")
    gains = [f["gain"] or 0 for f in document["findings"]]
    assert gains == sorted(gains, reverse=True)
    # A finding with an estimated gain comes before every finding without one (cpu-oversubscribed
    # states none; data-stall states one where more workers would recover the wait).
    stated = [f["gain"] is not None for f in document["findings"]]
    assert stated == sorted(stated, reverse=True), [(f["rule"], f["gain"]) for f in document["findings"]]
    evaluation = document["runs"][0]["evaluation"]
    if "data-stall" not in fired(document) and "data-stall" not in evaluation["slight"]:
        # Its premise is timing (advice_scenarios._premises): load can undo it. Less tuneup's own
        # work at step closes, which the loop's clock holds and tuneup keeps out of the job's
        # wait (Truth.own_share; measured 1.5-2.3 points of this job's stall idle). (A stall
        # whose fix would save next to nothing, CPU-bound workers on cores other work keeps
        # busy, is "slight": no finding, rightly.)
        truth = document["truth"]
        assert truth.stall - truth.own_share < 0.10 + 0.03, _stall_evidence(document)


def _stall_evidence(document):
    """What a data-stall verdict rests on, both sides: the loop's own stalls over tuneup's window's
    steps (less tuneup's share) beside tuneup's, and what the rules made of it."""
    truth, run = document["truth"], document["runs"][0]
    window = run["snapshot"]["window"] or {}
    return {"loop": (round(truth.stall, 4), round(truth.stall_all, 4), round(truth.own_share, 4)),
            "tuneup": window.get("stall_ratio"), "steps": (window.get("first_step"), window.get("last_step")),
            "slight": run["evaluation"]["slight"], "passed": "data-stall" in run["evaluation"]["passed"]}


def test_a_silenced_rule_stays_out_and_unknown_ids_are_refused(tmp_path):
    with tuneup.attach(run_dir=tmp_path / "run", interval=0.1, silence="no-lr-schedule", cpu_bf16=False) as agent:
        run_job(CLEAN.__class__(schedule=False, steps=150))
    # The agent's own rules honour its silence list. (Only that: whether anything else fires
    # on the clean job is the clean scenario's test; on a busy machine a few fetches descheduled
    # for milliseconds once put this short run's data wait over data-stall's 10%.)
    assert "no-lr-schedule" not in {f["rule"] for f in agent.findings()}
    from tuneup.report.document import build
    from tuneup.report.sources import load

    histories, source = load(str(tmp_path / "run"))
    assert "no-lr-schedule" in fired(build(histories, source=source))
    assert "no-lr-schedule" not in fired(build(histories, source=source, silence=["no-lr-schedule"]))
    with pytest.raises(ValueError, match="unknown rule id 'no-such-rule'"):
        tuneup.attach(silence=["no-such-rule"])


def test_a_failing_rule_is_reported_and_the_others_still_run(tmp_path):
    @rule(id="test-broken", title="broken", severity="low", inputs="-", threshold="-", why="-", doc="https://x")
    def broken(facts):
        raise KeyError("boom")

    try:
        scenario = next(s for s in SCENARIOS if s.name == "host reads")
        document = run_scenario(scenario, tmp_path / "run")
        assert document["runs"][0]["evaluation"]["errors"] == {"test-broken": "KeyError: 'boom'"}
        assert fired(document) == {"host-syncs"}
    finally:
        RULES.pop("test-broken")


def test_rules_without_their_inputs_stay_silent():
    evaluation = evaluate({"enabled": True, "run": {}, "window": None, "config": None})
    assert evaluation.findings == [] and evaluation.errors == {}
    assert set(evaluation.unmeasured) | set(evaluation.passed) == set(RULES)


def test_a_running_job_has_current_findings(tmp_path):
    seen = []
    with tuneup.attach(run_dir=tmp_path / "run", interval=0.05, cpu_bf16=False) as agent:
        deadline = time.monotonic() + 30
        job = CLEAN.__class__(host_reads=3, steps=100)
        while time.monotonic() < deadline and "host-syncs" not in seen:
            run_job(job)
            seen = [f["rule"] for f in agent.findings()]
    assert "host-syncs" in seen  # found while the loop was still running
    markdown = agent.report("markdown")  # after detach: over the whole run
    assert markdown.startswith("# tuneup report") and "`host-syncs`" in markdown


def test_evidence_numbers_are_json_plain(tmp_path):
    document = run_scenario(SCENARIOS[1], tmp_path / "run")
    import json

    assert json.loads(json.dumps(copy.deepcopy(document["findings"]), allow_nan=False)) == document["findings"]
