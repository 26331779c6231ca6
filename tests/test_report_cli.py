"""`tuneup report`, `watch`, `run`, `doctor` and `rules` as a user runs them: real jobs in
real processes, real run logs, a live agent's loopback endpoint."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.advice_scenarios import about_the_machine
from tests.conftest import ROOT, child_env
from tests.test_cli import tuneup
from tuneup.cli import rules_markdown

JOB = """
import os, sys, time
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
{attach}

class Slow(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        time.sleep(0.0002)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, x[:4].sum(0, keepdim=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 50)
stop = Path(sys.argv[1]) if len(sys.argv) > 1 else None
steps = 0
while True:
    for x, y in DataLoader(Slow(), batch_size=32):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loss.item()
        loss.item()
        steps += 1
        if (stop is None and steps >= 150) or (stop is not None and stop.exists()):
            sys.exit(0)
"""


def write_job(folder: Path, attach: str = "") -> Path:
    script = folder / "train.py"
    script.write_text(JOB.format(attach=attach))
    return script


def env_for(run_dir: Path) -> dict[str, str]:
    # The CPU's bf16 capability is pinned (absent): these jobs' findings are compared exactly.
    return child_env(TUNEUP_RUN_DIR=str(run_dir), TUNEUP_INTERVAL="0.1", COLUMNS="200",
                     TUNEUP_CPU_BF16="0")


def findings(run_dir: Path, *options: str) -> list[dict]:
    """The report's findings about the job (about_the_machine's left out: a busy machine's)."""
    result = tuneup("report", str(run_dir), "--format", "json", *options)
    assert result.returncode == 0, result.stderr
    return [f for f in json.loads(result.stdout)["findings"] if not about_the_machine(f)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("job")
    script = write_job(folder, "import tuneup; tuneup.attach()")
    run_dir = folder / "run"
    result = subprocess.run([sys.executable, str(script)], env=env_for(run_dir), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return run_dir


def test_tuneup_run_gives_the_same_report_as_the_one_line_attach(finished_run, tmp_path):
    script = write_job(tmp_path)  # the same job without the attach line
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "tuneup", "run", str(script)], env=env_for(run_dir),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    explicit, zero_code = findings(finished_run), findings(run_dir)
    assert [f["rule"] for f in zero_code] == [f["rule"] for f in explicit] == ["data-stall", "host-syncs"]
    # The same evidence, but for what the host's load decides: on a busy machine (the suite at
    # -n 2 beside torchrun's ranks) one run's threads wanted nearly all the cores, and data-stall
    # weighed its gain against them (job_cores, and sleep_overlap or cpu_bound) where the other's did not.
    for a, b in zip(explicit, zero_code):
        assert set(a["evidence"]) ^ set(b["evidence"]) <= {"job_cores", "sleep_overlap", "cpu_bound"}
        assert a["fix"].splitlines()[0].split("(")[0] == b["fix"].splitlines()[0].split("(")[0]
    assert explicit[1]["evidence"]["syncs_per_step"] == zero_code[1]["evidence"]["syncs_per_step"] == 2.0


def test_report_formats(finished_run, tmp_path):
    text = tuneup("report", str(finished_run))
    assert text.returncode == 0 and "Advice, ranked by estimated gain" in text.stdout
    assert "[data-stall]" in text.stdout and "What was measured" in text.stdout
    markdown = tuneup("report", str(finished_run), "-f", "markdown")
    assert markdown.stdout.startswith("# tuneup report") and "```python" in markdown.stdout
    document = json.loads(tuneup("report", str(finished_run), "-f", "json").stdout)
    assert document["runs"][0]["snapshot"]["totals"]["steps"] == 150
    output = tmp_path / "report.html"
    html = tuneup("report", str(finished_run), "-f", "html", "-o", str(output))
    assert html.returncode == 0 and f"wrote the html report to {output}" in html.stderr
    assert output.read_text().count("<svg") >= 3
    assert [f["rule"] for f in findings(finished_run, "--silence", "data-stall")] == ["host-syncs"]


def test_the_text_report_keeps_code_and_links_whole_in_a_narrow_pipe(finished_run):
    # Piped (CI logs, `> file`) rich wraps to 80 columns, or COLUMNS: a fix's comment wrapped
    # into a line of code, a docs link into two halves. Each fix line and link is one line.
    document = json.loads(tuneup("report", str(finished_run), "-f", "json").stdout)
    shown = [f for f in document["findings"] if any(len(line) > 50 for line in f["fix"].splitlines())]
    assert shown, [f["fix"] for f in document["findings"]]
    text = subprocess.run([sys.executable, "-m", "tuneup", "report", str(finished_run)], capture_output=True, text=True,
                          env=child_env(COLUMNS="50"), timeout=300).stdout
    lines = text.splitlines()
    for finding in document["findings"]:
        for line in finding["fix"].rstrip().splitlines():
            assert (" " * 5 + line).rstrip() in lines, (line, text)
        assert f"   docs: {finding['doc']}" in lines, text
    assert max(map(len, lines)) > 50 and not [line for line in lines if line != line.rstrip()]


def without_torch(*args: str) -> subprocess.CompletedProcess:
    """`tuneup ARGS` in a process where `import torch` raises ImportError (sys.modules["torch"] = None)."""
    code = "import sys; sys.modules['torch'] = None; from tuneup.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], env=child_env(COLUMNS="200"), capture_output=True,
                          text=True, timeout=300)


def test_a_report_of_a_run_log_never_imports_torch(finished_run, tmp_path):
    # The report, the rules it runs and each format do without torch (measure/terms.py), and say the same.
    for form in ("json", "text", "html", "markdown"):
        paths = (tmp_path / f"with.{form}", tmp_path / f"without.{form}")
        for run, path in zip((tuneup, without_torch), paths):
            result = run("report", str(finished_run), "-f", form, "-o", str(path))
            assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        with_torch, without = (path.read_text() for path in paths)
        if form == "json":  # the same document but for when it was made
            with_torch, without = (json.loads(text) | {"generated_at": None} for text in (with_torch, without))
            assert [f["rule"] for f in without["findings"]] == [f["rule"] for f in with_torch["findings"]] != []
        elif form == "html":
            with_torch, without = (re.sub(r"generated [^<]* by", "", text) for text in (with_torch, without))
        assert without == with_torch, form
    rules = without_torch("rules")
    assert rules.returncode == 0 and rules.stdout == tuneup("rules").stdout, rules.stderr


def one_line_error(result, *words):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("tuneup: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_bad_run_logs_get_one_clear_line(finished_run, tmp_path):
    one_line_error(tuneup("report", str(tmp_path / "missing")), "no run directory")
    (tmp_path / "empty").mkdir()
    one_line_error(tuneup("report", str(tmp_path / "empty")), "holds no tuneup run log")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "events.jsonl").write_text("")
    one_line_error(tuneup("report", str(tmp_path / "blank")), "empty or corrupt")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "events.jsonl").write_bytes(b"\x00\xff not json\n{{{\n")
    one_line_error(tuneup("report", str(tmp_path / "garbage")), "empty or corrupt")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "events.jsonl").write_text('{"hello": 1}\n')
    one_line_error(tuneup("report", str(tmp_path / "foreign")), "not a tuneup run log")
    one_line_error(tuneup("report", str(finished_run), "-f", "pdf"), "unknown --format")
    one_line_error(tuneup("report", str(finished_run), "--silence", "nope"), "unknown rule id")
    one_line_error(tuneup("report", str(finished_run), "-o", str(tmp_path / "no" / "dir" / "r.txt")), "cannot write")


def test_a_truncated_run_log_still_reports(finished_run, tmp_path):
    log = (finished_run / "events.jsonl").read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "events.jsonl").write_bytes(log[: len(log) * 2 // 3])  # the process died mid-line
    result = tuneup("report", str(cut), "-f", "json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["runs"][0]["snapshot"]["state"] == "running or ended abruptly"
    assert "data-stall" in [f["rule"] for f in document["findings"]]


def test_a_url_with_nothing_listening_is_one_line():
    one_line_error(tuneup("report", "http://127.0.0.1:9/"), "nothing answered at http://127.0.0.1:9/")
    one_line_error(tuneup("watch", "http://127.0.0.1:9/", "--once"), "nothing answered")


def test_run_with_a_missing_script_or_a_raising_one(tmp_path):
    one_line_error(tuneup("run", str(tmp_path / "nope.py")), "no script at")
    one_line_error(tuneup("run", "--apply", str(tmp_path / "nope.py")), "no script at")
    one_line_error(tuneup("run", "--apply", "--actions", "amp,turbo", str(tmp_path / "nope.py")),
                   "--actions: unknown action 'turbo'")
    one_line_error(tuneup("run", "--actions", "amp", str(tmp_path / "nope.py")), "add --apply")
    raising = tmp_path / "raising.py"
    raising.write_text("import sys\nif sys.argv[1:] == ['--code']:\n    sys.exit(7)\nraise ValueError('boom')\n")
    env = env_for(tmp_path / "run")
    result = subprocess.run([sys.executable, "-m", "tuneup", "run", str(raising)], env=env, capture_output=True,
                            text=True, timeout=120)
    plain = subprocess.run([sys.executable, str(raising)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == plain.returncode == 1
    assert result.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == "ValueError: boom"
    assert "tuneup" not in result.stderr.replace(str(tmp_path), "")
    coded = subprocess.run([sys.executable, "-m", "tuneup", "run", str(raising), "--code"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert coded.returncode == 7


def test_run_passes_everything_after_the_script_to_it(tmp_path):
    """tuneup's options go before the script; after it, even `--apply`, `-m` and `--help` are the
    script's own (the launcher parses `run` itself, without the full command line)."""
    script = tmp_path / "args.py"
    script.write_text("import json, os, sys\nprint(json.dumps([sys.argv[1:], os.environ.get('TUNEUP_MODE')]))\n")
    env = env_for(tmp_path / "run")
    for launcher in ([sys.executable, "-m", "tuneup"], [str(Path(sys.executable).parent / "tuneup")]):
        result = subprocess.run([*launcher, "run", str(script), "--apply", "-m", "x", "--help"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.splitlines()[-1]) == [["--apply", "-m", "x", "--help"], None]
        applied = subprocess.run([*launcher, "run", "--apply", "--actions=amp", str(script), "--lr", "1"], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert json.loads(applied.stdout.splitlines()[-1]) == [["--lr", "1"], "apply"]  # before the script: tuneup's


def test_a_live_job_answers_report_and_watch(tmp_path):
    script = write_job(tmp_path, "import tuneup; tuneup.attach()")
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    job = subprocess.Popen([sys.executable, str(script), str(stop)], env=env_for(run_dir),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            log = run_dir / "events.jsonl"
            if log.exists():
                url = json.loads(log.read_text().splitlines()[0]).get("url")
            time.sleep(0.2)
        assert url and url.startswith("http://127.0.0.1:")
        time.sleep(3)  # some steps and a rules pass
        live = tuneup("report", url, "-f", "json")
        assert live.returncode == 0, live.stderr
        document = json.loads(live.stdout)
        assert document["runs"][0]["snapshot"]["attached"] is True
        assert document["runs"][0]["snapshot"]["totals"]["steps"] > 20
        assert {"data-stall", "host-syncs"} <= {f["rule"] for f in document["findings"]}
        watched = tuneup("watch", url, "--once")
        assert watched.returncode == 0, watched.stderr
        assert f"tuneup watch {url}  (live" in watched.stdout and "data wait" in watched.stdout
        discovered = tuneup("watch", "--once")  # no URL: the one agent in the registry
        assert discovered.returncode == 0 and url in discovered.stdout, discovered.stderr
    finally:
        stop.touch()
        job.wait(timeout=60)
    assert job.returncode == 0, job.stderr
    one_line_error(tuneup("watch", "--once"), "no tuneup agent is running")


def test_watch_names_the_events_it_left_out_and_the_daemon_jobs_it_cannot_show(finished_run):
    """`tuneup watch` on a job whose answer holds an event that does not fit its schema says
    so above the view, as the report does; on a node daemon, a job whose agent answered
    something that is not a run, or whose registry entry lacks its pid, gets a dash and the
    reason, never "None"."""
    from rich.console import Console

    from tuneup.report.live import job_frame, node_frame

    events = [json.loads(line) for line in (finished_run / "events.jsonl").read_text().splitlines()]
    url = "http://127.0.0.1:9/"
    console = Console(record=True, width=400)
    console.print(job_frame(url, {"events": [*events, {"event": "steps", "steps": "many"}], "attached": False}))
    text = console.export_text()
    skipped = f"note: 1 unreadable event(s) of {url} skipped (event {len(events) + 1}: steps.steps is a string"
    assert skipped in text and "data wait" in text, text
    jobs = [{"run_id": "a1", "agent": {"pid": 11, "argv": ["train.py", "--lr", "0.1"]}, "path": "/jobs/a1",
             "payload": {"events": events, "attached": True}},
            {"run_id": "b2", "agent": {"argv": ["other.py"]}, "path": "/jobs/b2", "payload": {"attached": True}},
            {"run_id": None, "agent": {}, "path": "/jobs/None", "error": "URLError: refused"}]
    console = Console(record=True, width=400)
    console.print(node_frame(url, {"daemon": True, "host": "node", "jobs": jobs}))
    text = console.export_text()
    assert "None" not in text, text
    rows = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0].endswith(".py")}
    assert "not answering: payload.events is missing" in rows["other.py"], text
    assert " 11 " in rows["train.py"] and "not answering" not in rows["train.py"], text
    assert "not answering: URLError: refused" in text, text


def test_doctor_and_rules(monkeypatch):
    monkeypatch.delenv("TUNEUP_CPU_BF16", raising=False)
    doctor = tuneup("doctor")
    assert doctor.returncode == 0, doctor.stderr
    assert "torch" in doctor.stdout and "run directory" in doctor.stdout
    detected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    shown = " ".join(doctor.stdout.split())  # the table folds long lines
    assert ("AVX512-BF16/AMX present (detected" if detected else "no AVX512-BF16/AMX (detected") in shown
    for value, effect in (("1", "are advised bf16 autocast (amp-off)"), ("0", "amp-off stays silent")):
        monkeypatch.setenv("TUNEUP_CPU_BF16", value)
        pinned = " ".join(tuneup("doctor").stdout.split())
        assert f"treated as {'present' if value == '1' else 'absent'} by TUNEUP_CPU_BF16" in pinned and effect in pinned
    rules = tuneup("rules")
    assert rules.returncode == 0 and "data-stall" in rules.stdout


def test_docs_rules_md_is_current():
    assert (ROOT / "docs" / "rules.md").read_text() == rules_markdown(), "regenerate: tuneup rules -f markdown > docs/rules.md"


def test_merging_run_directories_refuses_what_is_not_one_jobs_nodes(finished_run, tmp_path):
    one_line_error(tuneup("report", str(finished_run), str(finished_run)), "given twice")
    one_line_error(tuneup("report", str(finished_run), str(tmp_path / "missing")), "no run directory")
    # Two ranks of the same number in two directories: not one job's nodes.
    import shutil

    first, second = tmp_path / "node0", tmp_path / "node1"
    for folder in (first, second):
        shutil.copytree(finished_run, folder)
        for log in folder.glob("events*.jsonl"):
            lines = log.read_text().splitlines()
            header = json.loads(lines[0])
            header["rank"] = 0
            log.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    one_line_error(tuneup("report", str(first), str(second)), "rank 0 is in both")


def test_the_daemon_refuses_an_unsafe_or_wrong_setting_by_name(tmp_path):
    one_line_error(tuneup("daemon", "--host", "", "--port", "1"), "--host is empty", "0.0.0.0")
    a_file = tmp_path / "registry"
    a_file.write_text("")
    one_line_error(tuneup("daemon", "--registry-dir", str(a_file), "--port", "1"), "is not a directory")
    env = {**child_env(), "TUNEUP_NVML_MODULE": "this"}  # `import this` would print the Zen of Python
    result = subprocess.run([sys.executable, "-m", "tuneup", "daemon", "--port", "1"], capture_output=True,
                            text=True, env=env, timeout=120)
    one_line_error(result, "TUNEUP_NVML_MODULE", "expected pynvml")
    assert "Zen of Python" not in result.stdout


def test_the_live_line_names_the_step_the_stall_the_work_and_what_explains_the_gap(tmp_path):
    """Ground truth from the loop: each step waits for its batch (16 samples of 0.5 ms,
    num_workers=0: its own clock around next() says how long) and trains a 64-256-256-1 MLP
    (FLOPs from the layer shapes); `tuneup demo` shows this line beside its progress bar."""
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import tuneup
    from tuneup.report.summary import live_line

    class Slow(Dataset):
        def __len__(self):
            return 1024

        def __getitem__(self, index):
            time.sleep(0.0005)
            return torch.randn(64), torch.randn(1)

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    began = time.perf_counter()
    ends = [began]  # the loop's own clock at each update's end: its steps' times
    fetches = []  # the loop's own clock at each next(), and its wait there (StopIteration's too)
    with tuneup.attach(run_dir=tmp_path / "run", port=0, interval=0.2) as agent:
        for _ in range(2):
            batches = iter(DataLoader(Slow(), batch_size=16))
            while True:
                asked = time.perf_counter()
                try:
                    x, y = next(batches)
                except StopIteration:
                    fetches.append((asked, time.perf_counter() - asked))
                    break
                fetches.append((asked, time.perf_counter() - asked))
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                ends.append(time.perf_counter())
        snapshot = agent.snapshot()
        line = live_line(snapshot, agent.findings())
    assert live_line({}) == ""  # before the first window: nothing to say
    step = float(re.search(r"step ([\d.]+) ms", line).group(1)) / 1e3
    # The median against the loop's own median step (on a busy machine a few long steps make
    # the mean 2.6x the median: 37 ms against 14).
    loop_median = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    assert step == pytest.approx(loop_median, rel=0.25), (line, loop_median)
    # tuneup's window holds the 127 steps it closed: up to the last batch's fetch (the second
    # last next(): the last ended the epoch), where the open step began. The waits after it (that
    # fetch's, the StopIteration's) are no closed step's. (Against the whole run's share, one
    # busy full-suite run read 38% where tuneup's steps held 24%: compared over the same steps,
    # a pause outside them no longer counts for one side alone.)
    # Less tuneup's own time on the training thread, which it reports and keeps out of the steps:
    # its precision trial (the MLP timed in fp32 and bf16 on the job's batch, once) runs at a
    # close, inside a next() of the loop's: 0.2 s idle, 2.0 s beside three busy processes, where
    # the loop's clock read a 35% stall and tuneup's steps held 20%.
    own = snapshot["totals"]["tuneup_seconds"]
    last = fetches[-2][0]
    elapsed = last - began - own
    waited = sum(wait for asked, wait in fetches if asked < last) - own
    stall = int(re.search(r"stall (\d+)%", line).group(1)) / 100
    assert stall == pytest.approx(waited / elapsed, abs=0.1), (line, waited / elapsed)
    flops = 6 * 16 * (64 * 256 + 256 * 256 + 256)  # forward 2x, backward 4x the multiply-adds
    achieved = re.search(r"([\d.]+) (k|M|G)FLOP/s \(MFU: unknown peak\)", line)
    assert achieved, line
    rate = float(achieved.group(1)) * {"k": 1e3, "M": 1e6, "G": 1e9}[achieved.group(2)]
    assert rate == pytest.approx(flops * 127 / elapsed, rel=0.5), (line, flops * 127 / elapsed)
    assert line.endswith("top finding: data-stall"), line


def test_the_net_change_counts_the_trials_judged_and_says_the_one_detach_cut_short():
    """Three changes tried: one kept, one not kept (both measured to the end of their trials),
    one still on trial at detach (nothing of it measured): two judged, and the third said."""
    from tuneup.report.summary import net_change

    def measured(step_ms):
        return {"mean_step_seconds": step_ms / 1000, "steps_per_second": 1000 / step_ms}

    actions = [
        {"id": 1, "decision": "reverted", "change": "num_workers 8 -> 0", "reason": "1.02x: within the noise",
         "baseline": measured(139.0), "trial": measured(136.0)},
        {"id": 2, "decision": "kept", "change": "num_workers 8 -> 9", "reason": "2.93x faster",
         "baseline": measured(133.3), "trial": measured(45.5)},
        {"id": 3, "decision": "reverted", "change": "num_workers 9 -> 10", "reason": "detach before the trial ended"},
    ]
    assert net_change(actions) == ("Kept 1 of 2 changes tried (1 more cut short before its trial ended): mean step "
                                   "time 139.0 ms -> 45.5 ms (3.05x the throughput), 7 -> 22 steps/s")
    assert net_change(actions[:2]).startswith("Kept 1 of 2 changes tried: mean step time 139.0 ms")


def test_counts_of_one_are_said_in_the_singular():
    from tuneup.report.summary import evaluation_line, sync_lines

    line = evaluation_line({"phases": 1, "seconds": 2.0, "share": 0.1, "mean_seconds": 2.0})
    assert line.startswith("Evaluation: 1 phase, 2.00 s in all"), line
    assert evaluation_line({"phases": 3, "seconds": 6.0, "share": 0.1, "mean_seconds": 2.0}).startswith(
        "Evaluation: 3 phases,")
    [line] = sync_lines({"measured": True, "per_step": 2.0, "meaning": "host reads", "sampled_steps": 1,
                         "top_sources": []})
    assert line == "Host-device syncs: 2.0 per step (host reads, 1 sampled step)"
