"""``cyclone-mp enqueue``: a run of a step or workflow of the user's app, with every
enqueue option of :class:`cyclone_mp.steps.StepOptions` (``tests/unit/test_options.py``
checks that they match), and ``--wait``'s live view until the run ends."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.live import Live

from cyclone_mp.errors import DatabaseBusy, DatabaseUnavailable, WaitTimeout
from cyclone_mp.steps import INT_MAX, INT_MIN, MAX_NAME_LENGTH
from cyclone_mp.waiting import timeout_message

from . import render
from .common import load_app_or_fail, make_client
from .params import BACKOFF, BYTES, JSON, RATE, SECONDS

WAIT_REFRESH = 0.25  # seconds between refreshes of enqueue --wait's live view (the end itself wakes it at once)


@click.command()
@click.argument("app")
@click.argument("name")
@click.option("--input", "input_", type=JSON, default=None, metavar="JSON|@FILE",
              help="The run's input: JSON, @file.json, or @- for stdin [default: null].")
@click.option("--timeout", type=SECONDS, default=None, help="Seconds per attempt (overrides the step's).")
@click.option("--max-attempts", type=click.IntRange(1, INT_MAX), default=None, help="Attempts before discard.")
@click.option("--max-reclaims", type=click.IntRange(0, INT_MAX), default=None,
              help="Lease expiries (crashes) reclaimed before discard (overrides the step's).")
@click.option("--backoff", type=BACKOFF, default=None,
              help="Seconds before each retry: one for all, or one per failed attempt, e.g. 1s,10s,1m "
                   "(the last repeats; overrides the step's).")
@click.option("--queue", default=None, metavar="NAME",
              help=f"Queue (overrides the step's); at most {MAX_NAME_LENGTH} characters.")
@click.option("--priority", type=click.IntRange(INT_MIN, INT_MAX), default=None,
              help="Priority; lower runs first (overrides the step's).")
@click.option("--delay", type=SECONDS, default=None, help="Seconds before the first claim.")
@click.option("--idempotency-key", default=None, metavar="KEY", help="Return the existing run for this key.")
@click.option("--concurrency-key", default=None, metavar="KEY",
              help="The run's key: its queue serves keys round-robin, limits count per key (overrides the step's).")
@click.option("--concurrency", type=click.IntRange(1, INT_MAX), default=None,
              help="At most this many running at once per (step, key) (overrides the step's).")
@click.option("--rate-limit", type=RATE, default=None,
              help="At most COUNT starts per SECONDS per (step, key), e.g. 10/1s (overrides the step's).")
@click.option("--wait", is_flag=True, help="Show live progress until the run ends; exit 1 unless it completed.")
@click.option("--wait-timeout", type=SECONDS, default=None, help="With --wait: give up after these seconds (exit 1).")
@click.option("--memory-limit", type=BYTES, default=None, metavar="SIZE",
              help="Memory cap of each attempt's whole process tree, e.g. 512M (overrides the step's).")
@click.option("--cpu-limit", type=SECONDS, default=None, help="CPU seconds of each attempt's tree (overrides the step's).")
@click.option("--max-processes", type=click.IntRange(1, 1 << 22), default=None,
              help="Processes of each attempt's tree at once (overrides the step's).")
@click.option("--max-open-files", type=click.IntRange(1, 1 << 22), default=None,
              help="Descriptors each process of the tree may open (overrides the step's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the run id, or with --wait the final status).")
def enqueue(app: str, name: str, input_: Any, timeout: float | None, max_attempts: int | None,
            max_reclaims: int | None, backoff: float | list[float] | None, queue: str | None, priority: int | None, delay: float | None,
            idempotency_key: str | None, concurrency_key: str | None, concurrency: int | None,
            rate_limit: tuple[int, float] | None, wait: bool, wait_timeout: float | None, memory_limit: int | None,
            cpu_limit: float | None, max_processes: int | None, max_open_files: int | None, as_json: bool) -> None:
    """Enqueue a run of step or workflow NAME registered in APP; print its run id."""
    if wait_timeout is not None and not wait:
        raise click.UsageError("--wait-timeout needs --wait")
    mux = load_app_or_fail(app)
    mux.lookup(name)  # an unknown name is bad usage, before touching the database
    client = make_client(mux)
    try:
        client.migrate()
        run_id = client.enqueue(name, input_, timeout=timeout, max_attempts=max_attempts,
                                max_reclaims=max_reclaims, backoff=backoff, queue=queue, priority=priority,
                                delay=delay,
                                idempotency_key=idempotency_key, concurrency_key=concurrency_key,
                                concurrency=concurrency, rate_limit=rate_limit, memory_limit=memory_limit,
                                cpu_limit=cpu_limit, max_processes=max_processes, max_open_files=max_open_files)
        if not wait:
            render.print_json({"run_id": run_id}) if as_json else click.echo(run_id)
            return
        if not as_json:
            click.echo(run_id)
        _warn_unserved(client, client.status(run_id), app)
        status = _wait(client, run_id, wait_timeout, live=not as_json)
    finally:
        client.close()
    if as_json:
        render.print_json(status.to_dict())
    else:
        took = (status.finished_at - status.created_at).total_seconds() if status.finished_at else None
        click.echo(f"run {run_id} {status.state}" + (f" in {took:.2f}s" if took is not None else ""))
        for step in status.steps.values():
            if step.state == "completed" and step.output is not None:
                click.echo(f"output[{step.name}]: {render.dumps(step.output, indent=None)}")
            elif step.error or step.error_kind:
                click.echo(f"{step.name}: {step.state} ({step.error_kind}): {render.short(render.last_error(step), 200)}",
                           err=True)
    if status.state != "completed":
        click.get_current_context().exit(1)


def _warn_unserved(client: Any, status: Any, app: str) -> None:
    """Say at once (one line per queue, on stderr) when no live supervisor serves a step
    of the run: the wait would otherwise last until one starts, in silence."""
    by_queue: dict[str, list[str]] = {}
    for step in client.unserved_steps(status):
        by_queue.setdefault(step.queue, []).append(step.step_name or step.name)
    for queue, names in by_queue.items():
        option = "" if queue == "default" else f" --queue {queue}"
        steps = ", ".join(sorted(set(names)))
        click.echo(f"Warning: no live supervisor serves queue {queue!r} with step {steps} (none runs it there); "
                   f"the run waits until one starts: cyclone-mp worker {app}{option}", err=True)


#: What a wait goes on through: the database down, or too busy to answer now.
OUTAGE = (DatabaseUnavailable, DatabaseBusy)


def _wait(client: Any, run_id: str, timeout: float | None, *, live: bool) -> Any:
    """``client.wait`` for the run (woken by LISTEN/NOTIFY when it ends), showing a live
    view on stderr refreshed from ``client.status`` every WAIT_REFRESH seconds."""

    start = time.monotonic()
    con = render.console(stderr=True)
    status = client.status(run_id)
    view = Live(render.wait_view(status, 0.0), console=con, refresh_per_second=8, transient=False) if live else None
    try:
        if view is not None:
            view.start()
        while not status.terminal:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                break
            step = WAIT_REFRESH if left is None else min(WAIT_REFRESH, left)
            try:
                status = client.wait(run_id, timeout=step)
            except WaitTimeout:
                status = _refreshed(client, run_id, status)  # the progress to show
            except OUTAGE:  # waited through, within the timeout
                time.sleep(step)
            if view is not None:
                view.update(render.wait_view(status, time.monotonic() - start))
    except KeyboardInterrupt:
        if view is not None:
            view.stop()
        raise click.ClickException(f"stopped waiting; run {run_id} goes on (cyclone-mp status {run_id})") from None
    finally:
        if view is not None:
            view.stop()
            if not con.is_terminal:
                con.line()  # a non-terminal Live leaves its last frame without a newline
    if not status.terminal:
        raise click.ClickException(timeout_message(run_id, status, timeout))
    return status


def _refreshed(client: Any, run_id: str, status: Any) -> Any:
    """The run's status now, for the live view; ``status`` (the last one read) while the
    database does not answer (an outage, PgBouncer refusing logins after a restart): the
    wait goes on, bounded by its own timeout, as ``client.wait`` is (docs/python-apps.md)."""
    try:
        return client.status(run_id)
    except OUTAGE:
        return status


COMMANDS = [enqueue]  #: registered on the group by :mod:`main`
