"""The ``cyclone-mp demo`` workload: real CPU work, plus three handlers that misbehave.

:func:`run_demo` runs a supervisor in this process (``client.start()``, 2 children) on
the embedded default server (or any DSN), enqueues ``cpu_steps`` CPU-bound steps
interleaved with three bad ones, waits until every run is terminal, shuts the supervisor
down and returns a :class:`DemoReport`. Expected: ``demo.cpu`` completed; ``demo.wedge``
(native code holding the GIL) killed by the supervisor and discarded as a ``timeout``;
``demo.crash`` (``os.abort()``) discarded as ``child_exited``; ``demo.grandchild``
discarded as a ``timeout``, with both its grandchildren (one ``setsid``'d) gone.

On the embedded server the demo runs in a database of its own,
``cyclone_demo_<pid>_<hex>`` (``keep=True``: ``cyclone_demo_kept_<hex>``), dropped at the
end or by the next demo if this one died; on a given DSN, in a queue of its own whose
runs it deletes. It never stops the embedded server, which others may be using. The
handlers live at module level so children import them as ``cyclone_mp.demo``; importing
this module is cheap (stdlib and the light part of cyclone_mp only).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import os
import random
import re
import resource
import subprocess
import time
import uuid
import zlib
from typing import Any, Callable

import cyclone_mp as cy
from .errors import DatabaseUnavailable
from .status import RunStatus

CPU_BLOCKS = 12  #: blocks per CPU step; one block is ~20-30 ms of compress + hash
GRANDCHILD_MESSAGE = "spawned grandchildren pids={pids}; now hanging"
_PIDS_RE = re.compile(r"pids=([\d,]+)")


# -- handlers (imported by the children) ----------------------------------------------------


@cy.step("demo.cpu", timeout=30, max_attempts=3)
def crunch(ctx: cy.Context, inp: dict) -> dict:
    """CPU-bound work: per block, generate ~250 KB of text, zlib it, chain-hash it.

    Input: ``{"index": int, "blocks": int}``. Output: ``{"index", "sha256", "raw_bytes",
    "compressed_bytes", "cpu_seconds"}``. Checks cancellation between blocks.
    """
    index, blocks = int(inp.get("index", 0)), int(inp.get("blocks", CPU_BLOCKS))
    started = time.process_time()
    rng = random.Random(index)
    words = [bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(2000)]
    digest, raw, packed = hashlib.sha256(), 0, 0
    for block in range(blocks):
        ctx.check_cancellation()
        data = b" ".join(rng.choices(words, k=40_000))
        compressed = zlib.compress(data, 9)
        raw, packed = raw + len(data), packed + len(compressed)
        chained = hashlib.sha256(compressed).digest()
        for _ in range(64):
            chained = hashlib.sha256(chained + data).digest()
        digest.update(chained)
        ctx.set_progress(block + 1, blocks, f"block {block + 1}/{blocks}")
    return {"index": index, "sha256": digest.hexdigest(), "raw_bytes": raw, "compressed_bytes": packed,
            "cpu_seconds": round(time.process_time() - started, 3)}


@cy.step("demo.wedge", timeout=2, max_attempts=1)
def wedge(ctx: cy.Context, inp: Any) -> None:
    """Wedge in C code holding the GIL for hours: only a SIGKILL ends it."""
    ctx.set_progress(0, None, "entering a native loop that ignores cancellation")
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)


@cy.step("demo.crash", timeout=30, max_attempts=1)
def crash(ctx: cy.Context, inp: Any) -> None:
    """Kill the child process with SIGABRT (no core file: RLIMIT_CORE is set to 0 first)."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


@cy.step("demo.grandchild", timeout=2, max_attempts=1)
def spawn_and_hang(ctx: cy.Context, inp: Any) -> None:
    """Start two ``sleep 300`` grandchildren (one in a new session), report their pids in
    the progress message, then hang ignoring cancellation until killed."""
    kids = [
        subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL),
        subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         start_new_session=True),
    ]
    ctx.set_progress(0, None, GRANDCHILD_MESSAGE.format(pids=",".join(str(k.pid) for k in kids)))
    while True:  # a handler that never looks at ctx.cancelled
        time.sleep(3600)


ROLES = {  # step name -> (role, expected state, expected error_kind)
    "demo.cpu": ("cpu", "completed", None),
    "demo.wedge": ("wedged", "discarded", "timeout"),
    "demo.crash": ("crasher", "discarded", "child_exited"),
    "demo.grandchild": ("grandchild", "discarded", "timeout"),
}


def build_mux() -> cy.Mux:
    """The demo's mux: the four steps above."""
    return cy.Mux().register(crunch, wedge, crash, spawn_and_hang)


# -- the report -----------------------------------------------------------------------------


@dataclasses.dataclass
class DemoRow:
    """One run of the demo. ``duration`` is seconds (finished - started on the DB clock,
    or created -> finished when the step never started); ``ok`` says it ended as expected."""

    run_id: str
    step: str
    role: str
    state: str
    attempt: int
    max_attempts: int
    reclaims: int
    error_kind: str | None
    error: str | None
    duration: float | None
    expected: str
    ok: bool
    forensics: dict[str, Any] | None = None


@dataclasses.dataclass
class DemoReport:
    """What the demo saw. Counts are numbers of runs; times are seconds.

    ``checks`` maps a check name to True/False; ``ok`` is True when all pass (the CLI
    exits 0). ``leftover_pids`` are processes still alive that this demo's supervisor
    started (by marker or as descendants of this process); ``grandchildren_alive`` the
    recorded grandchild pids still present after the run. ``database`` is the
    (redacted) DSN the demo ran on; ``own_database`` says it was a database made for the
    demo; ``kept`` says its data was kept (else the database was dropped, or the demo's
    runs deleted). The embedded server is never stopped (``server_started``: this demo
    started it).
    """

    rows: list[DemoRow]
    completed: int
    discarded: int
    other: int
    killed: int
    grandchildren_killed: int
    grandchildren: list[int]
    grandchildren_alive: list[int]
    leftover_pids: list[int]
    cpu_steps: int
    cpu_throughput: float | None
    run_seconds: float
    wall_seconds: float
    database: str
    embedded: bool
    server_started: bool
    own_database: bool
    kept: bool
    supervisor_id: str | None
    stats: dict[str, int]
    checks: dict[str, bool]
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (with ``ok``)."""
        data = dataclasses.asdict(self)
        data["ok"] = self.ok
        return data


TickFn = Callable[[int, int, dict[str, int], float], None]


def _duration(status: RunStatus) -> float | None:
    step = status.step
    end = step.finished_at or status.finished_at
    start = step.started_at or status.created_at
    if end is None or start is None:
        return None
    return round((end - start).total_seconds(), 3)


def _row(status: RunStatus) -> DemoRow:
    step = status.step
    role, want_state, want_kind = ROLES.get(step.step_name or step.name, ("?", "completed", None))
    last = step.errors[-1] if step.errors else None
    forensics = None
    if last:
        forensics = {k: last.get(k) for k in ("exit_code", "signal", "signal_name", "killed_by_supervisor",
                                              "trigger", "cpu_seconds", "peak_rss_kb") if k in last}
    return DemoRow(
        run_id=status.id, step=step.step_name or step.name, role=role, state=step.state, attempt=step.attempt,
        max_attempts=step.max_attempts, reclaims=step.reclaims, error_kind=step.error_kind, error=step.error,
        duration=_duration(status), expected=want_state + (f" ({want_kind})" if want_kind else ""),
        ok=step.state == want_state and step.error_kind == want_kind, forensics=forensics,
    )


def _grandchild_pids(statuses: list[RunStatus]) -> list[int]:
    for status in statuses:
        step = status.step
        if step.step_name == "demo.grandchild" and isinstance(step.progress, dict):
            match = _PIDS_RE.search(str(step.progress.get("message") or ""))
            if match:
                return [int(p) for p in match.group(1).split(",") if p]
    return []


def _alive(pids: list[int]) -> list[int]:
    import psutil  # lazy: children import demo for its handlers

    return [pid for pid in pids if psutil.pid_exists(pid)]


def _leftover_processes(supervisor_id: str | None) -> list[int]:
    """Pids of processes this demo left behind: any process carrying our supervisor's
    marker, and any descendant of this process."""
    import psutil  # lazy: children import demo for its handlers

    from .procs import MARKER_ENV  # lazy: children import demo for its handlers

    left: set[int] = set()
    with contextlib.suppress(psutil.Error):
        left.update(p.pid for p in psutil.Process().children(recursive=True))
    if supervisor_id:
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARKER_ENV) == supervisor_id:
                    left.add(proc.pid)
    return sorted(left)


def _settle(check: Callable[[], list[int]], seconds: float) -> list[int]:
    """Call ``check`` until it returns nothing or ``seconds`` pass; returns the last result."""
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _drive(client: Any, cpu_steps: int, time_limit: float, on_tick: TickFn | None,
           run_ids: list[str]) -> tuple[list[RunStatus], bool, float]:
    """Start the supervisor, enqueue (appending each run id to ``run_ids``), wait, stop;
    returns ``(final statuses in enqueue order, timed out, seconds from start to the last
    run's end)``. The supervisor is always stopped, also when this raises."""
    slots = [(cpu_steps // 4, wedge), (cpu_steps // 2, crash), ((3 * cpu_steps) // 4, spawn_and_hang)]
    statuses: dict[str, RunStatus] = {}
    timed_out = False
    try:
        client.migrate()
        client.start()
        run_start = time.monotonic()
        for i in range(cpu_steps):
            run_ids.append(client.enqueue(crunch, {"index": i, "blocks": CPU_BLOCKS}))
            run_ids.extend(client.enqueue(bad, {"index": i}) for slot, bad in slots if slot == i)
        deadline = run_start + time_limit
        while True:
            for rid in run_ids:
                if rid not in statuses or not statuses[rid].terminal:
                    statuses[rid] = client.status(rid)
            states = collections.Counter(s.step.state for s in statuses.values())
            done = sum(1 for s in statuses.values() if s.terminal)
            if on_tick is not None:
                on_tick(done, len(run_ids), dict(states), time.monotonic() - run_start)
            if done == len(run_ids):
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.1)
        run_seconds = time.monotonic() - run_start
    except BaseException:
        client.stop()
        for rid in run_ids:  # interrupted: its private queue has no worker left, so end its runs
            try:
                client.cancel(rid)
            except DatabaseUnavailable:
                break  # the database is gone: the next runs would fail the same way
            except Exception:  # noqa: BLE001 - e.g. a run that ended meanwhile
                pass
        raise
    if timed_out:
        client.stop()
    else:
        client.shutdown()
    # Read once more: a killing supervisor annotates the entries its sweep wrote first.
    return [client.status(rid) for rid in run_ids], timed_out, run_seconds


DEMO_DB_PREFIX = "cyclone_demo_"  #: databases the demo makes on the embedded server


def _drop_stale_demo_databases(admin_dsn: str) -> None:
    """Drop demo databases whose demo process is gone (``cyclone_demo_<pid>_<hex>``: the
    embedded server takes Unix-socket connections only, so every demo ran on this host)."""
    from .store.server import drop_database, list_databases  # lazy: children import demo for its handlers

    import psutil  # lazy: children import demo for its handlers

    for name in list_databases(admin_dsn, DEMO_DB_PREFIX):
        pid = name[len(DEMO_DB_PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(cy.DatabaseError):
                drop_database(admin_dsn, name)


def run_demo(
    dsn: str | None = None,
    *,
    cpu_steps: int = 24,
    workers: int = 2,
    time_limit: float = 45.0,
    keep: bool = False,
    on_tick: TickFn | None = None,
) -> DemoReport:
    """Run the demo end to end; see the module docstring.

    Args:
        dsn: PostgreSQL DSN; None uses the embedded default server (started if needed,
            never stopped), in a database made for this demo.
        cpu_steps: how many CPU-bound steps to enqueue (>= 1).
        workers: child slots of the in-process supervisor.
        time_limit: seconds to wait for every run to end before a hard stop.
        keep: keep the demo's data (its database, or its runs in ``dsn``); by default
            they are removed at the end, also when the demo fails.
        on_tick: called about 10 times a second while waiting, with
            ``(terminal runs, total runs, {state: count}, elapsed seconds)``.

    Returns:
        The :class:`DemoReport`; its ``ok`` says whether everything ended as expected.

    Raises:
        ConfigurationError: bad arguments. DatabaseError: the database is unreachable
        (DatabaseUnavailable, in one line, when it goes away during the demo).
        EmbeddedError: the embedded server could not be started.
    """
    from .client import Client  # lazy: children import demo for its handlers
    from .embedded import default_server  # lazy: children import demo for its handlers
    from .connections import redact  # lazy: children import demo for its handlers
    from .store.server import create_database, drop_database  # lazy: as above

    if not isinstance(cpu_steps, int) or cpu_steps < 1:
        raise cy.ConfigurationError(f"cpu_steps must be an int >= 1, got {cpu_steps!r}")
    wall_start = time.monotonic()
    server, server_started, admin_dsn, own_db = None, False, None, None
    if dsn is None:
        server = default_server()
        admin_dsn, server_started = server.launch()
        _drop_stale_demo_databases(admin_dsn)
        # the pid marks a database to drop if its demo dies; a kept one has none
        own_db = f"{DEMO_DB_PREFIX}{'kept' if keep else os.getpid()}_{uuid.uuid4().hex[:6]}"
        create_database(admin_dsn, own_db)
        dsn = server.uri(own_db)
    queue = f"demo-{uuid.uuid4().hex[:8]}"  # isolates this demo from any other work in the database
    client = Client(dsn, build_mux(), workers=workers, lease_ttl=5.0, kill_grace=0.5,
                    poll_interval=(0.05, 0.5), shutdown_grace=5.0, queues=[queue], queue=queue)
    run_ids: list[str] = []
    try:
        ordered, timed_out, run_seconds = _drive(client, cpu_steps, time_limit, on_tick, run_ids)
    finally:
        if not keep and own_db is None and run_ids:
            with contextlib.suppress(cy.DatabaseError):
                client._call(lambda store: store.runs.delete(run_ids))
        client.close()
        if own_db is not None and admin_dsn is not None and not keep:
            with contextlib.suppress(cy.DatabaseError):
                drop_database(admin_dsn, own_db)
    sup = client.supervisor
    supervisor_id = sup.id if sup is not None else None
    stats = dict(sup.stats) if sup is not None else {}

    rows = [_row(s) for s in ordered]
    grandchildren = _grandchild_pids(ordered)
    grandchildren_alive = _settle(lambda: _alive(grandchildren), 3.0)
    leftovers = _settle(lambda: _leftover_processes(supervisor_id), 3.0)

    cpu = [s.step for s in ordered if s.step.step_name == "demo.cpu" and s.step.state == "completed"]
    throughput = None
    if cpu and all(s.started_at and s.finished_at for s in cpu):
        span = (max(s.finished_at for s in cpu) - min(s.started_at for s in cpu)).total_seconds()  # type: ignore[type-var]
        throughput = round(len(cpu) / span, 2) if span > 0 else None
    by_role = {r.role: r for r in rows if r.role != "cpu"}
    checks = {
        "every run ended": not timed_out,
        "wedged step ended timeout": "wedged" in by_role and by_role["wedged"].ok,
        "crasher ended child_exited": "crasher" in by_role and by_role["crasher"].ok,
        "grandchild step ended timeout": "grandchild" in by_role and by_role["grandchild"].ok,
        "grandchild pids recorded": len(grandchildren) == 2,
        "grandchildren gone": len(grandchildren) == 2 and not grandchildren_alive,
        "every CPU step completed": all(r.ok for r in rows if r.role == "cpu"),
        "no handler process left": not leftovers,
    }
    return DemoReport(
        rows=rows, completed=sum(r.state == "completed" for r in rows),
        discarded=sum(r.state == "discarded" for r in rows),
        other=sum(r.state not in ("completed", "discarded") for r in rows),
        killed=stats.get("killed", 0), grandchildren_killed=stats.get("grandchildren_killed", 0),
        grandchildren=grandchildren, grandchildren_alive=grandchildren_alive, leftover_pids=leftovers,
        cpu_steps=cpu_steps, cpu_throughput=throughput, run_seconds=round(run_seconds, 3),
        wall_seconds=round(time.monotonic() - wall_start, 3), database=redact(dsn),
        embedded=server is not None, server_started=server_started, own_database=own_db is not None, kept=keep,
        supervisor_id=supervisor_id, stats=stats, checks=checks, timed_out=timed_out,
    )
