"""What the ``cyclone-mp`` commands share (:mod:`main` and :mod:`runs`): the global
options and the client and console made from them."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

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
    from cyclone_mp.client import Client

    settings = current_settings()
    return Client(settings.dsn, mux, **settings.connection, **options)


def out() -> Any:
    """The console the commands print to (:func:`render.console`)."""
    return render.console()
