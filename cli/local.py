"""The commands of one machine: ``db`` (the embedded PostgreSQL server), ``demo`` and
``dashboard`` (the web dashboard, an optional extra)."""

from __future__ import annotations

import logging
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cyclone_mp.demo import run_demo
from cyclone_mp.embedded import EmbeddedServer, default_server

from . import render
from .common import current_settings, describe_dsn, make_client, out
from .params import Seconds


@click.group()
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="The cluster directory [default: $CYCLONE_EMBEDDED_DATA_DIR, else the per-user default].")
@click.pass_context
def db(ctx: click.Context, data_dir: str | None) -> None:
    """Manage the embedded PostgreSQL server (the default when --dsn is not given).

    It is shared by every process (as root: every user) that uses the default; nothing
    but `db stop` stops it."""
    ctx.obj = default_server() if data_dir is None else EmbeddedServer(data_dir)


def _server() -> Any:
    return click.get_current_context().find_object(EmbeddedServer)


@db.command("start")
def db_start() -> None:
    """Start the server (initialising it the first time); print its URI."""
    click.echo(_server().start())


@db.command("stop")
def db_stop() -> None:
    """Stop the server, ending every session connected to it (workers reconnect once it
    is started again). Nothing else stops it: not the demo, not a worker."""
    server = _server()
    sessions = server.sessions() if server.is_running() else None
    if not server.stop():
        click.echo("not running")
        return
    ended = "" if sessions is None else f" (ended {sessions} connected session{'s' if sessions != 1 else ''})"
    click.echo("stopped" + ended)


@db.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def db_status(as_json: bool) -> None:
    """Show whether the server runs, its pid, data directory and URI."""
    info = _server().status()
    render.print_json(info) if as_json else render.print_db_status(out(), info)


@db.command("uri")
def db_uri() -> None:
    """Print the server's connection URI (fails when it is not running)."""
    click.echo(_server().uri())


# -- demo -----------------------------------------------------------------------------------------------


@click.command()
@click.option("--cpu-steps", type=click.IntRange(1, 1000), default=24, show_default=True,
              help="CPU-bound steps to run besides the three bad ones.")
@click.option("--keep", is_flag=True,
              help="Keep the demo's data (its own database on the embedded server, or its runs in --dsn) "
                   "instead of removing it at the end.")
@click.option("--wide", is_flag=True, help="Every column, however narrow the terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(cpu_steps: int, keep: bool, wide: bool, as_json: bool) -> None:
    """Run a CPU-bound workload with a wedged, a crashing and a grandchild-spawning
    handler on 2 children, then show what happened. Exits 0 when everything ended as
    expected and no process is left behind.

    On the embedded server the demo uses a database of its own, dropped at the end
    (--keep keeps it); the server itself is left running for the next commands and for
    anyone else using it (`cyclone-mp db stop` stops it)."""
    if current_settings().verbose == 0:
        logging.getLogger("cyclone_mp").setLevel(logging.ERROR)  # the demo's kills are expected
    progress = None if as_json else Progress(
        SpinnerColumn(), TextColumn("[bold]demo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=render.console(stderr=True), transient=True,
    )
    task = progress.add_task("starting", total=None) if progress is not None else None

    def tick(done: int, total: int, states: dict[str, int], elapsed: float) -> None:
        if progress is not None and task is not None:
            text = " · ".join(f"{state} {n}" for state, n in sorted(states.items()))
            progress.update(task, completed=done, total=total, description=text)

    if progress is not None:
        progress.start()
    try:
        report = run_demo(current_settings().dsn, cpu_steps=cpu_steps, keep=keep, on_tick=tick)
    finally:
        if progress is not None:
            progress.stop()
    if as_json:
        render.print_json(report.to_dict())
    else:
        render.print_demo(out(), report, wide=wide)
    if not report.ok:
        click.get_current_context().exit(1)


# -- dashboard ------------------------------------------------------------------------------------------


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --token.")
@click.option("--port", type=click.IntRange(0, 65535), default=8777, show_default=True,
              help="Port to listen on (0: any free port; the URL is printed).")
@click.option("--token", envvar="CYCLONE_DASHBOARD_TOKEN", default=None, metavar="TOKEN",
              help="Require this token on every request [env CYCLONE_DASHBOARD_TOKEN]: "
                   "'Authorization: Bearer TOKEN', or open the URL once with ?token=TOKEN.")
@click.option("--refresh", type=Seconds(most=3600), default=None, metavar="SECONDS",
              help="Seconds between a page's refreshes from the API, up to an hour (0: pages do not "
                   "refresh themselves). [default: 2]")
def dashboard(host: str, port: int, token: str | None, refresh: float | None) -> None:
    """Serve the web dashboard: counts, throughput, supervisors and their children,
    recent kills, runs, each run's attempts and forensics, and operator actions.
    Its JSON API is under /api/ (OpenAPI at /api/openapi.json). Runs until Ctrl-C or
    SIGTERM, then says "stopped" and exits 0."""
    try:
        from cyclone_mp.dashboard import check_bind, serve  # lazy: an optional extra, said so when missing
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs its extra: pip install 'cyclone-mp[dashboard]' (missing: {exc.name})") from exc
    check_bind(host, token or None)  # before touching the database: a refusal needs none
    client = make_client()
    try:
        client.migrate()
        serve(client, host=host, port=port, token=token or None, refresh=refresh,
              on_ready=lambda url: click.echo(f"cyclone-mp dashboard: {url} (database {describe_dsn(client.dsn)}; "
                                              "Ctrl-C stops)", err=True))
    except KeyboardInterrupt:  # (a Ctrl-C before the server's start): stopped all the same
        pass
    finally:
        client.close()
    click.echo("cyclone-mp dashboard: stopped", err=True)  # how a dashboard is meant to stop: exit 0


COMMANDS = [db, demo, dashboard]  #: registered on the group by :mod:`main`
