"""Smoke test of benchmarks/run.py: a quick run of B1, B3 and B5 exits 0 and writes JSON.

It measures nothing against a target (timed targets live in the benchmark, never in a
test); it only checks that the benchmark harness still runs against the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # the benchmark script end to end (a minute of CPU on 2 cores)
def test_quick_benchmark_run(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--only", "B1,B3,B5",
           "--repeat", "1", "--out", str(out)]
    env = dict(os.environ)
    dsn = os.environ.get("CYCLONE_TEST_DSN")
    if dsn:
        cmd += ["--dsn", dsn]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    for key in ("B1", "B3", "B5"):
        assert key in data, f"{key} missing from {sorted(data)}"
        assert data[key]["samples"], f"{key} has no sample: {data[key].get('errors')}"
        assert not data[key]["errors"]
    assert data["B1"]["median"]["steps_per_s"] > 0
    assert data["B1"]["median"]["enqueue_many_one_call_per_s"] > 0
    assert data["B3"]["samples"][0]["killed_by_supervisor"] is True
    assert data["B5"]["median"]["p50_ms"] > 0
    assert "meta" in data and "summary" in data


def test_results_say_when_the_engine_had_uncommitted_changes(tmp_path):
    """The engine is cyclone_mp/ and cli/ (once it looked at a folder that no longer
    existed, so a dirty engine was reported clean)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import run as bench_run
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    engine = tmp_path / "cyclone_mp"
    engine.mkdir(parents=True)
    (engine / "store.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "one"]):
        subprocess.run(git + args, cwd=tmp_path, check=True, capture_output=True)
    assert bench_run.git_state(str(tmp_path))["engine_uncommitted_changes"] is False
    (engine / "store.py").write_text("x = 2\n")
    state = bench_run.git_state(str(tmp_path))
    assert state["engine_uncommitted_changes"] is True and len(state["commit"]) >= 7
