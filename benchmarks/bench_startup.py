"""Start-up and exit cost of tuneup: `tuneup run` on a short script, and attach()/detach() themselves.

    python benchmarks/bench_startup.py [--rounds 7] [--uncached]

(a) Wall time of whole processes: `python S` against `python -m tuneup run S`, where S is a
short training script this benchmark writes to a temporary directory (an MLP on random
tensors through a DataLoader with num_workers=0, AdamW, one torch thread, a loss printed at
the end). What `tuneup run` adds is the launcher process (its imports, then exec), attach()
at start-up in the exec'd interpreter, the measured steps, and detach() at exit.

(b) In a fresh process that has imported torch and built its model, optimizer and
DataLoader (as a job has when it calls attach()): `import tuneup`, `tuneup.attach()` and
`agent.detach()`, each timed with time.perf_counter by
the child itself and printed as JSON; also the time the interpreter spent in full (gen-2)
garbage collections during attach() (gc.callbacks), which imports can trigger.

Each round runs every variant once, in a shuffled order, so slow drifts of the machine hit
all of them alike. The table prints the median over rounds, the ratio to `python S`, the
added time, the median (and IQR) of the difference to `python S` of the same round, and the
median against the target (`tuneup run` adds at most 0.3 s; attach() takes at most 50 ms).
Children run in a temporary directory (run logs, discovery entries) with TUNEUP_PORT=0.

Children run with bytecode caching on, as an installed package runs (pip compiles its .pyc
files at install; Python writes them on first import): where the calling environment sets
PYTHONDONTWRITEBYTECODE (this project's CI hosts do), the children unset it, and the warm-up
round writes the caches. Without them every start compiles tuneup's modules from source:
attach() took 83 ms that way against 25 ms cached on the same host. --uncached keeps the
environment's setting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""\
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)  # on a small shared host, OpenMP threads that spin make every run noisy
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 64), torch.randn(2048, 1))
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(4):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    print(f"loss {loss.item():.4f}")
""")

ATTACH = textwrap.dedent("""\
    import gc, json, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    # What a script has done by the time it calls attach(): its model, optimizer and loader built.
    data = TensorDataset(torch.randn(2048, 64), torch.randn(2048, 1))
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collecting = []

    def watch(phase, info):
        if info["generation"] == 2:
            collecting.append((phase, time.perf_counter()))

    started = time.perf_counter()
    import tuneup
    imported = time.perf_counter()
    gc.callbacks.append(watch)
    agent = tuneup.attach()
    attached = time.perf_counter()
    gc.callbacks.remove(watch)
    agent.detach()
    detached = time.perf_counter()
    starts = [t for phase, t in collecting if phase == "start"]
    stops = [t for phase, t in collecting if phase == "stop"]
    print(json.dumps({"import tuneup": imported - started, "tuneup.attach()": attached - imported,
                      "  of which gen-2 GC": sum(b - a for a, b in zip(starts, stops)),
                      "agent.detach()": detached - attached, "enabled": agent.enabled}))
""")

# The targets: what `tuneup run` may add to the script's wall time; what attach() itself may take.
TARGETS = {"python -m tuneup run S": 0.3, "tuneup.attach()": 0.050}


def child_env(tmp: Path, cached: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    if cached:
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package starts (module docstring)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.update(TUNEUP_PORT="0", TUNEUP_REGISTRY_DIR=str(tmp / "registry"), TUNEUP_RUN_DIR=str(tmp / "runs"))
    return env


def wall(command: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return elapsed


def in_process(cwd: Path, env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", ATTACH], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the attach child failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if not figures.pop("enabled"):
        sys.exit("the agent did not attach in the child (TUNEUP_DISABLE set?)")
    return figures


def row(name: str, values: list[float], base: list[float] | None, unit: str) -> str:
    scale = 1.0 if unit == "s" else 1e3
    median = statistics.median(values)
    line = f"  {name:<26}{median * scale:>10.3f} {unit:<2}"
    added = [v - b for v, b in zip(values, base)] if base is not None else None  # paired: the same round
    if added is None:
        line += f"{'':>9}{'':>13}"
    else:
        line += f"{median / statistics.median(base):>9.3f}{(median - statistics.median(base)) * scale:>+10.3f} {unit:<2}"
    target = TARGETS.get(name)
    spent = statistics.median(added) if added is not None else median
    line += f"{spent / target:>10.2f}" if target is not None else f"{'':>10}"
    if added is not None:
        q1, _, q3 = statistics.quantiles(added, n=4) if len(added) > 1 else (added[0],) * 3
        line += f"   {statistics.median(added) * scale:+.3f} {unit} ({q1 * scale:+.3f} to {q3 * scale:+.3f})"
    return line.rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--uncached", action="store_true",
                        help="keep the environment's PYTHONDONTWRITEBYTECODE (modules compile at every start)")
    args = parser.parse_args()
    report(args.rounds, cached=not args.uncached)


def report(rounds: int, cached: bool = True) -> None:
    """Run the rounds and print the table (bench_overhead.py prints it too, after its own)."""
    caching = ("on" if cached or not sys.dont_write_bytecode
               else "off (PYTHONDONTWRITEBYTECODE: uncached modules compile at every start)")
    print(f"python {sys.version.split()[0]}, {rounds} interleaved rounds (plus one warm-up), "
          f"median over rounds; bytecode caching {caching}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        script = tmp / "train_short.py"
        script.write_text(SCRIPT)
        env = child_env(tmp, cached)
        variants = {
            "python S": lambda: wall([sys.executable, str(script)], tmp, env),
            "python -m tuneup run S": lambda: wall([sys.executable, "-m", "tuneup", "run", str(script)], tmp, env),
            "in-process": lambda: in_process(tmp, env),
        }
        results: dict[str, list] = {name: [] for name in variants}
        for round_ in range(rounds + 1):
            order = list(variants.items())
            random.shuffle(order)
            for name, run in order:
                value = run()
                if round_ > 0:  # the first round warms the page cache (and any bytecode cache)
                    results[name].append(value)
    base = results["python S"]
    print(f"\n  {'':<26}{'median':>13}{'ratio':>9}{'added':>13}{'÷ target':>10}   paired added (IQR)")
    print("  whole process, wall time (S: a short training script)")
    for name in ("python S", "python -m tuneup run S"):
        print(row(name, results[name], None if name == "python S" else base, "s"))
    print("  in a process that built its model, optimizer and loader (time.perf_counter in the child)")
    for name in results["in-process"][0]:
        print(row(name, [figures[name] for figures in results["in-process"]], None, "ms"))


if __name__ == "__main__":
    main()
