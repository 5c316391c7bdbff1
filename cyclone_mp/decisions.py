"""What an event does to a step: pure functions, no I/O (SPEC section 3's table).

The store reads the row under its locks, asks one of these functions, and writes the
answer. Tests call them directly.
"""

from __future__ import annotations

import dataclasses

# error_kind values: SPEC 3's, then kinds that name what happened more precisely
TIMEOUT = "timeout"
ERROR = "error"
PERMANENT = "permanent"
CHILD_EXITED = "child_exited"
RECLAIM_LIMIT = "reclaim_limit"
SNOOZE_LIMIT = "snooze_limit"  #: a step that raised cy.Snooze more than its max_snoozes
OUTPUT_INVALID = "output_invalid"  # the output or a progress value broke the payload boundary
NOT_IMPORTABLE = "not_importable"  # the child cannot import the handler, or it is not callable
MEMORY_ERROR = "memory_error"  # the handler raised MemoryError
EXIT = "exit"  # the handler raised SystemExit (sys.exit); the message has the code
# causes of death of a tree (cyclone_mp.limits): a cap of the step, or the kernel's OOM killer
MEMORY_LIMIT = "memory_limit"
CPU_LIMIT = "cpu_limit"
PROCESS_LIMIT = "process_limit"
OOM_KILLED = "oom_killed"
DEATH_KINDS = (MEMORY_LIMIT, CPU_LIMIT, PROCESS_LIMIT, OOM_KILLED)

#: Errors no retry can heal: the same code fails the same way on every attempt (the
#: handler's module does not import, or its output breaks the payload boundary), so
#: their step is discarded at once, like ``permanent``. Fix the code, then
#: ``client.retry``. The settle statements (``sql/settle.sql``) list them too.
UNHEALABLE_KINDS = (OUTPUT_INVALID, NOT_IMPORTABLE)
#: Kinds that discard their step at the attempt that reported them.
PERMANENT_KINDS = (PERMANENT, *UNHEALABLE_KINDS)
#: Kinds a failed attempt may have; each consumes an attempt and is retried after
#: backoff (discarded when exhausted) except :data:`PERMANENT_KINDS`.
FAILURE_KINDS = (TIMEOUT, ERROR, PERMANENT, CHILD_EXITED, OUTPUT_INVALID, NOT_IMPORTABLE, MEMORY_ERROR, EXIT,
                 *DEATH_KINDS)
#: Kinds a child reports in its result frame that are stored as they are; anything
#: else it reports (besides "cancelled", which the cancel's reason decides) is ``error``.
CHILD_REPORTED_KINDS = (ERROR, PERMANENT, OUTPUT_INVALID, NOT_IMPORTABLE, MEMORY_ERROR, EXIT)


def reported_kind(kind: object) -> str:
    """The kind to store for a failed result a child reported with ``kind``: one of
    :data:`CHILD_REPORTED_KINDS`, else ``error`` (a child is not trusted to name any
    other kind, e.g. ``timeout``)."""
    return kind if isinstance(kind, str) and kind in CHILD_REPORTED_KINDS else ERROR


@dataclasses.dataclass(frozen=True)
class AttemptEnd:
    """The durable outcome of a consumed attempt.

    Attributes:
        state: ``"available"`` (retry after ``delay`` seconds) or ``"discarded"``.
        attempt: the step's ``attempt`` column afterwards (the next attempt's number when
            retrying; the number of attempts consumed when discarded).
        error_kind: the stored kind (``timeout`` wins over the reported kind once the
            database deadline has passed).
        delay: seconds until the retry may be claimed (0 when discarded).
    """

    state: str
    attempt: int
    error_kind: str
    delay: float


def end_attempt(*, attempt: int, max_attempts: int, kind: str, timed_out: bool, backoff: float) -> AttemptEnd:
    """Decide a failed attempt: retry after backoff, or discard when exhausted or when
    its kind is one of :data:`PERMANENT_KINDS` (unless the database deadline passed
    first: a timeout is retried as any timeout).

    Args:
        attempt: the number of the attempt that ended (1-based).
        max_attempts: the step's bound.
        kind: the reported error kind (one of ``FAILURE_KINDS``).
        timed_out: the database says ``started_at + timeout <= now()``; the database
            clock is the authority, so the attempt then counts as a timeout.
        backoff: seconds to wait before the next attempt (already jittered).
    """
    if kind not in FAILURE_KINDS:
        raise ValueError(f"unknown failure kind {kind!r}")
    effective = TIMEOUT if timed_out else kind
    if effective in PERMANENT_KINDS or attempt >= max_attempts:
        return AttemptEnd(state="discarded", attempt=attempt, error_kind=effective, delay=0.0)
    return AttemptEnd(state="available", attempt=attempt + 1, error_kind=effective, delay=max(0.0, backoff))


def discard_message(kind: str, entry: dict[str, object], earlier_kinds: list[str]) -> str | None:
    """The poison quarantine: the stored error of a step discarded by an attempt
    that died of a cause in :data:`DEATH_KINDS`, when the attempts before it died of the
    same cause: ``"killed 3 times: memory_limit 512 MiB, peak 2.1 GiB"`` (the entry's
    ``cause``), so an operator needs no log. ``earlier_kinds``: the kinds of the step's
    earlier error entries, oldest first (cancelled attempts, which consumed nothing, are
    skipped). None: the attempt's own message stands. The settle statements
    (``sql/settle.sql``, the ``ended`` CTE) say the same in SQL."""
    cause = entry.get("cause")
    if kind not in DEATH_KINDS or not cause:
        return None
    times = 1
    for earlier in reversed(earlier_kinds):
        if earlier == "cancelled":
            continue
        if earlier != kind:
            break
        times += 1
    return f"killed {times} times: {cause}" if times > 1 else None


@dataclasses.dataclass(frozen=True)
class Expiry:
    """What the recovery sweep does with a running row it re-checked under lock.

    ``action`` is ``"timeout"`` (consume the attempt, see :func:`end_attempt`),
    ``"reclaim"`` (available at once, ``reclaims + 1``), ``"reclaim_limit"`` (discard)
    or ``"none"`` (the row was renewed meanwhile).
    """

    action: str


def expiry(*, timed_out: bool, lease_expired: bool, reclaims: int, max_reclaims: int | None) -> Expiry:
    """Decide a sweep candidate (seed: "What Happens When a Worker Crashes").

    A timed-out step consumes an attempt whether or not its lease also expired. A lease
    expiry alone is a crash: reclaimed without consuming an attempt, unless
    ``reclaims`` already reached ``max_reclaims`` (then discarded with
    ``error_kind="reclaim_limit"``; ``max_reclaims=0`` discards on the first expiry).
    """
    if timed_out:
        return Expiry("timeout")
    if not lease_expired:
        return Expiry("none")
    if max_reclaims is not None and reclaims >= max_reclaims:
        return Expiry("reclaim_limit")
    return Expiry("reclaim")
