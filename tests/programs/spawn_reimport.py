"""attach() at module level with no __main__ guard: a spawned child re-imports this file."""

import multiprocessing
import sys

import tuneup

agent = tuneup.attach(run_dir=sys.argv[1])


def report() -> None:
    child = tuneup.current()
    state = "none" if child is None else ("enabled" if child.enabled else "inert")
    print(f"child:{state}", flush=True)


if __name__ == "__main__":
    print(f"main:{'enabled' if agent.enabled else 'inert'}", flush=True)
    process = multiprocessing.get_context("spawn").Process(target=report)
    process.start()
    process.join()
    agent.detach()
    sys.exit(process.exitcode)
