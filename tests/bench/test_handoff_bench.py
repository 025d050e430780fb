"""bench/handoff.py on a small corpus: its JSON line, from two real jobs (one with
handoffs, one without), says every sample arrived once with the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # make test-slow: two jobs


def test_the_handoff_bench_prints_one_line_of_a_real_run():
    out = subprocess.run(
        # 100 steps of 2 micro-batches at 30 ms: about 6 s of job for two handoffs (each taken
        # within half a second); a job that ran out of steps first would make fewer
        [sys.executable, str(BENCH / "handoff.py"), "--json", "--rows", "800", "--handoffs", "2", "--step-ms", "30"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["handoffs"] == 2 and line["lost"] == 0 and line["duplicated"] == 0, line
    assert line["bytes_identical"] is True and line["ended"] == ["stop"], line
    assert line["median_gap_ms"] > 0 and line["stall_ms"] >= 0, line
