"""What the ``cyclone-mp`` commands share (:mod:`main`, :mod:`runs`, :mod:`submit` and
:mod:`local`): the global options, the client and console made from them, the user's
app loaded from its ``APP`` argument, and the database named without its password."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from cyclone_mp.apps import load_app
from cyclone_mp.client import Client
from cyclone_mp.connections import redact
from cyclone_mp.errors import ConfigurationError

from . import render


@dataclasses.dataclass
class Settings:
    """Global options: ``dsn`` (None: the embedded default server), ``verbose`` (count)."""

    dsn: str | None
    verbose: int
    connection: dict[str, Any] = dataclasses.field(default_factory=dict)  # pgbouncer, prepared_statements, listen_dsn


def current_settings() -> Settings:
    """The global options of the running command (defaults outside one)."""
    return click.get_current_context().find_object(Settings) or Settings(dsn=None, verbose=0)


def make_client(mux: Any = None, **options: Any) -> Any:
    """A Client on the global ``--dsn`` (None: the embedded default server)."""
    settings = current_settings()
    return Client(settings.dsn, mux, **settings.connection, **options)


def out() -> Any:
    """The console the commands print to (:func:`render.console`)."""
    return render.console()


def load_app_or_fail(app: str) -> Any:
    """Import APP (``module:attribute``, :func:`cyclone_mp.apps.load_app`); a failure is
    bad usage (exit 2) naming the APP."""
    try:
        return load_app(app)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc).replace("cannot load APP ", "", 1), param_hint="APP") from exc


def describe_dsn(dsn: str) -> str:
    """What the worker and dashboard banners say about the database (never a password)."""
    return redact(dsn) if dsn else "from libpq's environment (PGHOST, PGSERVICE, ...)"
