"""Apply mode on public-shaped training scripts, end to end, next to plain python, advise mode
and the best hand-picked setting.

    python benchmarks/bench_apply_scripts.py [--rounds 3] [--steps 600[,3000]] [--scripts a,b]
                                             [--variants plain,apply,workers=0] [--busy N]

Scripts (benchmarks/apply_scripts/, each says what its loop does):
- augment_classifier.py: CPU augmentation in the Dataset, num_workers=0;
- collate_lm.py: a transformer LM tokenizing in its collate_fn, num_workers=0;
- many_workers.py: num_workers=8 over in-memory rows on a small machine;
- remote_images.py: samples read from network storage (the thread asleep) in the main process.

Variants, each a fresh process (the script's own command line, as a user runs it):
plain `python script.py`, `tuneup run script.py` (advise), `tuneup run --apply script.py`,
and `python script.py --workers N` for each hand-picked N (the best of them is "hand").
Every round runs every variant once in a shuffled order, so the machine's drifts hit all
alike. Printed per script: median end-to-end wall seconds, the training loop's wall seconds
and CPU ms per step (process time: tuneup's threads included), each as a ratio to plain, and
the share of the hand-picked gain apply mode got: (plain - apply) / (plain - hand), on
end-to-end wall time (goal: >= 90%); `apply-loader` is apply mode with the DataLoader action
alone (--actions dataloader), the one a hand-picked num_workers competes with (apply mode's
other actions, gc.freeze() on many_workers once its workers are gone, can take it past 100%). Several run lengths (--steps 600,3000) are interleaved
in the same rounds: apply mode pays for its start (tuneup's own start-up, the warm-up and the
baseline before the first change, about half a second of steps), so its share grows with the
run's length, and a run of a few seconds cannot reach 90%. Each apply run's changes are printed
as its run log recorded them ("num_workers 8 -> 0 kept@125": kept, effective from step 125). --busy N runs N CPU-bound processes
beside every variant for the whole benchmark (a shared machine: what the advice and the trials
must get right when the cores are not the job's alone).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "benchmarks" / "apply_scripts"
sys.path.insert(0, str(ROOT))
from tests.conftest import busy_processes, child_env  # noqa: E402
from tuneup.measure.host import usable_cores  # noqa: E402

HAND = {  # worker counts a user would try by hand
    "augment_classifier": lambda cores: sorted({1, 2, cores}),
    "collate_lm": lambda cores: sorted({1, 2, cores}),
    "many_workers": lambda cores: sorted({0, 1, 2, cores}),
    "remote_images": lambda cores: sorted({1, 2, cores}),
}


def variants(script: str, cores: int) -> dict[str, list[str]]:
    path = str(SCRIPTS / f"{script}.py")
    out = {"plain": [sys.executable, path],
           "advise": [sys.executable, "-m", "tuneup", "run", path],
           "apply": [sys.executable, "-m", "tuneup", "run", "--apply", path],
           # The DataLoader action alone: what a change of num_workers by hand can be held against
           "apply-loader": [sys.executable, "-m", "tuneup", "run", "--apply", "--actions", "dataloader", path]}
    for workers in HAND[script](cores):
        out[f"workers={workers}"] = [sys.executable, path, "--workers", str(workers)]
    return out


def run(command: list[str], steps: int, run_dir: str) -> dict[str, Any]:
    began = time.perf_counter()
    applying = "--apply" in command  # its run log kept: what it changed, and when (decisions)
    own_dir = tempfile.mkdtemp(dir=run_dir) if applying else run_dir
    done = subprocess.run([*command, "--steps", str(steps)], capture_output=True, text=True, timeout=1800,
                          env=child_env(TUNEUP_RUN_DIR=own_dir, TUNEUP_LOG=None if applying else "0", TUNEUP_PORT="0"))
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    out: dict[str, Any] = {"wall": wall, "train": result["seconds"], "cpu_ms": 1000 * result["cpu"] / result["steps"]}
    if applying:
        out["decisions"] = decisions(Path(own_dir))
    return out


def decisions(run_dir: Path) -> str:
    """Apply mode's changes as its run log's last word on each: "num_workers 8 -> 0 kept@125"."""
    last: dict[Any, dict[str, Any]] = {}
    for log in run_dir.glob("**/events*.jsonl"):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "action":
                last[event["id"]] = event
    # (`change` is optional: a record that tried nothing, "not applicable", names its action)
    return "; ".join(f"{event.get('change') or event.get('action')} {event['decision']}"
                     f"@{event.get('effective_step') or event.get('applied_step')}"
                     for _, event in sorted(last.items(), key=lambda item: str(item[0]))) or "no change"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", default="600", help="steps a run; several, comma-separated, run interleaved")
    parser.add_argument("--scripts", default=",".join(HAND))
    parser.add_argument("--variants", default=None,
                        help="only these variants (plain and apply always run; more rounds in the same time)")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside every variant")
    args = parser.parse_args()
    cores = usable_cores()
    scripts = args.scripts.split(",")
    plan = {script: variants(script, cores) for script in scripts}
    if args.variants:
        chosen = set(args.variants.split(",")) | {"plain", "apply"}
        plan = {script: {name: command for name, command in commands.items() if name in chosen}
                for script, commands in plan.items()}
        for script, commands in plan.items():
            if not any(name.startswith("workers=") for name in commands):
                parser.error(f"--variants has no hand-picked count for {script} (one of "
                             f"{', '.join(f'workers={n}' for n in HAND[script](cores))}): its share of the gain needs one")
    lengths = [int(steps) for steps in args.steps.split(",")]
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    with busy_processes(args.busy), tempfile.TemporaryDirectory() as run_dir:
        for round_ in range(args.rounds):
            order = [(script, steps, name) for script in scripts for steps in lengths for name in plan[script]]
            random.shuffle(order)
            for script, steps, name in order:
                results.setdefault((script, steps, name), []).append(run(plan[script][name], steps, run_dir))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    beside = f", beside {args.busy} busy processes" if args.busy else ""
    print(f"{args.rounds} rounds, {cores} usable cores{beside}; medians (ratio to plain)")
    for script, steps in [(script, steps) for script in scripts for steps in lengths]:
        runs = {name: results[(script, steps, name)] for name in plan[script]}
        report(script, steps, runs)


def report(script: str, steps: int, runs: dict[str, list[dict[str, Any]]]) -> None:
    """One script at one run length: the variants' medians, and apply mode's share of the gain."""
    med = {name: {key: statistics.median(r[key] for r in results) for key in ("wall", "train", "cpu_ms")}
           for name, results in runs.items()}
    hand = min((name for name in med if name.startswith("workers=")), key=lambda name: med[name]["wall"])
    plain = med["plain"]
    print(f"\n{script}, {steps} steps a run  (best by hand: {hand})")
    print(f"  {'variant':<12}{'wall s':>10}{'ratio':>8}{'train s':>10}{'ratio':>8}{'CPU ms/step':>13}{'ratio':>8}")
    for name in [name for name in ("plain", "advise", "apply", "apply-loader") if name in med] + [hand]:
        m = med[name]
        print(f"  {name:<12}{m['wall']:>10.2f}{m['wall'] / plain['wall']:>8.2f}{m['train']:>10.2f}"
              f"{m['train'] / plain['train']:>8.2f}{m['cpu_ms']:>13.2f}{m['cpu_ms'] / plain['cpu_ms']:>8.2f}")
    possible = plain["wall"] - med[hand]["wall"]
    for variant in [name for name in ("apply", "apply-loader") if name in med]:
        got = plain["wall"] - med[variant]["wall"]
        share = f"{got / possible:.0%}" if possible > 0 else "n/a (no hand-picked gain)"
        print(f"  {'apply mode' if variant == 'apply' else 'apply mode, the DataLoader action alone,'} got {share} "
              "of the hand-picked gain")
    # The same share within each round (its runs ran close together, so the machine's drifts
    # cancel more of the way), and the median of those
    # (n/a: a round whose plain run was no slower than its hand-picked one)
    rounds = [(p["wall"] - a["wall"]) / (p["wall"] - h["wall"]) if p["wall"] > h["wall"] else None
              for p, a, h in zip(runs["plain"], runs["apply"], runs[hand])]
    shares = [share for share in rounds if share is not None]
    if shares:
        listed = ", ".join("n/a" if share is None else f"{share:.0%}" for share in rounds)
        print(f"  per round: {listed}; median {statistics.median(shares):.0%}")
    for index, result in enumerate(runs["apply"], start=1):
        print(f"  apply, round {index}: {result['wall']:.2f} s; {result['decisions']}")


if __name__ == "__main__":
    main()
