"""The ``cyclone-mp`` command line.

A thin layer: each command parses its options, sets up logging, calls one library
function (a :class:`cyclone_mp.Client` method, :func:`cyclone_mp.apps.load_app`, the
embedded server, :func:`cyclone_mp.demo.run_demo`) and prints the result with
:mod:`render`. No SQL and no process logic live here. The commands that read runs and
act on them are in :mod:`runs`, ``enqueue`` in :mod:`submit`, ``db``, ``demo`` and
``dashboard`` in :mod:`local`; what the commands share (the global options, the client
made from them) is :mod:`common`. This module holds the group, ``worker`` and ``migrate``.

Exit codes: 0 ok; 1 the run or the command failed (unreachable database, unknown run
id, a run that did not complete); 2 bad usage (malformed JSON, unknown step name, an
APP that does not import, an invalid option). Every error is ONE line on stderr,
never a traceback (``-v`` adds the traceback of unexpected errors).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from cyclone_mp.config import PREFETCH_DEFAULT, START_METHODS
from cyclone_mp.connections import redact
from cyclone_mp.errors import ConfigurationError, CycloneError, PayloadError, UnknownStep
from cyclone_mp.procs import holds_password
from cyclone_mp.steps import INT_MAX

from . import local, render, runs, submit
from .common import Settings, describe_dsn, load_app_or_fail, make_client
from .drain import DrainReporter
from .params import BYTES, DURATION_OR_NEVER, POLL, SECONDS

USAGE_ERRORS = (UnknownStep, PayloadError, ConfigurationError)  # the caller's input is wrong: exit 2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LibraryUsageError(click.UsageError):
    """A library error caused by the caller's input (exit 2, no usage hint)."""


class LibraryError(click.ClickException):
    """A library error that makes the command fail (exit 1)."""


class CycloneGroup(click.Group):
    """A click group that turns cyclone_mp errors into one-line click errors."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CycloneError as exc:
            message = " ".join(str(exc).split("\n")[0].split()) or type(exc).__name__
            if isinstance(exc, USAGE_ERRORS):
                raise LibraryUsageError(message, ctx) from exc
            raise LibraryError(message) from exc


# -- the group ---------------------------------------------------------------------------------------


@click.group(cls=CycloneGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--dsn", envvar="CYCLONE_DSN", metavar="DSN", default=None,
              help="PostgreSQL connection string [env CYCLONE_DSN]; default: --dsn-file, else libpq's "
                   "PGHOST/PGSERVICE variables, else the embedded server. A password here is visible "
                   "to other users (ps): prefer CYCLONE_DSN, --dsn-file, PGPASSWORD or ~/.pgpass.")
@click.option("--dsn-file", envvar="CYCLONE_DSN_FILE", metavar="PATH", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="Read the connection string from this file (its first line) [env CYCLONE_DSN_FILE].")
@click.option("--pgbouncer", is_flag=True, envvar="CYCLONE_PGBOUNCER", default=False,
              help="The DSN goes through PgBouncer in transaction mode: no session state, no LISTEN "
                   "there (give --listen-dsn, else polling) [env CYCLONE_PGBOUNCER].")
@click.option("--prepared-statements/--no-prepared-statements", default=None, envvar="CYCLONE_PREPARED_STATEMENTS",
              help="Named prepared statements [default: on, off with --pgbouncer; on there only for "
                   "PgBouncer >= 1.21 with max_prepared_statements > 0].")
@click.option("--listen-dsn", envvar="CYCLONE_LISTEN_DSN", metavar="DSN", default=None,
              help="A direct connection string (past PgBouncer) for LISTEN [env CYCLONE_LISTEN_DSN].")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="cyclone-mp", prog_name="cyclone-mp")
@click.pass_context
def cli(ctx: click.Context, dsn: str | None, dsn_file: str | None, pgbouncer: bool,
        prepared_statements: bool | None, listen_dsn: str | None, verbose: int) -> None:
    """cyclone-mp: a PostgreSQL-backed durable step engine whose worker is a
    multiprocess supervisor that can kill wedged handlers.

    Start with `cyclone-mp demo`, or run a worker for your app:
    `cyclone-mp worker examples.app:mux`.
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    if verbose < 2:
        logging.getLogger("psycopg").setLevel(logging.ERROR)  # pool chatter; our errors say it once
    connection: dict[str, Any] = {}
    if pgbouncer:
        connection["pgbouncer"] = True
    if prepared_statements is not None:
        connection["prepared_statements"] = prepared_statements
    if listen_dsn:
        connection["listen_dsn"] = listen_dsn
    ctx.obj = Settings(dsn=_choose_dsn(ctx, dsn, dsn_file), verbose=verbose, connection=connection)


LONG_LIVED = ("worker", "dashboard")  # commands whose process line others see for a long time
#: libpq variables that name a server: with one of them set and no DSN given, the CLI
#: connects with an empty DSN (libpq reads PGHOST, PGPORT, PGUSER, PGPASSWORD, ... itself).
LIBPQ_SERVER_ENV = ("PGHOST", "PGHOSTADDR", "PGSERVICE")
_COMMAND_LINE: list[str] | None = None  # the arguments main() runs with, when it is the program


def _choose_dsn(ctx: click.Context, dsn: str | None, dsn_file: str | None) -> str | None:
    """The DSN to use: ``--dsn`` / CYCLONE_DSN, else ``--dsn-file``, else ``""`` (libpq's
    own variables) when one of :data:`LIBPQ_SERVER_ENV` is set, else None (the embedded
    server). A password given on the command line gets one warning line, and a
    long-lived command is run again without it (:func:`_hide_dsn`)."""
    on_command_line = ctx.get_parameter_source("dsn") == ParameterSource.COMMANDLINE
    if dsn_file and ctx.get_parameter_source("dsn_file") == ParameterSource.COMMANDLINE and on_command_line and dsn:
        raise click.UsageError("give --dsn or --dsn-file, not both", ctx)
    if dsn_file and not (dsn and on_command_line):
        try:
            with open(dsn_file, encoding="utf-8") as fh:
                dsn = fh.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {dsn_file!r}: {getattr(exc, 'strerror', None) or exc}",
                                     ctx, param_hint="--dsn-file") from None
        if not dsn:
            raise click.BadParameter(f"{dsn_file!r} holds no connection string", ctx, param_hint="--dsn-file")
        return dsn
    if dsn and on_command_line and holds_password(dsn):
        click.echo("Warning: a password in --dsn is visible to other users (ps); give it in CYCLONE_DSN, "
                   "--dsn-file, PGPASSWORD or ~/.pgpass instead", err=True)
        if ctx.invoked_subcommand in LONG_LIVED:
            _hide_dsn(dsn)
    if dsn:
        return dsn
    if any(os.environ.get(name) for name in LIBPQ_SERVER_ENV):
        return ""
    return None


def _hide_dsn(dsn: str) -> None:
    """Run this command again in this process (``execve``: same pid) with the DSN moved
    from the command line to CYCLONE_DSN, so a worker's ``ps`` line never shows its
    password for the rest of its life (the environment of a process is readable by its
    user and root only). Nothing happens when this is not the ``cyclone-mp`` program
    itself (tests calling :func:`main` with arguments) or the command line is not ours."""
    args = _COMMAND_LINE
    if args is None or not args or sys.argv[1:] != args or list(sys.orig_argv[-len(args):]) != args:
        return
    kept: list[str] = []
    rest = iter(enumerate(args))
    for i, arg in rest:
        if arg == "--dsn":
            next(rest, None)  # its value
        elif arg.startswith("--dsn="):
            continue
        elif arg.startswith("-"):
            kept.append(arg)
        else:  # the command: everything from here on is its own
            kept.extend(args[i:])
            break
    env = {**os.environ, "CYCLONE_DSN": dsn}
    env.pop("CYCLONE_DSN_FILE", None)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv[:len(sys.orig_argv) - len(args)]) + kept, env)


# -- worker, migrate ---------------------------------------------------------------------------------


@cli.command()
@click.argument("app")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Child processes: handlers running at once.")
@click.option("--lease-ttl", type=SECONDS, default=30.0, show_default=True,
              help="Seconds a lease lasts without renewal (renewed every ttl/3).")
@click.option("--kill-grace", type=SECONDS, default=5.0, show_default=True,
              help="Seconds between a cooperative cancel and the SIGKILL.")
@click.option("--shutdown-grace", type=SECONDS, default=30.0, show_default=True,
              help="Seconds in-flight steps may run on after SIGTERM/SIGINT.")
@click.option("--max-reclaims", type=click.IntRange(0, INT_MAX), default=None,
              help="Client-wide default max_reclaims for runs this process enqueues; the bound that "
                   "applies is stored on each step at enqueue (cy.step(max_reclaims=...) or "
                   "`enqueue --max-reclaims`) [default: unbounded].")
@click.option("--queue", "queues", multiple=True, metavar="NAME",
              help="Queue to claim from (repeatable) [default: default].")
@click.option("--poll-interval", type=POLL, default="0.1,1.0", show_default=True,
              help="Seconds between claims when idle: S or MIN,MAX.")
@click.option("--max-steps-per-child", type=click.IntRange(min=1), default=None,
              help="Recycle a child after this many steps [default: never].")
@click.option("--max-child-rss", type=BYTES, default=None,
              help="Recycle a child whose RSS exceeds this size, e.g. 500M [default: never].")
@click.option("--prefetch", type=click.IntRange(min=0), default=PREFETCH_DEFAULT, show_default=True,
              help="Steps to claim beyond the idle children and hold until one frees up, at "
                   "most what they can start within about 0.25 s (short steps only) and, with n "
                   "supervisors live on the database, at most max(32, 2048/n); 0 claims only for "
                   "idle children.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics on this port (/metrics; needs cyclone-mp[metrics]) [default: none].")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, metavar="ADDRESS",
              help="The address the metrics bind; 0.0.0.0 serves every interface (anyone who reaches it "
                   "reads step names and counts: use a trusted network and a token).")
@click.option("--metrics-token", envvar="CYCLONE_METRICS_TOKEN", default=None, metavar="TOKEN",
              help="Require 'Authorization: Bearer TOKEN' on every scrape (from the environment "
                   "variable CYCLONE_METRICS_TOKEN, which ps does not show) [default: none].")
@click.option("--archive-after", type=DURATION_OR_NEVER, default="10m", show_default=True,
              help="Move a finished run, with its steps, from the hot tables to the archive this long "
                   "after it finished ('never': keep it in the hot tables). Archived runs are still "
                   "found by status and the dashboard, and listed by runs --archived.")
@click.option("--retain-completed", type=DURATION_OR_NEVER, default=None,
              help="Delete completed runs (hot or archived) this long after they finished, e.g. 7d "
                   "[default: never].")
@click.option("--retain-discarded", type=DURATION_OR_NEVER, default=None,
              help="Delete discarded runs this long after they finished, e.g. 30d [default: never].")
@click.option("--retain-cancelled", type=DURATION_OR_NEVER, default=None,
              help="Delete cancelled runs this long after they finished [default: never].")
@click.option("--start-method", type=click.Choice(START_METHODS), default=START_METHODS[0], show_default=True,
              help="How children start: forked from a zygote that imported the app once (milliseconds), "
                   "or a fresh interpreter each (spawn).")
def worker(app: str, workers: int, lease_ttl: float, kill_grace: float, shutdown_grace: float,
           max_reclaims: int | None, queues: tuple[str, ...], poll_interval: tuple[float, float],
           max_steps_per_child: int | None, max_child_rss: int | None, prefetch: int,
           metrics_port: int | None, metrics_host: str, metrics_token: str | None,
           archive_after: float | None, retain_completed: float | None,
           retain_discarded: float | None, retain_cancelled: float | None, start_method: str) -> None:
    """Run a supervisor for the steps of APP (module:attr or path/to/file.py:attr).

    Blocks until SIGTERM or SIGINT: the first one drains (claim nothing more, let
    in-flight steps finish for up to --shutdown-grace; the worker says which steps it
    waits for), a second one stops hard. Exits 0 after a drain.
    """
    mux = load_app_or_fail(app)
    client = make_client(mux, workers=workers, lease_ttl=lease_ttl, kill_grace=kill_grace,
                         shutdown_grace=shutdown_grace, max_reclaims=max_reclaims, queues=list(queues) or None,
                         poll_interval=poll_interval, max_steps_per_child=max_steps_per_child,
                         max_child_rss=max_child_rss, prefetch=prefetch, metrics_port=metrics_port,
                         metrics_host=metrics_host, metrics_token=metrics_token,
                         archive_after=archive_after, retain_completed=retain_completed,
                         retain_discarded=retain_discarded, retain_cancelled=retain_cancelled,
                         start_method=start_method)
    cfg = client.config
    client.migrate()  # fail before the banner when the database is unreachable
    click.echo(
        f"cyclone-mp worker: {cfg.workers} children, queues {', '.join(cfg.queues)}, "
        f"steps {', '.join(mux.step_names) or '(none)'}; database {describe_dsn(client.dsn)}; "
        + (f"metrics on {metrics_host}:{metrics_port}/metrics{' (token)' if metrics_token else ''}; "
           if metrics_port is not None else "")
        + "SIGTERM/Ctrl-C drains, a second one stops", err=True,
    )
    def after_drain(signum: int, frame: Any) -> None:
        # Installed before client.run, which puts its own handler in place while the
        # supervisor runs and gives this one back when it has stopped.
        if client.supervisor is None or not client.supervisor.stopped.is_set():
            raise KeyboardInterrupt  # before the supervisor started: exit 130
        # Stopped already: the worker is exiting, a further signal changes nothing (exit 0).

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, after_drain)
    reporter = DrainReporter(client, lambda line: click.echo(line, err=True))  # says what a drain waits for
    reporter.start()
    threading.Thread(target=_say_limits, args=(client,), name="cyclone-mp-limits-banner", daemon=True).start()
    try:
        client.run(on_signal=reporter.signalled)
    finally:
        # Exiting now; Python gives a handler function back to SIG_DFL while it shuts
        # down (a late SIGTERM then killed the worker: rc -15), but not SIG_IGN.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reporter.close()
        client.close()
    sup = client.supervisor
    if sup is not None:
        stats = sup.stats
        click.echo(f"cyclone-mp worker: stopped; {stats['completed']} completed, {stats['failed']} failed, "
                   f"{stats['released'] + stats['prefetch_released']} released, "
                   f"{render.count(stats['killed'], 'child', 'children')} killed", err=True)


def _say_limits(client: Any) -> None:
    """Once the supervisor runs: how it enforces resource limits here."""
    deadline = time.monotonic() + 60
    while client.supervisor is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sup = client.supervisor
    if sup is None or not sup.running.wait(60) or sup.confinement is None:
        return
    level, line = sup.confinement.mechanism.start_line()
    if not logging.getLogger("cyclone_mp.supervisor").isEnabledFor(level):  # else the log said it already
        click.echo(f"cyclone-mp worker: {line}", err=True)


@cli.command()
def migrate() -> None:
    """Create or upgrade the cyclone tables (idempotent; other commands do it too)."""
    client = make_client()
    try:
        applied = client.migrate()
    finally:
        client.close()
    click.echo(f"applied {', '.join(applied)}" if applied else "schema up to date")


# -- the commands of runs.py, submit.py and local.py ----------------------------------------------------


for _command in (*runs.COMMANDS, *submit.COMMANDS, *local.COMMANDS):  # each module's commands
    cli.add_command(_command)


# -- entry point ------------------------------------------------------------------------------------------


def _fail(message: str, code: int) -> NoReturn:
    line = " ".join(redact(message).split())
    click.echo(f"Error: {line}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console script ``cyclone-mp``: run the CLI and exit with its code (0, 1 or 2)."""
    global _COMMAND_LINE
    _COMMAND_LINE = sys.argv[1:] if argv is None else None  # the program itself: its line may be re-run
    try:
        code = cli.main(args=argv, prog_name="cyclone-mp", standalone_mode=False)
    except LibraryUsageError as exc:
        _fail(exc.format_message(), 2)
    except click.BadParameter as exc:
        if isinstance(exc, click.MissingParameter) and exc.ctx is not None:
            _fail(f"{exc.format_message()} (see '{exc.ctx.command_path} --help')", 2)
        _fail(exc.format_message(), 2)
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _fail(exc.format_message() + hint, exc.exit_code)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (click.Abort, KeyboardInterrupt):  # Ctrl-C: not an error, but not a success either
        click.echo("cyclone-mp: interrupted", err=True)
        sys.exit(130)
    except CycloneError as exc:  # raised outside a command (should not happen)
        _fail(str(exc).split("\n")[0], 1)
    except Exception as exc:  # noqa: BLE001 - never a traceback for the user, unless -v
        if any(a in ("-v", "-vv", "--verbose") for a in (argv if argv is not None else sys.argv[1:])):
            traceback.print_exc()
        _fail(f"unexpected {type(exc).__name__}: {exc} (run with -v for the traceback)", 1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
