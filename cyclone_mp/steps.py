"""Step definitions and the mux that names them (SPEC section 2).

``@cy.step(name, timeout=..., max_attempts=...)`` wraps a handler ``fn(ctx, input)`` in a
:class:`Step`; a :class:`Mux` maps names to steps (and workflows). A step keeps the
module path of its handler so a child process can import it by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import inspect
import sys
from typing import Any, Callable

from .backoff import Backoff, check_backoff
from .durations import Duration, seconds
from .errors import ConfigurationError
from .flow import ConcurrencyKey, check_key, check_rate_limit, key_of
from .limits.declared import Limits, check_count, parse_size
from .protocol import check_text

DEFAULT_QUEUE = "default"


DEFAULT_MAX_ATTEMPTS = 25
DEFAULT_MAX_SNOOZES = 100  #: times a step may raise cy.Snooze before it is discarded (snooze_limit)
#: Longest step, workflow, node, queue or signal name, in characters. A queue name is
#: sent as the payload of a NOTIFY (PostgreSQL's limit: 8,000 bytes); every name is
#: stored in a text column and shown in tables.
MAX_NAME_LENGTH = 200
INT_MIN, INT_MAX = -(2**31), 2**31 - 1  # the integer columns: priority, max_attempts, max_reclaims


def check_name(value: object, what: str) -> str:
    """``value`` if it is a usable name: a non-empty string of at most
    :data:`MAX_NAME_LENGTH` characters that PostgreSQL can store, without control
    characters.

    Raises:
        ConfigurationError: naming ``what`` and the rule (:class:`~cyclone_mp.errors.UnstorableText`
            for a NUL or a lone surrogate).
    """
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string, got {_shown(value)}")
    if len(value) > MAX_NAME_LENGTH:
        raise ConfigurationError(f"{what} must be at most {MAX_NAME_LENGTH} characters, got {len(value)}")
    check_text(value, what)
    if not value.isprintable():
        raise ConfigurationError(f"{what} must not contain control characters (such as NUL), got {value!r}")
    return value


def check_int(value: object, what: str, low: int, high: int = INT_MAX) -> int | None:
    """``value`` if it is None or an int (not a bool) from ``low`` to ``high``.

    Raises:
        ConfigurationError: naming ``what`` and the range.
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigurationError(f"{what} must be an int from {low} to {high}, got {_shown(value)}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({type(value).__name__})"


#: The run states a run counts in for its uniqueness, as bits (a partial unique index holds
#: the rows whose state's bit is set: cyclone_unique_in, migration 0026).
UNIQUE_STATE_BITS = {"running": 1, "paused": 2, "completed": 4, "discarded": 8, "cancelled": 16}


@dataclasses.dataclass(frozen=True)
class Unique:
    """One run at a time per "same" enqueue (River's unique jobs): the step option
    ``unique=cy.Unique(...)``.

    Two single-step runs of the step are the same when the parts named by ``by`` are
    equal: ``"input"`` (the input's JSON, keys sorted), ``"queue"``, ``"key"`` (the
    concurrency key). With ``period`` (seconds), also in the same window of that length on
    the database clock (``period=3600``: once an hour). While a run in one of ``states``
    holds that place (default: running, paused, completed), an enqueue of the same returns
    its id (``created`` False, as an ``idempotency_key`` does). A unique index of the
    database enforces it, across every client and supervisor. Finished runs moved to the
    archive (``archive_after``, 10 minutes by default) no longer hold their place.

    Raises:
        ConfigurationError: an unknown part or state, or a bad period.
    """

    by: tuple[str, ...] = ("input",)
    period: float | None = None
    states: tuple[str, ...] = ("running", "paused", "completed")

    def __post_init__(self) -> None:
        by = (self.by,) if isinstance(self.by, str) else tuple(self.by)
        states = (self.states,) if isinstance(self.states, str) else tuple(self.states)
        unknown = set(by) - {"input", "queue", "key"}
        if unknown or not by and self.period is None:
            raise ConfigurationError(f"cy.Unique(by=...) takes 'input', 'queue' and 'key' (or none with a period), "
                                     f"not {sorted(unknown) or by!r}")
        bad = set(states) - set(UNIQUE_STATE_BITS)
        if bad or not states:
            raise ConfigurationError(f"cy.Unique(states=...) takes run states among {sorted(UNIQUE_STATE_BITS)}, "
                                     f"not {sorted(bad) or states!r}")
        object.__setattr__(self, "by", by)
        object.__setattr__(self, "states", states)
        object.__setattr__(self, "period", seconds(self.period, "Unique(period=...)"))

    @property
    def states_mask(self) -> int:
        return sum(UNIQUE_STATE_BITS[s] for s in set(self.states))

    def key(self, step_name: str, input_json: str, queue: str, concurrency_key: str) -> str:
        """The run's unique key (without the period's window, which the database adds)."""
        parts: list[Any] = [step_name]
        if "input" in self.by:
            parts.append(json.dumps(json.loads(input_json), sort_keys=True, separators=(",", ":")))
        if "queue" in self.by:
            parts.append(queue)
        if "key" in self.by:
            parts.append(concurrency_key)
        return "u:" + hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


#: Step options given only where the step is declared (:func:`step`), never per enqueue:
#: ``max_snoozes`` and ``async_concurrency`` are read by the supervisor that registers the
#: step, and ``unique`` says what "the same run" is, one rule for every enqueue of it.
#: Every other option is also an enqueue option (``Client.enqueue``, ``enqueue_many``, their
#: async twins and ``cyclone-mp enqueue``; a test holds them to this).
STEP_ONLY_OPTIONS = frozenset({"max_snoozes", "async_concurrency", "unique"})


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Per-step options; ``None`` means "use the next level's value".

    Precedence (SPEC 2): enqueue value > step value > client default.

    Attributes:
        timeout: seconds per attempt (float) or None for no timeout. Stored on the
            step row as an ``INTERVAL``; the database clock decides (seed).
        max_attempts: attempts before the step is discarded (default 25).
        max_reclaims: lease expiries reclaimed before the step is discarded with
            ``error_kind="reclaim_limit"``; None means unbounded.
        backoff: ``backoff(attempt) -> seconds`` (a callable, used by supervisors that
            register the step), or seconds, or a list of seconds per failed attempt (both
            stored on the row at enqueue); default ``attempt**4`` +-10 %.
        queue: queue name (default ``"default"``).
        priority: lower runs first (as in River and Oban); default 0.
        concurrency: at most this many of the step running at once per key, across
            every supervisor (None: no limit). Stored on the row at enqueue.
        concurrency_key: the step's key: a callable of the input returning a string,
            or a string (at enqueue). Steps of different keys in a queue are claimed
            round-robin; ``concurrency`` and ``rate_limit`` count per (step, key).
        rate_limit: ``(count, seconds)``: at most ``count`` starts per ``seconds`` per
            key, on the database clock (None: no limit). Stored on the row at enqueue.
        memory_limit: bytes of memory the attempt's whole process tree may use (an int,
            or a size such as ``"512MiB"``); None: no cap. Stored on the row.
        cpu_limit: CPU seconds the tree may use in one attempt (seconds or timedelta).
        max_processes: processes the tree may have at once, the child included.
        max_open_files: descriptors each process of the tree may hold.
        max_snoozes: times the handler may raise ``cy.Snooze`` (each run again later, no
            attempt spent) before the step is discarded as ``snooze_limit`` (default 100);
            read by the supervisor that registers the step.
        unique: a :class:`Unique` (one run per "same" enqueue), or None.
        async_concurrency: an ``async def`` step's attempts one child runs at once on its
            event loop (default 1); read by the supervisor that registers the step.
    """

    timeout: float | None = None
    max_attempts: int | None = None
    max_reclaims: int | None = None
    backoff: Backoff | None = None
    queue: str | None = None
    priority: int | None = None
    concurrency: int | None = None
    concurrency_key: ConcurrencyKey | None = None
    rate_limit: tuple[int, float] | None = None
    memory_limit: int | None = None
    cpu_limit: float | None = None
    max_processes: int | None = None
    max_open_files: int | None = None
    max_snoozes: int | None = None
    unique: Unique | None = None
    async_concurrency: int | None = None

    @classmethod
    def build(
        cls,
        *,
        timeout: Duration | None = None,
        max_attempts: int | None = None,
        max_reclaims: int | None = None,
        backoff: Backoff | None = None,
        queue: str | None = None,
        priority: int | None = None,
        concurrency: int | None = None,
        concurrency_key: ConcurrencyKey | None = None,
        rate_limit: tuple[int, Duration] | None = None,
        memory_limit: int | str | None = None,
        cpu_limit: Duration | None = None,
        max_processes: int | None = None,
        max_open_files: int | None = None,
        max_snoozes: int | None = None,
        unique: Unique | None = None,
        async_concurrency: int | None = None,
    ) -> "StepOptions":
        """Validate and normalise raw option values.

        Raises:
            ConfigurationError: a value has the wrong type or range.
        """
        check_int(max_attempts, "max_attempts", 1)
        check_int(max_reclaims, "max_reclaims", 0)
        check_int(max_snoozes, "max_snoozes", 0)
        check_int(async_concurrency, "async_concurrency", 1)
        if unique is not None and not isinstance(unique, Unique):
            raise ConfigurationError(f"unique takes a cy.Unique(...), not {type(unique).__name__}")
        try:
            check_backoff(backoff)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if queue is not None:
            check_name(queue, "queue")
        check_int(priority, "priority", INT_MIN)
        check_int(concurrency, "concurrency", 1)
        if concurrency_key is not None and not callable(concurrency_key):
            check_key(concurrency_key)
        return cls(
            timeout=seconds(timeout, "timeout"),
            max_attempts=max_attempts,
            max_reclaims=max_reclaims,
            backoff=backoff,
            queue=queue,
            priority=priority,
            concurrency=concurrency,
            concurrency_key=concurrency_key,
            rate_limit=check_rate_limit(rate_limit),
            memory_limit=parse_size(memory_limit, "memory_limit"),
            cpu_limit=seconds(cpu_limit, "cpu_limit"),
            max_processes=check_count(max_processes, "max_processes"),
            max_open_files=check_count(max_open_files, "max_open_files"),
            max_snoozes=max_snoozes,
            unique=unique,
            async_concurrency=async_concurrency,
        )

    def key_for(self, input: Any) -> str:
        """The concurrency key of a step with ``input`` ('' without one).

        Raises:
            ConfigurationError: the key callable failed or returned no string.
        """
        return key_of(self.concurrency_key, input)

    @property
    def limits(self) -> Limits:
        """The resource caps of these options (:mod:`cyclone_mp.limits`)."""
        return Limits(memory=self.memory_limit, cpu=self.cpu_limit, processes=self.max_processes,
                      open_files=self.max_open_files)

    def over(self, base: "StepOptions") -> "StepOptions":
        """Return these options with unset fields taken from ``base``."""
        return StepOptions(**{
            f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(base, f.name)
            for f in dataclasses.fields(self)
        })


@dataclasses.dataclass(frozen=True)
class HandlerRef:
    """Where a child process finds a handler: ``module`` (and ``path`` for a script), ``qualname``."""

    module: str
    qualname: str
    path: str | None = None

    def importable(self) -> bool:
        """False for lambdas and functions defined inside other functions."""
        return "<" not in self.qualname


def _check_signature(name: str, fn: Callable[..., Any]) -> None:
    """Raise ConfigurationError unless ``fn`` can be called as ``fn(ctx, input)`` (SPEC 2):
    a wrong signature fails at registration, not at every attempt of every run."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C callable without one: left to the call
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise ConfigurationError(f"step {name!r}: a handler is called as fn(ctx, input); "
                                 f"{getattr(fn, '__qualname__', fn)}{signature} cannot be ({exc})") from None


def handler_ref(fn: Callable[..., Any]) -> HandlerRef:
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "<unknown>")
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None) if module in ("__main__", "__mp_main__") or module.startswith("cyclone_mp_app_") else None
    return HandlerRef(module=module, qualname=qualname, path=path)


class Step:
    """A registered handler ``fn(ctx, input) -> output`` with its options.

    The handler may be an ``async def`` function: its child runs it on an event loop of
    its own, and a cancel cancels its task. Calling a ``Step`` calls the
    handler directly (useful in unit tests; an async handler's call returns its coroutine).
    """

    kind = "step"

    def __init__(self, name: str, fn: Callable[..., Any], options: StepOptions) -> None:
        check_name(name, "step name")
        if not callable(fn):
            raise ConfigurationError(f"step {name!r}: handler must be callable")
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise ConfigurationError(f"step {name!r}: a handler returns its output; a generator "
                                     "(a function that yields) cannot be a step")
        _check_signature(name, fn)
        self.name = name
        self.fn = fn
        self.options = options
        self.ref = handler_ref(fn)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __call__(self, ctx: Any, inp: Any) -> Any:
        return self.fn(ctx, inp)

    @property
    def is_async(self) -> bool:
        """True for an ``async def`` handler."""
        return inspect.iscoroutinefunction(self.fn)

    def __repr__(self) -> str:
        return f"Step({self.name!r})"


def step(
    name: str,
    *,
    timeout: Duration | None = None,
    max_attempts: int | None = None,
    max_reclaims: int | None = None,
    backoff: Backoff | None = None,
    queue: str | None = None,
    priority: int | None = None,
    concurrency: int | None = None,
    concurrency_key: Callable[[Any], str] | None = None,
    rate_limit: tuple[int, Duration] | None = None,
    memory_limit: int | str | None = None,
    cpu_limit: Duration | None = None,
    max_processes: int | None = None,
    max_open_files: int | None = None,
    max_snoozes: int | None = None,
    unique: Unique | None = None,
    async_concurrency: int | None = None,
) -> Callable[[Callable[..., Any]], Step]:
    """Decorator that turns ``fn(ctx, input) -> output`` into a :class:`Step`.

    Args:
        name: the step's unique name (what workers claim by).
        timeout: seconds (float) or timedelta per attempt; None: no timeout.
        max_attempts: attempts before discard (default 25, SPEC 3).
        max_reclaims: lease expiries tolerated before discard (default unbounded).
        backoff: ``backoff(attempt) -> seconds``, seconds, or a list of seconds per
            failed attempt (default ``attempt**4`` +-10 %).
        queue: queue name (default ``"default"``); priority: lower runs first.
        concurrency: at most this many running at once per key, across all supervisors.
        concurrency_key: ``key(input) -> str``: the step's key (fairness and limits).
        rate_limit: ``(count, seconds)``: at most ``count`` starts per ``seconds`` per key.
        memory_limit: bytes (or ``"512MiB"``) of memory for the attempt's whole process
            tree; cpu_limit: its CPU seconds; max_processes: its processes at once;
            max_open_files: descriptors per process (``RLIMIT_NOFILE``, soft and hard).
            Killed past a cap, the attempt fails as ``memory_limit``, ``cpu_limit`` or
            ``process_limit``; past ``max_open_files`` (or with a process out of its
            slot's cgroups) as ``error``, the cause named (docs/resource-limits.md).
        max_snoozes: times the handler may raise ``cy.Snooze`` before the step is
            discarded as ``snooze_limit`` (default 100).
        unique: a :class:`Unique`: an enqueue of the same run as one that holds its place
            returns that run instead of making another.
        async_concurrency: for an ``async def`` handler, how many of its attempts one child
            runs at once on its event loop (each with its own lease, timeout and cancel; a
            kill of one takes the child and its siblings, which run again without spending
            an attempt). Default 1. Not with resource limits (they cap a whole child).

    Raises:
        ConfigurationError: an invalid option.
    """
    if concurrency_key is not None and not callable(concurrency_key):
        raise ConfigurationError("cy.step(concurrency_key=...) takes a callable of the input (a string key is given at enqueue)")
    options = StepOptions.build(
        timeout=timeout, max_attempts=max_attempts, max_reclaims=max_reclaims,
        backoff=backoff, queue=queue, priority=priority, concurrency=concurrency,
        concurrency_key=concurrency_key, rate_limit=rate_limit, memory_limit=memory_limit, cpu_limit=cpu_limit,
        max_processes=max_processes, max_open_files=max_open_files, max_snoozes=max_snoozes, unique=unique,
        async_concurrency=async_concurrency,
    )

    def decorate(fn: Callable[..., Any]) -> Step:
        if (async_concurrency or 1) > 1:
            if not inspect.iscoroutinefunction(fn):
                raise ConfigurationError(f"step {name!r}: async_concurrency needs an async def handler")
            if options.limits:
                raise ConfigurationError(f"step {name!r}: async_concurrency does not go with resource limits "
                                         "(they cap a whole child, which runs several attempts at once)")
        return Step(name, fn, options)

    return decorate
