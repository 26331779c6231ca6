"""A pytest plugin for the GPU proof: each failure's traceback is printed the moment the test
ends, so a run cut short by its time budget still says why every finished test failed; and the
lines a passing test prints that start with "figure:" (the MFU by tuneup and by hand, say) are
printed too, with pytest-xdist's workers as without them.

    python -m pytest -m gpu -p benchmarks.live_report
"""

from __future__ import annotations

import sys

FIGURE = "figure:"
_worker = False  # an xdist worker: its reports reach the controller, which prints them once


def pytest_configure(config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    if _worker:
        return
    if report.failed:
        print(f"\n=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n",
              file=sys.stderr, flush=True)
    elif report.when == "call":
        for line in report.capstdout.splitlines():
            if line.startswith(FIGURE):
                print(f"{report.nodeid}: {line}", file=sys.stderr, flush=True)
