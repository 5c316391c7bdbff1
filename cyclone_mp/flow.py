"""Flow control on the Python side: concurrency keys, rate limits, and which claimed rows wait.

A step may run at most ``concurrency`` at once per concurrency key and start at most
``rate_limit = (count, seconds)`` times per window per key, across every supervisor;
claims walk the keys of a queue round-robin (fairness). The database decides all three
in the claim (``cyclone_slots``, the fair, limited claim statements in
``sql/claim.sql``, chosen per queue by ``store/claims.py``). What this module owns is
the rest: the options' checks (:func:`check_key`, :func:`check_rate_limit`,
:func:`check_enqueue_key`), a step's key for an input (:func:`key_of`), and the rule a
supervisor follows with a claimed rate-limited row (:func:`rated`): a rate limit counts
handler starts, so such a row starts on an idle child at once or is given back; it is
never held or queued behind a busy child.
"""

from __future__ import annotations

from typing import Any, Callable

from .durations import seconds
from .errors import ConfigurationError
from .protocol import check_text

#: A concurrency key: a callable of the step's input, or (at enqueue) a string.
ConcurrencyKey = Callable[[Any], str] | str
MAX_KEY_LENGTH = 200  #: characters of a concurrency key
RATE_LIMIT_MAX_COUNT = 10_000  #: the most starts a rate limit's window may allow


def check_key(key: Any) -> str:
    """``key`` if it is a usable concurrency key (a string of 1 to 200 characters that
    PostgreSQL can store).

    Raises:
        ConfigurationError: it is not (:class:`~cyclone_mp.errors.UnstorableText` for a
            NUL or a lone surrogate).
    """
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ConfigurationError(
            f"concurrency_key must be a non-empty string of at most {MAX_KEY_LENGTH} characters, got {key!r:.80}")
    return check_text(key, "concurrency_key")


def check_rate_limit(value: Any) -> tuple[int, float] | None:
    """``(count, seconds)`` normalised, or None.

    Raises:
        ConfigurationError: not a pair of an int >= 1 and a positive duration.
    """
    if value is None:
        return None
    try:
        count, period = value
    except (TypeError, ValueError):
        raise ConfigurationError(f"rate_limit must be (count, seconds), got {value!r}") from None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1 or count > RATE_LIMIT_MAX_COUNT:
        raise ConfigurationError(f"rate_limit count must be an int from 1 to {RATE_LIMIT_MAX_COUNT}, got {count!r}")
    return count, seconds(period, "rate_limit seconds", allow_none=False)


def key_of(key: ConcurrencyKey | None, input: Any) -> str:
    """The concurrency key of a step whose ``concurrency_key`` is ``key`` (None, a string,
    or a callable of the input), for ``input`` ('' without one).

    Raises:
        ConfigurationError: the key callable failed or returned no usable key.
    """
    if key is None:
        return ""
    if callable(key):
        try:
            key = key(input)
        except Exception as exc:  # noqa: BLE001 - the user's callable: say which and why
            raise ConfigurationError(f"concurrency_key({input!r:.80}) raised {type(exc).__name__}: {exc}") from exc
    return check_key(key)


def check_enqueue_key(key: Any) -> None:
    """A per-enqueue ``concurrency_key`` is a string (or None).

    Raises:
        ConfigurationError: it is a callable (a callable of the input belongs to ``cy.step``).
    """
    if key is not None and callable(key):
        raise ConfigurationError("a per-enqueue concurrency_key is a string (a callable of the input belongs to cy.step)")


def rated(row: dict[str, Any]) -> bool:
    """The claimed ``row`` took its rate slot with the claim (its ``rated`` column): it
    starts on an idle child at once or is given back, never held or queued."""
    return bool(row.get("rated"))
