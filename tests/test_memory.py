"""Memory stays flat over a long run: every buffer the agent keeps is bounded."""

from __future__ import annotations

import json

from tests.conftest import run_program

STEPS = 200_000


def test_rss_stays_flat_over_200k_steps(tmp_path):
    result = run_program("long_run.py", str(tmp_path / "run"), str(STEPS), timeout=600)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["steps"] == STEPS
    growth = measured["end_rss"] - measured["warm_rss"]
    assert growth < 3 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over {STEPS} steps"
