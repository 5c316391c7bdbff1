"""Parsing and validating the dashboard's request parameters (pure, no I/O).

Every malformed value raises :class:`BadRequest` with a message that names the
parameter and says what is expected; the app turns it into a 400 (JSON under
``/api/``, a page elsewhere), never a 500.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import uuid
from typing import Any, Mapping

from ..errors import CycloneError
from ..status import TERMINAL_RUN_STATES

RUN_STATES = ("running", "paused", *TERMINAL_RUN_STATES)
STEP_STATES = ("pending", "available", "running", "waiting_signal", "waiting_timer", "paused",
               "completed", "discarded", "cancelled")
ACTIONS = ("cancel", "retry", "pause", "resume", "signal")
MAX_LIMIT = 500
MAX_OFFSET = 1_000_000
MAX_MINUTES = 24 * 60
MAX_NAME = 200
REFRESH_SECONDS = 2.0  # seconds between a page's refreshes from its API (cyclone-mp dashboard --refresh)


class BadRequest(CycloneError, ValueError):
    """A request parameter is malformed."""


def integer(params: Mapping[str, str], name: str, *, default: int, lo: int, hi: int) -> int:
    """The integer parameter ``name`` in ``[lo, hi]`` (``default`` when absent or empty)."""
    raw = params.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {_show(raw)}") from None
    if value < lo or value > hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}, got {value}")
    return value


def choice(params: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    """The parameter ``name``, one of ``choices`` (None when absent or empty)."""
    raw = (params.get(name) or "").strip()
    if not raw:
        return None
    if raw not in choices:
        raise BadRequest(f"{name} must be one of {', '.join(choices)}; got {_show(raw)}")
    return raw


def text(params: Mapping[str, str], name: str, *, max_len: int = MAX_NAME) -> str | None:
    """A short free-text parameter (None when absent or empty)."""
    raw = (params.get(name) or "").strip()
    if not raw:
        return None
    if len(raw) > max_len:
        raise BadRequest(f"{name} is longer than {max_len} characters")
    if "\x00" in raw:
        raise BadRequest(f"{name} must not contain a NUL character")
    return raw


def timestamp(params: Mapping[str, str], name: str) -> dt.datetime | None:
    """An ISO 8601 instant (``2026-11-30T03:32:19Z``, ``2026-11-30 03:32``, ``2026-11-30``);
    one without an offset is UTC (the dashboard shows every time in UTC)."""
    raw = (params.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = dt.datetime.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an ISO 8601 date or time such as 2026-11-30T03:32:19Z, "
                         f"got {_show(raw)}") from None
    if value.tzinfo is None or value.utcoffset() is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value


def run_id(value: str) -> str:
    """A run id: a UUID in canonical form."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise BadRequest(f"run id must be a UUID, got {_show(value)}") from None


def action(value: str) -> str:
    """One of the operator actions."""
    if value not in ACTIONS:
        raise BadRequest(f"action must be one of {', '.join(ACTIONS)}; got {_show(value)}")
    return value


def encode_cursor(created_at: dt.datetime, id: str) -> str:
    """The opaque keyset cursor of a runs row (``created_at``, ``id``)."""
    raw = f"{created_at.isoformat()}|{id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(value: str) -> tuple[dt.datetime, str]:
    """Inverse of :func:`encode_cursor`; raises BadRequest for anything else."""
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
        when, _, ident = raw.partition("|")
        created = dt.datetime.fromisoformat(when)
        if created.tzinfo is None:
            raise ValueError("naive")
        return created, str(uuid.UUID(ident))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise BadRequest(f"cursor is malformed (use the next_cursor of a previous page), got {_show(value)}") from None


@dataclasses.dataclass(frozen=True)
class RunQuery:
    """The filters and page of the runs list (``/runs`` and ``/api/runs``)."""

    state: str | None = None
    name: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    cursor: str | None = None
    limit: int = 50
    offset: int = 0

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> "RunQuery":
        """Validate query parameters ``state, name, since, until, cursor, limit, offset``."""
        since, until = timestamp(params, "since"), timestamp(params, "until")
        if since is not None and until is not None and since >= until:
            raise BadRequest("since must be earlier than until")
        cursor = text(params, "cursor", max_len=400)
        if cursor is not None:
            decode_cursor(cursor)
        return cls(
            state=choice(params, "state", RUN_STATES), name=text(params, "name"), since=since, until=until,
            cursor=cursor, limit=integer(params, "limit", default=50, lo=1, hi=MAX_LIMIT),
            offset=integer(params, "offset", default=0, lo=0, hi=MAX_OFFSET),
        )

    @property
    def after(self) -> tuple[dt.datetime, str] | None:
        """The decoded cursor, or None."""
        return decode_cursor(self.cursor) if self.cursor else None

    def params(self, **changes: Any) -> dict[str, str]:
        """The query as URL parameters (empty ones left out), with ``changes`` applied."""
        values = {**dataclasses.asdict(self), **changes}
        out: dict[str, str] = {}
        for key, value in values.items():
            if value is None or value == "" or (key == "offset" and value == 0) or (key == "limit" and value == 50):
                continue
            out[key] = value.isoformat() if isinstance(value, dt.datetime) else str(value)
        return out


def _show(value: Any) -> str:
    text_ = str(value)
    return repr(text_ if len(text_) <= 60 else text_[:57] + "...")
