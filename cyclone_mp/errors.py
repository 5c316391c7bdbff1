"""Exceptions raised by cyclone_mp, and the two control-flow exceptions handlers use.

The root is :class:`CycloneError`; each subclass's docstring is its default message
(STYLE.md pattern 3). :class:`Cancelled` derives from ``BaseException`` so a handler's
``except Exception`` cannot swallow a cancellation (as rq does with its timeout).
"""

from __future__ import annotations

from typing import Any


class CycloneError(Exception):
    """A cyclone_mp operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(CycloneError, ValueError):
    """An option or a registration is invalid."""


class SupervisorInChild(ConfigurationError):
    """A supervisor cannot start inside a handler's child process (a Client started at module level)."""


class UnknownStep(CycloneError, LookupError):
    """No step or workflow of that name is registered in the mux."""


class RunNotFound(CycloneError, LookupError):
    """No run with that id exists."""


class InvalidTransition(CycloneError):
    """The run is not in a state that allows this operation."""


class WaitTimeout(CycloneError, TimeoutError):
    """The run did not end within the time ``client.wait`` or ``client.result`` was given."""


class RunFailed(CycloneError):
    """The run was discarded: a step failed for good (``client.result``).

    Attributes:
        status: the run's final :class:`~cyclone_mp.RunStatus` (each step's ``error``,
            ``error_kind`` and ``errors``).
    """

    def __init__(self, message: str | None = None, status: object = None) -> None:
        super().__init__(message)
        self.status = status


class RunCancelled(CycloneError):
    """The run was cancelled (``client.result``).

    Attributes:
        status: the run's final :class:`~cyclone_mp.RunStatus`.
    """

    def __init__(self, message: str | None = None, status: object = None) -> None:
        super().__init__(message)
        self.status = status


class DatabaseError(CycloneError):
    """The database could not be reached or rejected a query."""


class DatabaseUnavailable(DatabaseError):
    """The database cannot be reached (connection refused, lost or closed)."""


class DatabaseReadOnly(DatabaseUnavailable):
    """The server is a standby or read-only (a failover is under way, or the connection
    reached the wrong host): the connection is dropped and opened again, on the new
    primary when the DSN lists every host with ``target_session_attrs=read-write``.
    Nothing of the call was written."""


class DatabaseDiskFull(DatabaseUnavailable):
    """The database server's disk is full (SQLSTATE 53100, ``disk_full``): it cannot write
    until space is freed. An outage, not a rejection of this call's data: a supervisor
    keeps what it has to write and tries again after a backoff, as after a lost
    connection; the same call may work once an operator frees space."""


class DatabaseStalled(DatabaseUnavailable):
    """The database did not answer within the caller's bound while its connection stayed
    open (a wedged PgBouncer or proxy, a frozen server backend): TCP keepalives and
    ``tcp_user_timeout`` cannot see a peer that acknowledges and never answers. The
    connection was closed; a fresh one may work at once."""


class UnsupportedServer(DatabaseError, ConfigurationError):
    """The PostgreSQL server is older than the oldest version cyclone_mp supports (14)."""


class DatabaseBusy(DatabaseError):
    """The call ran out of time on the server (a lock wait past ``lock_timeout``, a
    statement past ``statement_timeout``): nothing was done; try again later. Neither an
    outage nor a rejection of the data.

    Attributes:
        lock_wait: True when it waited for a lock past ``lock_timeout`` (SQLSTATE 55P03;
            a lock held a moment elsewhere, as a vacuum truncating a table holds one),
            False when the statement itself ran past ``statement_timeout``.
    """

    def __init__(self, message: str | None = None, lock_wait: bool = False) -> None:
        super().__init__(message)
        self.lock_wait = lock_wait


class QueryRejected(DatabaseError):
    """The database rejected this one call's data: a size limit, a data exception or a
    constraint (SQLSTATE classes 54, 22, 23). The connection is fine; retrying the same
    call fails the same way.

    Attributes:
        sqlstate: the five-character SQLSTATE, or None.
    """

    def __init__(self, message: str | None = None, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class PayloadError(CycloneError, ValueError):
    """An input, output, signal payload or progress value is not a JSON value that
    PostgreSQL can store, or is over a limit (``max_payload`` bytes, or
    :data:`cyclone_mp.protocol.MAX_DEPTH` levels of nesting)."""


class UnstorableText(ConfigurationError, PayloadError):
    """A string PostgreSQL cannot store: it contains a NUL character or a lone surrogate
    (text that is not valid Unicode). Refused before any I/O with one message wherever
    the string is: a step, workflow, node, queue, signal or schedule name, a concurrency
    or idempotency key, a JSON value or one of its keys. It is both a
    :class:`ConfigurationError` (an option) and a :class:`PayloadError` (a value), so
    the ``except`` a caller already has for either catches it."""


class Permanent(Exception):
    """Raise from a handler to discard the step at once: no more attempts.

    ``raise cy.Permanent("bad input")`` or ``raise cy.Permanent(exc)`` (the wrapped
    exception's type and message are stored). SPEC section 2, seed table row
    "Handler returns Permanent(err)": the attempt is consumed, the step is discarded.
    """

    def __init__(self, error: BaseException | str | None = None) -> None:
        self.error = error
        super().__init__(str(error) if error is not None else "permanent failure")


class Snooze(Exception):
    """Raise from a handler to run the step again ``seconds`` later, without spending an
    attempt: ``raise cy.Snooze(30)`` (seconds, or a ``timedelta``). The step goes back to
    ``available`` at now + seconds on the database clock, ``attempt`` unchanged, and its
    ``snoozes`` count grows; past the step's ``max_snoozes`` (default 100) it is discarded
    with ``error_kind="snooze_limit"``. A snooze after the attempt's deadline is its
    timeout, as any late end is.

    Raises:
        ValueError: ``seconds`` is negative, not a number, or over a year.
    """

    def __init__(self, seconds: float | Any = 0.0) -> None:
        import datetime as dt  # lazy: errors is on the child's start-up path, kept light
        import math  # lazy: as datetime

        value = seconds.total_seconds() if isinstance(seconds, dt.timedelta) else seconds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 <= value <= 366 * 86400:
            raise ValueError(f"cy.Snooze takes seconds from 0 to a year, not {seconds!r}")
        self.seconds = float(value)
        super().__init__(f"snoozed for {self.seconds:g}s")


class Cancelled(BaseException):
    """Raised by ``ctx.check_cancellation()`` once the attempt is cancelled.

    ``reason`` is one of ``"timeout"``, ``"cancelled"``, ``"lease_lost"`` or
    ``"shutdown"`` (SPEC section 2). Derives from ``BaseException`` so that
    ``except Exception`` in user code does not swallow it.
    """

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason
        super().__init__(f"attempt cancelled ({reason})" if reason else "attempt cancelled")
