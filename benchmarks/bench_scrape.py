"""What a Prometheus scrape costs a busy agent, and whether it stalls the training step.

    python benchmarks/bench_scrape.py [--rounds 7] [--steps 3000]

A CPU training loop (~2 ms steps: DataLoader, MLP, AdamW, a GradScaler, a loss.item() every
10 steps) runs with tuneup attached while a separate process scrapes the agent's /metrics:
never, once a second (already 15x Prometheus' usual interval), or back to back (a stress
test: one scrape after another as fast as the agent answers). The scraper is its own
process so its HTTP client does not compete with the loop for the GIL; what remains is the
agent's own work: the collectors and the WSGI server on the agent's thread.

Each round runs every configuration once, in a shuffled order. Printed: the median over
rounds of the mean step time and of the p99 step time (a stalled step shows there), each with
its ratio to the run without scrapes; and the scrape latency seen by the scraper (median,
p90) with the exposition's size. The node daemon's scrape of the same agent is measured too.
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
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tuneup  # noqa: E402
from tuneup.export.daemon import NodeDaemon  # noqa: E402

SCRAPER = r"""
import json, signal, sys, time, urllib.request


def stop(*_):  # the benchmark's run is over (SIGTERM: SIGINT may be ignored in background jobs)
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, stop)
url, period, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
latencies, size = [], 0
print("ready", flush=True)
end = time.monotonic() + seconds
try:
    while time.monotonic() < end:
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                size = len(response.read())
            latencies.append(time.perf_counter() - began)
        except OSError:
            pass
        if period:
            time.sleep(max(0.0, period - (time.perf_counter() - began)))
except KeyboardInterrupt:
    pass
print(json.dumps({"latencies": latencies, "size": size}))
"""

MODES = {"no scrapes": None, "scrape every 1 s": 1.0, "back-to-back scrapes": 0.0}


def loop(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    data = DataLoader(TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1)), batch_size=64, shuffle=True)
    times, done = [], 0
    last = time.perf_counter()
    while done < steps:
        for x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if done % 10 == 0:
                loss.item()
            now = time.perf_counter()
            times.append(now - last)
            last = now
            done += 1
            if done == steps:
                break
    return times


def run(mode: str, steps: int, url_of=lambda agent: agent.server.url + "/metrics") -> dict:
    with tempfile.TemporaryDirectory() as folder:
        agent = tuneup.attach(run_dir=folder, port=0, log=False)
        try:
            loop(100)  # warm-up: the agent has findings, counters and a full catalog to serve
            scraper = None
            period = MODES[mode]
            if period is not None:
                scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, url_of(agent), str(period), "3600"],
                                           stdout=subprocess.PIPE, text=True)
                scraper.stdout.readline()  # "ready": its interpreter has started
                time.sleep(0.2)
            times = loop(steps)
            scrapes = {}
            if scraper is not None:
                scraper.terminate()
                out, _ = scraper.communicate()
                scrapes = json.loads(out.strip().splitlines()[-1])
        finally:
            agent.detach()
    return {"mean": statistics.fmean(times), "p99": percentile(sorted(times), 0.99), **scrapes}


def percentile(ordered: list[float], q: float) -> float:
    return ordered[round(q * (len(ordered) - 1))]


def run_scraper_until_done(url: str, count: int, period: float = 0.2) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRAPER, url, str(period), str(count * period)],
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for index in range(args.rounds):
        order = list(MODES)
        random.shuffle(order)
        for mode in order:
            results[mode].append(run(mode, args.steps))
        print(f"round {index + 1}/{args.rounds} done", file=sys.stderr)

    base_mean = statistics.median(r["mean"] for r in results["no scrapes"])
    base_p99 = statistics.median(r["p99"] for r in results["no scrapes"])
    print(f"\nbusy agent: {args.steps} steps per run, {args.rounds} rounds (medians over rounds)\n")
    print(f"{'scraping':<22} {'mean step':>10} {'x none':>7} {'p99 step':>10} {'x none':>7} "
          f"{'scrapes/run':>12} {'scrape p50':>11} {'scrape p90':>11} {'size':>8}")
    for mode, runs in results.items():
        mean = statistics.median(r["mean"] for r in runs)
        p99 = statistics.median(r["p99"] for r in runs)
        latencies = [lat for r in runs for lat in r.get("latencies", [])]
        per_run = statistics.median(len(r.get("latencies", [])) for r in runs)
        ordered = sorted(latencies)
        p50 = f"{1e3 * percentile(ordered, 0.5):.2f} ms" if ordered else "–"
        p90 = f"{1e3 * percentile(ordered, 0.9):.2f} ms" if ordered else "–"
        size = f"{runs[-1].get('size', 0) / 1024:.1f} KiB" if ordered else "–"
        print(f"{mode:<22} {1e3 * mean:>8.3f}ms {mean / base_mean:>7.3f} {1e3 * p99:>8.3f}ms "
              f"{p99 / base_p99:>7.3f} {per_run:>12.0f} {p50:>11} {p90:>11}", f"{size:>8}")

    # What one scrape costs the training process itself: its CPU time while scraped, less its
    # CPU time over as long a stretch unscraped (the background sampling), per scrape, for
    # scrapes 1.05 s apart (each renders afresh) and 0.1 s apart (most are answered from the
    # rendering kept for the sampling interval). On this 2-core box the steps above also pay
    # for the scraper process competing for the cores torch's two threads use.
    print()
    with tempfile.TemporaryDirectory() as folder:
        agent = tuneup.attach(run_dir=folder, port=0, log=False)
        try:
            loop(300)
            for label, count, period in (("fresh renders", 10, 1.05), ("within an interval", 50, 0.1)):
                time.sleep(1.2)
                before = time.process_time()
                time.sleep(count * period)
                idle = time.process_time() - before
                before = time.process_time()
                began = time.monotonic()
                scraped = run_scraper_until_done(agent.server.url + "/metrics", count, period=period)
                spent = (time.process_time() - before) - idle * (time.monotonic() - began) / (count * period)
                print(f"CPU of the training process per scrape, {label:<18}: "
                      f"{1e3 * spent / len(scraped['latencies']):.2f} ms ({len(scraped['latencies'])} scrapes)")
        finally:
            agent.detach()

    # The node daemon reading the same busy agent: its scrape = the agent's + parsing + merging.
    with tempfile.TemporaryDirectory() as folder:
        registry_dir = Path(folder) / "agents"
        os.environ["TUNEUP_REGISTRY_DIR"] = str(registry_dir)
        agent = tuneup.attach(port=0, log=False)
        node = NodeDaemon(registry_dir, gpu=False)
        url = node.start("127.0.0.1", 0)
        try:
            loop(100)
            stop = threading.Event()
            def train_until_stopped() -> None:
                while not stop.is_set():
                    loop(200)

            trainer = threading.Thread(target=train_until_stopped)
            trainer.start()
            direct = run_scraper_until_done(agent.server.url + "/metrics", 40)
            through = run_scraper_until_done(url + "/metrics", 40)
            stop.set()
            trainer.join()
        finally:
            node.stop()
            agent.detach()
    for name, result in (("agent, direct", direct), ("through the daemon", through)):
        ordered = sorted(result["latencies"])
        print(f"scrape latency, {name:<20} p50 {1e3 * percentile(ordered, 0.5):.2f} ms, "
              f"p90 {1e3 * percentile(ordered, 0.9):.2f} ms, {result['size'] / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
