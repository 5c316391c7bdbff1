"""The ``cyclone-mp`` commands that read runs and act on them: ``status``,
``runs``, ``schedules``, ``workers``, and the operator's ``cancel``, ``retry``, ``pause``,
``resume``, ``prune`` and ``signal``. Each opens a :class:`cyclone_mp.Client` on the global
``--dsn``, calls one method and prints the result with :mod:`render`; :mod:`main`
registers them on the group (:data:`COMMANDS`).
"""

from __future__ import annotations

from typing import Any, Callable

import click

from cyclone_mp.errors import InvalidTransition
from cyclone_mp.filters import RUN_STATES
from cyclone_mp.status import TERMINAL_RUN_STATES

from . import render
from .common import make_client, out
from .params import JSON, SECONDS, WHEN

# -- read commands ------------------------------------------------------------------------------------


@click.command()
@click.argument("run_id")
@click.option("--traceback", "show_traceback", is_flag=True, help="Also print the last traceback a handler raised.")
@click.option("--wide", is_flag=True, help="Every column, however narrow the terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--items", "show_items", is_flag=True,
              help="Also list the items of each map node (one row each; in the JSON, \"items\": {node: [...]}).")
def status(run_id: str, show_traceback: bool, wide: bool, as_json: bool, show_items: bool) -> None:
    """Show a run: every step (node, state, attempt, last error as `Type: message`), each
    map node's items by state, each output under its node's name, and the forensics of
    every failed attempt."""
    client = make_client()
    try:
        client.migrate()
        result = client.status(run_id)
        items = {name: all_items(client, result.id, name) for name, step in result.steps.items()
                 if step.items is not None} if show_items else None
    finally:
        client.close()
    if as_json:
        data = result.to_dict()
        if items is not None:
            data["items"] = {name: [i.to_dict() for i in rows] for name, rows in items.items()}
        render.print_json(data)
    else:
        render.print_status(out(), result, wide=wide, traceback=show_traceback, items=items)


def all_items(client: Any, run_id: str, node: str, page: int = 1000) -> list[Any]:
    """Every item of map node ``node``, in item order, read a page at a time."""
    items: list[Any] = []
    while True:
        rows = client.map_items(run_id, node, after=items[-1].item if items else -1, limit=page)
        items += rows
        if len(rows) < page:
            return items


def run_filters(states: tuple[str, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options that find runs (``runs`` and ``prune``): ``--state`` (of ``states``,
    repeatable), ``--step``, ``--queue``, ``--key``, ``--schedule``, ``--since``, ``--until``."""
    options = [
        click.option("--state", "state", multiple=True, type=click.Choice(states),
                     help="Only runs in this state (repeatable: any of them)."),
        click.option("--step", metavar="NAME", default=None, help="Only runs with a step of this step name."),
        click.option("--queue", metavar="NAME", default=None, help="Only runs with a step in this queue."),
        click.option("--key", metavar="KEY", default=None, help="Only runs with a step of this concurrency key."),
        click.option("--schedule", metavar="NAME", default=None, help="Only runs this schedule enqueued."),
        click.option("--since", type=WHEN, default=None,
                     help="Only runs created since: a duration before now (10m, 2h, 7d) or a date and time "
                          "(2026-12-04T10:30, local unless it has an offset)."),
        click.option("--until", type=WHEN, default=None, help="Only runs created before: as --since."),
    ]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


def _filters(state: tuple[str, ...], **named: Any) -> dict[str, Any]:
    """The client's filter keywords from the options of :func:`run_filters`."""
    return {"state": list(state) or None, **named}


@click.command()
@run_filters(RUN_STATES)
@click.option("--archived", is_flag=True,
              help="Also list the runs archived after they finished (worker --archive-after, 10 minutes by "
                   "default); slower on a big archive without --since.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="At most this many.")
@click.option("--wide", is_flag=True, help="Every column, however narrow the terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def runs(state: tuple[str, ...], step: str | None, queue: str | None, key: str | None, schedule: str | None,
         since: Any, until: Any, archived: bool, limit: int, wide: bool, as_json: bool) -> None:
    """List recent runs, newest first (those matching every filter given)."""
    client = make_client()
    try:
        client.migrate()
        rows = client.runs(limit=limit, archived=archived, **_filters(
            state, step=step, queue=queue, key=key, schedule=schedule, since=since, until=until))
    finally:
        client.close()
    if as_json:
        render.print_json(rows)
    elif rows:
        render.put(out(), render.runs_table(rows), wide)
    else:
        asked = any((state, step, queue, key, schedule, since, until))
        click.echo("no runs" + (" match" if asked else "")
                   + ("" if archived else " (finished runs are archived after 10 minutes by default: --archived "
                                          "lists them too)"))


@click.command()
@click.option("--wide", is_flag=True, help="Every column, however narrow the terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--delete", "delete", metavar="NAME", default=None,
              help="Forget the row of schedule NAME, one no supervisor defines any more (not active); "
                   "the runs it enqueued stay.")
def schedules(wide: bool, as_json: bool, delete: str | None) -> None:
    """Periodic schedules (mux.schedule) and their next fire times (database clock)."""
    client = make_client()
    try:
        client.migrate()
        if delete is not None:
            try:
                client.delete_schedule(delete)
            except (LookupError, InvalidTransition) as exc:
                raise click.ClickException(str(exc)) from None
            click.echo(f"deleted schedule {delete!r}")
            return
        rows = client.schedules()
    finally:
        client.close()
    if as_json:
        render.print_json(rows)
    elif rows:
        render.put(out(), render.schedules_table(rows), wide)
    else:
        click.echo("no schedules (a supervisor whose mux defines one creates it)")


@click.command()
@click.option("--wide", is_flag=True, help="Every column, however narrow the terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def workers(wide: bool, as_json: bool) -> None:
    """Live supervisors and their children: pid, step, elapsed, CPU %, RSS."""
    client = make_client()
    try:
        client.migrate()
        rows = client.workers()
    finally:
        client.close()
    if as_json:
        render.print_json(rows)
    else:
        render.print_workers(out(), rows, wide=wide)


# -- operator actions ---------------------------------------------------------------------------------


def _act(action: str, run_id: str) -> int:
    client = make_client()
    try:
        client.migrate()
        return getattr(client, action)(run_id)
    finally:
        client.close()


@click.command()
@click.argument("run_id")
def cancel(run_id: str) -> None:
    """Cancel a run: every unfinished step, in one transaction (in-flight handlers are killed)."""
    click.echo(f"cancelled run {run_id} ({_act('cancel', run_id)} step(s))")


@click.command()
@click.argument("run_id")
def retry(run_id: str) -> None:
    """Reopen a discarded (or cancelled single-step) run.

    Its discarded steps run again: max_attempts is raised, no attempt consumed.
    """
    click.echo(f"retrying run {run_id} ({_act('retry', run_id)} step(s) reopened)")


@click.command()
@click.argument("run_id")
def pause(run_id: str) -> None:
    """Pause a run: waiting steps stay put, running ones finish."""
    click.echo(f"paused run {run_id} ({_act('pause', run_id)} step(s))")


@click.command()
@click.argument("run_id")
def resume(run_id: str) -> None:
    """Resume a paused run."""
    click.echo(f"resumed run {run_id} ({_act('resume', run_id)} step(s))")


@click.command()
@click.option("--older-than", type=SECONDS, required=True, metavar="DURATION",
              help="Delete runs that finished more than this long ago (seconds, or e.g. 7d, 12h, 30m).")
@run_filters(TERMINAL_RUN_STATES)
def prune(older_than: float, state: tuple[str, ...], step: str | None, queue: str | None, key: str | None,
          schedule: str | None, since: Any, until: Any) -> None:
    """Delete finished runs (completed, discarded, cancelled) and their steps, hot or
    archived, that match every filter given (without filters besides --state, whole
    archive partitions go when their day is older). Supervisors apply a retention by
    themselves with worker --retain-completed and friends."""
    client = make_client()
    try:
        client.migrate()
        deleted = client.prune(older_than, **_filters(state, step=step, queue=queue, key=key, schedule=schedule,
                                                       since=since, until=until))
        click.echo(f"pruned {deleted} finished run(s)")
    finally:
        client.close()


@click.command("signal")
@click.argument("run_id")
@click.argument("name")
@click.option("--payload", type=JSON, default=None, metavar="JSON|@FILE", help="The signal's payload [default: null].")
def signal_(run_id: str, name: str, payload: Any) -> None:
    """Send signal NAME to a run (the first signal of a name is kept)."""
    client = make_client()
    try:
        client.migrate()
        fresh = client.signal(run_id, name, payload)
    finally:
        client.close()
    click.echo(f"signal {name!r} sent to run {run_id}" if fresh
               else f"signal {name!r} was already received by run {run_id}; the first one is kept")


#: The commands of this module (``cyclone-mp --help`` lists every command by name).
@click.group()
def queue() -> None:
    """Pause, resume and list queues (a paused queue's steps are not claimed; running ones finish)."""


@queue.command("pause")
@click.argument("name")
@click.option("--reason", default=None, help="Why (shown by `queue list`).")
def queue_pause(name: str, reason: str | None) -> None:
    """Stop claims of queue NAME on every supervisor, from now on."""
    client = make_client()
    try:
        client.migrate()
        changed = client.pause_queue(name, reason)
    finally:
        client.close()
    click.echo(f"queue {name} paused" if changed else f"queue {name} was paused already")


@queue.command("resume")
@click.argument("name")
def queue_resume(name: str) -> None:
    """Let the supervisors claim queue NAME's steps again (at once)."""
    client = make_client()
    try:
        client.migrate()
        changed = client.resume_queue(name)
    finally:
        client.close()
    click.echo(f"queue {name} resumed" if changed else f"queue {name} was not paused")


@queue.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON.")
def queue_list(as_json: bool) -> None:
    """The paused queues, since when, and why."""
    client = make_client()
    try:
        client.migrate()
        rows = client.paused_queues()
    finally:
        client.close()
    if as_json:
        render.print_json(rows)
    elif not rows:
        click.echo("no queue is paused")
    else:
        for row in rows:
            click.echo(f"{row['queue']}: paused since {render.when(row['paused_at'])}"
                       + (f" ({row['reason']})" if row.get("reason") else ""))


COMMANDS = (status, runs, schedules, workers, cancel, retry, pause, resume, prune, signal_, queue)
