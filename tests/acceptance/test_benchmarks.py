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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def _peers_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import peers
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return peers


def test_peers_without_the_harness_says_where_it_looked(tmp_path):
    """``--peers`` with no harness at the given path: exit 2 and one line naming the path
    and the option, no traceback (issue 23)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--peers",
                           "--peer-bench", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert str(tmp_path / "nowhere") in proc.stdout and "--peer-bench" in proc.stdout


def test_peers_without_pgqueuer_says_how_to_install_it(tmp_path):
    """An interpreter that cannot import pgqueuer: the message names the pinned versions of
    the harness's requirements.txt and the pip command (issue 23)."""
    harness = tmp_path / "peer-bench"
    (harness / "harness" / "peers").mkdir(parents=True)
    (harness / "run.py").write_text("")
    (harness / "harness" / "peers" / "cmp.py").write_text("")
    (harness / "requirements.txt").write_text("asyncpg==0.32.0\npgqueuer==9.9.9\n")
    bare = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    python = str(bare / "bin" / "python")
    peers = _peers_module()
    with pytest.raises(peers.PeerBenchUnavailable) as info:
        peers.check_python(python, peers.find_harness(str(harness)))
    text = str(info.value)
    assert "pgqueuer" in text and f"{python} -m pip install 'pgqueuer==9.9.9' 'asyncpg==0.32.0'" in text


def test_peers_summary_ratios_and_targets():
    """The comparison's medians, ratios (cyclone_mp / pgqueuer) and issue 23's verdicts,
    from a harness JSON of two repetitions."""
    peers = _peers_module()

    def s1(peer, jobs, enq):
        return [{"peer": peer, "variant": "v", "jobs_per_s": j, "enqueue_per_s": e, "jobs_per_s_incl_startup": j / 2}
                for j, e in zip(jobs, enq)]

    data = {
        "S1": s1("cyclone_mp-defaults", [900, 1100], [2000, 2400]) + s1("cyclone_mp", [12000, 14000], [2100, 2300])
        + s1("pgqueuer", [6000, 8000], [2000, 2000]),
        "S1_bulk": [],
        "S2": [{"peer": "cyclone_mp-defaults", "variant": "x", "efficiency_vs_pool2": 0.96},
               {"peer": "cyclone_mp", "variant": "x", "efficiency_vs_pool2": 0.90},
               {"peer": "pgqueuer", "variant": "2 procs, batch 10 (defaults)", "efficiency_vs_pool2": 0.80},
               {"peer": "pgqueuer", "variant": "2 procs, batch 1, max_concurrent_tasks 2", "efficiency_vs_pool2": 0.5}],
    }
    rows = {r["metric"]: r for r in peers.summarize(data)}
    assert rows["s1"]["median"] == {"cyclone_mp-defaults": 1000, "cyclone_mp": 13000, "pgqueuer": 7000}
    assert rows["s1"]["ratio"] == {"cyclone_mp-defaults": round(1000 / 7000, 3), "cyclone_mp": round(13000 / 7000, 3)}
    assert rows["s1"]["target"]["cyclone_mp-defaults"]["met"] is False
    assert rows["s1"]["target"]["cyclone_mp"]["met"] is True  # 1.857 >= 1.8
    assert rows["enqueue"]["ratio"]["cyclone_mp-defaults"] == 1.1
    assert rows["enqueue"]["target"]["cyclone_mp"]["met"] is True
    assert rows["s2_pool2"]["median"]["pgqueuer"] == 0.80  # its defaults layout, not batch 1
    assert rows["s2_pool2"]["target"]["cyclone_mp-defaults"]["met"] is True
    assert rows["s2_pool2_pgq_batch1"]["median"]["pgqueuer"] == 0.5


@pytest.mark.slow  # benchmarks/maps.py end to end, small counts (~10 s)
def test_quick_map_benchmark_run(tmp_path):
    out = tmp_path / "maps.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "maps.py"), "--quick", "--repeat", "1", "--out", str(out)]
    if os.environ.get("CYCLONE_TEST_DSN"):
        cmd += ["--dsn", os.environ["CYCLONE_TEST_DSN"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    results = json.loads(out.read_text())["results"]
    assert results["M1"][0]["ratio"] > 0 and results["M2"][0]["fanout_s"] > 0
    assert results["M3"][0]["join_kind"] in ("list", "Outputs")
