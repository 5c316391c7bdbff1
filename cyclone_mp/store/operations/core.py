"""The client's database operations, written once for the sync and the async driver.

Each operation is a generator (a "sans-IO" procedure): it yields a :class:`Statement`
(a named query of ``cyclone_mp/sql`` and its parameters), receives its :class:`Result`
(rows and rowcount) and finally returns a value. It decides everything else itself:
which statement comes next, what a row means, which error to raise. It never touches a
connection: :class:`cyclone_mp.store.Store` drives it on a psycopg connection,
:class:`cyclone_mp.store.AsyncStore` on an async one, so ``Client`` and ``AsyncClient``
run the same SQL with the same parameters and the same row handling.

An :class:`Op` says whether its statements form one transaction. Operations compose with
``yield from``. This module holds the machinery and the schema's migration; the
operations themselves are in :mod:`.enqueue`, :mod:`.runs` and :mod:`.archive`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Generator, TypeVar

from ...errors import UnsupportedServer
from ..queries import MIGRATION_LOCK, Q, _migrations

T = TypeVar("T")

#: The oldest PostgreSQL the statements run on (``server_version_num``): 14.0. Older
#: servers are refused by :func:`migrate`, which every supervisor runs before it starts.
MIN_SERVER_VERSION = 140000


@dataclasses.dataclass(frozen=True)
class Statement:
    """One statement to run: its SQL text and parameters (named, or a sequence).
    ``prepare``: psycopg's ``prepare`` argument (None: its default)."""

    sql: str
    params: Any = None
    prepare: bool | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """What a statement gave back: its rows (dicts; empty without a result set) and rowcount."""

    rows: list[dict[str, Any]]
    rowcount: int

    def one(self) -> dict[str, Any] | None:
        """The first row, or None."""
        return self.rows[0] if self.rows else None


Steps = Generator[Statement, Result, T]


class Op:
    """A planned operation: its steps (a generator) and whether they form one transaction.
    Iterating an ``Op`` gives its steps, so ``yield from op`` composes operations."""

    def __init__(self, steps: Steps[Any], *, transaction: bool, name: str = "") -> None:
        self.steps = steps
        self.transaction = transaction
        self.name = name

    def __iter__(self) -> Steps[Any]:
        return self.steps

    def __repr__(self) -> str:
        return f"Op({self.name}, transaction={self.transaction})"


def operation(*, transaction: bool) -> Callable[[Callable[..., Steps[T]]], Callable[..., Op]]:
    """Decorator: a generator function becomes a function returning an :class:`Op`."""

    def decorate(fn: Callable[..., Steps[T]]) -> Callable[..., Op]:
        @functools.wraps(fn)
        def make(*args: Any, **kwargs: Any) -> Op:
            return Op(fn(*args, **kwargs), transaction=transaction, name=fn.__name__)

        return make

    return decorate


def q(name: str, params: Any = None, *, prepare: bool | None = None) -> Statement:
    """The named query ``name`` of the ``sql/*.sql`` files with ``params``."""
    return Statement(Q[name], params, prepare)


# -- schema ------------------------------------------------------------------------------------


@operation(transaction=True)
def migrate() -> Steps[list[str]]:
    """Apply pending numbered migrations under an advisory lock; returns their file names.

    Raises:
        UnsupportedServer: the server is older than :data:`MIN_SERVER_VERSION` (checked
            first, so nothing is applied and the error is one line).
    """
    version = (yield Statement("SELECT current_setting('server_version_num')::int AS num, "
                               "current_setting('server_version') AS name")).one()
    if version["num"] < MIN_SERVER_VERSION:
        raise UnsupportedServer(
            f"PostgreSQL {version['name']} (server_version_num {version['num']}) is not supported: "
            f"cyclone_mp needs PostgreSQL {MIN_SERVER_VERSION // 10000} or later "
            f"(tested on 14 to 18; docs/operating.md)")
    yield Statement("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
    yield Statement(
        "CREATE TABLE IF NOT EXISTS cyclone_migrations ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    done = {row["version"] for row in (yield Statement("SELECT version FROM cyclone_migrations")).rows}
    applied: list[str] = []
    for version, name, text in _migrations():
        if version in done:
            continue
        yield Statement(text)
        yield Statement("INSERT INTO cyclone_migrations (version, name) VALUES (%s, %s)", (version, name))
        applied.append(name)
    return applied
