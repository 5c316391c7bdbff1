"""Planning the clients' calls (SPEC section 2): what :class:`~cyclone_mp.Client` and
:class:`~cyclone_mp.AsyncClient` share, with no I/O. Each call's arguments are checked
and turned into an :class:`~cyclone_mp.store.operations.Op` (or a maker of one) that the client
runs on its own connections; :func:`node_rows` composes the step rows of one run, for
the clients, schedules and ``Mux.check_enqueue``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable, Iterable, Sequence

from .backoff import storable_backoff
from .config import Config
from .connections import stale_plan, undefined_table
from .durations import Duration, seconds
from .embedded import ensure_default_dsn, server_for_dsn
from .errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseReadOnly,
    DatabaseUnavailable,
    UnknownStep,
)
from .filters import RunFilter
from .flow import check_enqueue_key
from .mux import Mux
from .noderows import NodeRow, node_rows, task_row
from .protocol import check_text, check_value
from .status import STEP_STATES, TERMINAL_RUN_STATES, RunStatus, StepStatus
from .steps import Step, StepOptions, check_name
from .store import operations
from .store.operations import Op
from .workflow import Workflow


class ClientBase:
    """What :class:`Client` and :class:`~cyclone_mp.AsyncClient` share: the options, the
    mux, and the planning of every call (checks, then a
    :class:`~cyclone_mp.store.operations.Op`). No I/O: each client runs the planned operations
    on its own connections, one sync and one async."""

    config: Config
    mux: Mux
    _dsn: str | None

    @property
    def dsn(self) -> str:
        """The DSN in use (the embedded default's, started on first use, when None was given)."""
        if self._dsn is None:
            self._dsn = ensure_default_dsn()
        return self._dsn

    def _embedded(self) -> Any:
        """The embedded server the DSN names (:class:`~cyclone_mp.embedded.EmbeddedServer`), or None."""
        return server_for_dsn(self.dsn)

    def _explain(self, exc: DatabaseUnavailable) -> DatabaseUnavailable:
        """``exc``, or when the DSN is an embedded server that is going away, the one line
        that says so (a connection refused or closed by a stopping server is why)."""
        server = self._embedded()
        if server is not None and server.stopping():
            return DatabaseUnavailable(server.not_running_message())
        return exc

    def _call_failed(self, exc: DatabaseError) -> DatabaseError:
        """The error a failed call raises: a missing schema and an embedded server going
        away say so in one line; anything else as it is."""
        if undefined_table(exc):
            return DatabaseError("the cyclone tables do not exist: run client.migrate() or `cyclone-mp migrate`")
        if isinstance(exc, DatabaseUnavailable):  # lost mid-call, or refused: say why when we can
            return self._explain(exc)
        return exc

    @staticmethod
    def _retryable(exc: DatabaseError, store: Any, tries_left: int) -> bool:
        """Once more, on another connection, when the call surely did nothing: a schema
        change invalidated a prepared statement (it did not run, and the connection
        dropped its prepared statements), the connection was lost inside the call's
        only transaction, before its COMMIT (the server ends a session left idle in a
        transaction: a frozen process), or the server refused a write because it is
        read-only (a failover: the pool was emptied, the next connection goes to the
        new primary)."""
        lost_uncommitted = (isinstance(exc, DatabaseUnavailable) and store is not None
                            and store.failed_before_commit and store.commits == 0)
        return bool(tries_left) and (stale_plan(exc.__cause__) or lost_uncommitted
                                     or isinstance(exc, DatabaseReadOnly))

    # -- planning (pure) -------------------------------------------------------------------------

    def _resolve(self, target: Step | Workflow | str) -> Step | Workflow:
        if isinstance(target, (Step, Workflow)):
            return target
        if isinstance(target, str):
            return self.mux.lookup(target)
        raise UnknownStep(f"enqueue takes a cy.step, a cy.Workflow or a registered name, not {type(target).__name__}")

    def _check_payload(self, value: Any, what: str) -> str:
        """``value`` as JSON text, checked at the payload boundary
        (:func:`cyclone_mp.protocol.check_value`: JSON, storable by PostgreSQL, at most
        ``MAX_DEPTH`` levels deep, within max_payload).

        Raises:
            PayloadError: it is not.
        """
        return check_value(value, what, self.config.max_payload)

    def _node_options(self, step: Step, overrides: StepOptions) -> StepOptions:
        return overrides.over(step.options).over(self.config.defaults)

    @staticmethod
    def _enqueue_options(**raw: Any) -> StepOptions:
        """Per-enqueue options; a backoff given here must be storable (seconds or a list),
        a concurrency key a string."""
        check_enqueue_key(raw.get("concurrency_key"))
        if callable(raw.get("backoff")):
            raise ConfigurationError(
                "a per-enqueue backoff must be seconds or a list of seconds (it is stored on the row); "
                "pass a backoff(attempt) callable to cy.step(...) instead"
            )
        return StepOptions.build(**raw)

    def _plan_enqueue(
        self, target: Step | Workflow | str, input: Any, *, timeout: Duration | None, max_attempts: int | None,
        max_reclaims: int | None, queue: str | None, priority: int | None, backoff: float | Sequence[float] | None,
        delay: Duration | None, scheduled_at: dt.datetime | None, idempotency_key: str | None,
        concurrency: int | None = None, concurrency_key: str | None = None,
        rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None, cpu_limit: Duration | None = None,
        max_processes: int | None = None, max_open_files: int | None = None,
    ) -> tuple[str, Callable[[Any], Op]]:
        """Check an enqueue's arguments; returns the name enqueued and a maker of its
        operation, ``make(trace)`` (a retried call needs a fresh one; ``trace``: the
        enqueue's trace context or None). Raises what :meth:`Client.enqueue` documents,
        before any I/O."""
        definition = self._resolve(target)
        text = self._check_payload(input, "input")
        options = dict(timeout=timeout, max_attempts=max_attempts, max_reclaims=max_reclaims, queue=queue,
                       priority=priority, backoff=backoff, concurrency=concurrency, concurrency_key=concurrency_key,
                       rate_limit=rate_limit, memory_limit=memory_limit, cpu_limit=cpu_limit,
                       max_processes=max_processes, max_open_files=max_open_files)
        plain = isinstance(definition, Step) and all(v is None for v in options.values())  # the common case
        overrides = None if plain else self._enqueue_options(**options)
        delay_s = 0.0 if delay is None else seconds(delay, "delay", allow_zero=True) or 0.0
        check_scheduled_at(scheduled_at)
        check_idempotency_key(idempotency_key)
        if plain:  # nothing to compose: the step's row, kept
            kind, nodes = "step", [self._step_row(definition, input)]
        else:
            kind, nodes = node_rows(definition, input, self.config.defaults, overrides)
        place = unique_place(definition, text, nodes[0]) if kind == "step" else None
        return definition.name, lambda trace: operations.enqueue_run(
            name=definition.name, kind=kind, input=input, nodes=nodes, delay=delay_s,
            scheduled_at=scheduled_at, idempotency_key=idempotency_key, trace=trace, input_json=text,
            unique=place,
        )

    def _step_row(self, step: Step, input: Any) -> NodeRow:
        """The row of a single-step run of ``step`` with no per-enqueue option: the step's
        options over the client's, composed once per step and kept (so a single enqueue
        composes nothing), with ``input``'s concurrency key when the step's key
        is a callable of the input.

        Raises:
            ConfigurationError: the key callable failed.
        """
        cache: dict[Step, tuple[StepOptions, StepOptions, NodeRow | None]] = \
            self.__dict__.setdefault("_step_rows", {})
        kept = cache.get(step)
        if kept is None or kept[0] is not step.options:  # composed afresh when its options changed
            opts = step.options.over(self.config.defaults)
            row = None if callable(opts.concurrency_key) else task_row(step.name, step, opts, None, (), "available")
            kept = cache[step] = (step.options, opts, row)
        _, opts, row = kept
        return row if row is not None else task_row(step.name, step, opts, input, (), "available")

    def _plan_enqueue_many(
        self, target: Step | str, inputs: Iterable[Any], *, timeout: Duration | None, max_attempts: int | None,
        max_reclaims: int | None, queue: str | None, priority: int | None, backoff: float | Sequence[float] | None,
        delay: Duration | None, scheduled_at: dt.datetime | None, concurrency: int | None = None,
        concurrency_key: str | None = None, rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None, cpu_limit: Duration | None = None,
        max_processes: int | None = None, max_open_files: int | None = None,
    ) -> tuple[str, Callable[[Any], Op] | None]:
        """Check an enqueue_many's arguments; returns the step's name and a maker of its
        operation, ``make(trace)``, or None when there are no inputs. Raises what
        :meth:`Client.enqueue_many` documents."""
        definition = self._resolve(target)
        if not isinstance(definition, Step):
            raise ConfigurationError("enqueue_many takes a step, not a workflow")
        originals = list(inputs)
        items = [self._check_payload(item, f"input #{i}") for i, item in enumerate(originals)]  # JSON texts
        if not items:
            return definition.name, None
        opts = self._node_options(definition, self._enqueue_options(
            timeout=timeout, max_attempts=max_attempts, max_reclaims=max_reclaims, queue=queue, priority=priority,
            backoff=backoff, concurrency=concurrency, concurrency_key=concurrency_key, rate_limit=rate_limit,
            memory_limit=memory_limit, cpu_limit=cpu_limit, max_processes=max_processes,
            max_open_files=max_open_files,
        ))
        keys = [opts.key_for(item) for item in originals] if opts.concurrency_key is not None else None
        delay_s = seconds(delay, "delay", allow_zero=True) or 0.0
        check_scheduled_at(scheduled_at)
        if definition.options.unique is not None:  # each input's place is looked at: one run at a time
            nodes = [task_row(definition.name, definition, opts, item, (), "available") for item in originals]
            places = [unique_place(definition, text, node) for text, node in zip(items, nodes)]
            return definition.name, lambda trace: operations.enqueue_unique_many(
                name=definition.name, inputs_json=items, nodes=nodes, delay=delay_s, scheduled_at=scheduled_at,
                trace=trace, places=places)
        return definition.name, lambda trace: operations.enqueue_many(
            name=definition.name, inputs_json=items, queue=opts.queue or "default", priority=opts.priority or 0,
            max_attempts=opts.max_attempts or 25, max_reclaims=opts.max_reclaims, timeout=opts.timeout,
            delay=delay_s, scheduled_at=scheduled_at, backoff=storable_backoff(opts.backoff), trace=trace,
            keys=keys, concurrency=opts.concurrency, rate_limit=opts.rate_limit, limits=opts.limits,
        )

    def _plan_signal(self, run_id: str, name: str, payload: Any) -> Callable[[], Op]:
        check_name(name, "signal name")
        self._check_payload(payload, "payload")
        return lambda: operations.signal(run_id, name, payload)

    @staticmethod
    def _plan_map_items(run_id: str, node: str, state: str | Iterable[str] | None, after: int,
                        limit: int) -> Callable[[], Op]:
        """Check a ``map_items`` call's arguments; a maker of its operation."""
        check_name(node, "node")
        states = [state] if isinstance(state, str) else (list(state) if state is not None else None)
        for value in states or ():
            if value not in STEP_STATES:
                raise ConfigurationError(f"unknown step state {value!r} (one of {', '.join(STEP_STATES)})")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise ConfigurationError(f"limit must be an int from 1 to 10000, got {limit!r}")
        if not isinstance(after, int) or isinstance(after, bool) or after < -1:
            raise ConfigurationError(f"after must be an item index (or -1), got {after!r}")
        return lambda: operations.map_items(run_id, node, states=states, after=after, limit=limit)

    @staticmethod
    def _plan_runs(state: str | Iterable[str] | None, limit: int, archived: bool, filters: dict[str, Any]
                   ) -> Callable[[], Op]:
        found = RunFilter.of(state=state, **filters)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigurationError(f"limit must be a positive int, got {limit!r}")
        return lambda: operations.list_runs(filters=found, limit=limit, archived=bool(archived))

    @staticmethod
    def _plan_prune(older_than: Duration, state: str | Iterable[str] | None, filters: dict[str, Any]
                    ) -> Callable[[], Op]:
        age = seconds(older_than, "older_than", allow_none=False, allow_zero=True)
        found = RunFilter.of(state=state, allowed=TERMINAL_RUN_STATES, **filters)
        return lambda: operations.prune(older_than=age or 0.0, filters=found)

    @staticmethod
    def _wait_timeout(timeout: Duration | None) -> float | None:
        return seconds(timeout, "timeout", allow_zero=True)

    @staticmethod
    def _unserved(status: RunStatus, workers: list[dict[str, Any]]) -> list[StepStatus]:
        live = [row.get("info") or {} for row in workers]
        serving = [info for info in live if not info.get("draining")]

        def served(step: StepStatus) -> bool:
            return any(step.queue in (info.get("queues") or []) and
                       (info.get("names") is None or step.step_name in info["names"]) for info in serving)

        return [step for step in status.steps.values()
                if step.kind in ("task", "map") and not step.terminal and step.state != "running"
                and not served(step)]


#: Longest idempotency key, in UTF-8 bytes: the key is indexed (UNIQUE), and a btree
#: entry cannot exceed about 2,700 bytes (a 10 kB key failed with "index row requires
#: 10016 bytes").
MAX_IDEMPOTENCY_KEY_BYTES = 1024


def unique_place(definition: Step | Workflow, input_json: str, node: NodeRow) -> "operations.UniquePlace | None":
    """The place a single-step run of ``definition`` holds while it lives (``cy.Unique``
    on the step), or None."""
    unique = definition.options.unique if isinstance(definition, Step) else None
    if unique is None:
        return None
    return operations.UniquePlace(unique.key(definition.name, input_json, node.queue, node.concurrency_key),
                                  unique.period, unique.states_mask)


def check_idempotency_key(key: object) -> None:
    """Raise ConfigurationError unless ``key`` is None or a usable idempotency key:
    a non-empty string of at most :data:`MAX_IDEMPOTENCY_KEY_BYTES` UTF-8 bytes that
    PostgreSQL can store (:class:`~cyclone_mp.errors.UnstorableText` otherwise)."""
    if key is None:
        return
    if not isinstance(key, str) or not key:
        raise ConfigurationError("idempotency_key must be a non-empty string")
    size = len(check_text(key, "idempotency_key").encode("utf-8"))
    if size > MAX_IDEMPOTENCY_KEY_BYTES:
        raise ConfigurationError(
            f"idempotency_key must be at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes (UTF-8), got {size}")


def check_scheduled_at(value: object) -> None:
    """Raise ConfigurationError unless ``value`` is None or a timezone-aware datetime."""
    if value is None:
        return
    if not isinstance(value, dt.datetime):
        raise ConfigurationError(f"scheduled_at must be a timezone-aware datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ConfigurationError("scheduled_at must be a timezone-aware datetime")
