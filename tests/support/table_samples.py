"""Sample data for the CLI's tables, as the library returns it (tests/acceptance/test_tables.py):
runs with keys, waiting reasons and schedules; a workflow run with a running step (its
progress, its key and the limit it waits on), a discarded step killed for its timeout
and a long error; supervisors with busy, idle and starting children; schedules; a demo
report."""

from __future__ import annotations

import datetime as dt
from typing import Any

from cyclone_mp.demo import DemoReport, DemoRow
from cyclone_mp.status import RunStatus, StepStatus

NOW = dt.datetime(2026, 12, 4, 10, 30, 15, 123000, tzinfo=dt.timezone.utc)
RUN_IDS = [f"0f6e2b1c-4d3a-4c8e-9b7a-{n:012x}" for n in range(1, 6)]
KEY = "tenant-acme"
LONG_ERROR = ("ValueError: the image at s3://bucket/uploads/2026/12/04/very-long-object-name.png could not be "
              "decoded: unsupported colour profile")


def run_rows() -> list[dict[str, Any]]:
    """``client.runs()`` rows."""
    return [
        {"id": RUN_IDS[0], "name": "resize", "kind": "step", "state": "running", "steps": 1, "created_at": NOW,
         "finished_at": None, "key": KEY, "waiting_on": "concurrency", "schedule": None},
        {"id": RUN_IDS[1], "name": "nightly_report_for_every_tenant", "kind": "workflow", "state": "completed",
         "steps": 4, "created_at": NOW, "finished_at": NOW, "key": None, "waiting_on": None, "schedule": "nightly"},
        {"id": RUN_IDS[2], "name": "sync", "kind": "step", "state": "discarded", "steps": 1, "created_at": NOW,
         "finished_at": NOW, "key": "globex", "waiting_on": "rate_limit", "schedule": None},
        {"id": RUN_IDS[3], "name": "x", "kind": "step", "state": "cancelled", "steps": 1, "created_at": NOW,
         "finished_at": NOW, "key": None, "waiting_on": None, "schedule": None},
    ]


def _step(name: str, state: str, **kw: Any) -> StepStatus:
    base: dict[str, Any] = dict(name=name, state=state, attempt=1, max_attempts=3, reclaims=0, error=None,
                                error_kind=None, errors=[], started_at=None, finished_at=None, lease_owner=None,
                                output=None, step_name=name)
    base.update(kw)
    return StepStatus(**base)


def run_status() -> RunStatus:
    """A workflow run: one step done, one running under a key that waits on its
    concurrency limit, one discarded after a timeout kill, one pending."""
    killed = {"attempt": 3, "kind": "timeout", "type": "builtins.TimeoutError", "message": "step timed out after 30s",
              "killed_by_supervisor": True, "trigger": "timeout", "signal": 9, "signal_name": "SIGKILL",
              "cpu_seconds": 29.87, "peak_rss_kb": 512000, "elapsed": 35.01, "at": NOW.isoformat(),
              "tree": {"peak_memory_kb": 600000, "cpu_seconds": 31.2, "processes": 3}}
    failed = {"attempt": 2, "kind": "error", "type": "builtins.ValueError", "message": LONG_ERROR.split(": ", 1)[1],
              "at": NOW.isoformat(), "exit_code": None}
    steps = {
        "fetch": _step("fetch", "completed", started_at=NOW, finished_at=NOW + dt.timedelta(seconds=1.5),
                       output={"n": 3}),
        "resize_every_image": _step("resize_every_image", "running", attempt=2, started_at=NOW,
                                    progress={"done": 3, "total": 10, "message": "resizing"},
                                    concurrency_key=KEY, concurrency=2, running_in_group=2,
                                    waiting_on="concurrency"),
        "transcode": _step("transcode", "discarded", attempt=3, error="step timed out after 30s",
                           error_kind="timeout", errors=[failed, killed], started_at=NOW, finished_at=NOW,
                           memory_limit=512 << 20),
        "notify": _step("notify", "pending", depends_on=("transcode",)),
    }
    return RunStatus(id=RUN_IDS[0], name="media_pipeline", kind="workflow", state="discarded", input={"id": 7},
                     created_at=NOW, finished_at=NOW, steps=steps)


def worker_rows() -> list[dict[str, Any]]:
    """``client.workers()`` rows: a supervisor with a busy (capped), an idle and a starting child."""
    children = [
        {"pid": 4242001, "steps_run": 12, "cpu_percent": 99.5, "rss": 48 << 20, "run_id": RUN_IDS[0],
         "node": "resize_every_image", "step": "resize", "attempt": 2, "elapsed": 12.25,
         "limits": {"memory_limit": 512 << 20, "max_processes": 20}},
        {"pid": 4242002, "steps_run": 40, "cpu_percent": 0.0, "rss": 30 << 20},
        {"pid": 4242003, "steps_run": 0, "cpu_percent": None, "rss": None, "ready": False},
    ]
    return [{"id": "sup-host-a-4242", "hostname": "host-a", "pid": 4242, "started_at": NOW, "heartbeat_at": NOW,
             "age": 0.4, "info": {"queues": ["default", "images"], "children": children,
                                  "maintenance": {"last_sweep_age": 0.5}}}]


def schedule_rows() -> list[dict[str, Any]]:
    """``client.schedules()`` rows."""
    return [
        {"name": "nightly", "target": "nightly_report_for_every_tenant",
         "spec": {"cron": "0 3 * * *", "tz": "Europe/Paris", "catch_up": "latest"}, "next_at": NOW,
         "last_slot": NOW, "runs": 12, "skipped": 0, "active": True, "definitions": [{}]},
        {"name": "heartbeat", "target": "ping", "spec": {"every": 30.0, "catch_up": "none"}, "next_at": NOW,
         "last_slot": None, "runs": 3, "skipped": 1, "active": False, "definitions": []},
    ]


def demo_report() -> DemoReport:
    """A demo report: CPU steps, the wedged, crashing and grandchild-spawning ones."""
    def row(n: int, step: str, state: str, kind: str | None, expected: str, ok: bool = True, **kw: Any) -> DemoRow:
        return DemoRow(run_id=RUN_IDS[n % 5], step=step, role=step, state=state, attempt=kw.pop("attempt", 1),
                       max_attempts=3, reclaims=0, error_kind=kind, error=kw.pop("error", None), duration=1.234,
                       expected=expected, ok=ok, forensics=kw.pop("forensics", None))
    killed = {"killed_by_supervisor": True, "trigger": "timeout", "signal": 9, "signal_name": "SIGKILL"}
    rows = [row(i, "demo.crunch", "completed", None, "completed") for i in range(3)]
    rows.append(row(3, "demo.wedge", "discarded", "timeout", "discarded (timeout)", attempt=2,
                    error="step timed out after 2s", forensics=killed))
    rows.append(row(4, "demo.crash", "discarded", "child_exited", "discarded (child_exited)", attempt=2,
                    error="child exited with signal SIGSEGV", forensics={"signal": 11, "signal_name": "SIGSEGV",
                                                                         "killed_by_supervisor": False}))
    rows.append(row(0, "demo.grandchild", "running", None, "discarded (timeout)", ok=False))
    return DemoReport(rows=rows, completed=3, discarded=2, other=1, killed=2, grandchildren_killed=2,
                      grandchildren=[5001, 5002], grandchildren_alive=[], leftover_pids=[], cpu_steps=3,
                      cpu_throughput=2.5, run_seconds=10.0, wall_seconds=12.0, database="postgresql://localhost/demo",
                      embedded=False, server_started=False, own_database=False, kept=False, supervisor_id="sup-1",
                      stats={}, checks={"all": True})
