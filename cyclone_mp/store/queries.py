"""The named SQL (the ``sql/*.sql`` files, one per concern), the migrations' files, and
the shapes of the rows and parameters the store's methods take (STYLE pattern 1: every
query lives in a ``sql/*.sql`` file under a ``-- name:`` header; a name is unique across
the files)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import re
from typing import Any, Iterable, Sequence

from psycopg.types.json import Jsonb

from ..noderows import to_us

#: Keys of an error entry that describe how the child ended (SPEC 4, "Every attempt that ends").
FORENSIC_KEYS = frozenset({
    "pid", "exit_code", "signal", "signal_name", "killed_by_supervisor", "trigger",
    "cpu_seconds", "peak_rss_kb", "elapsed", "worker", "tree", "limits", "cause", "enforced_by", "lingering_threads",
    "start_delay", "returned_late",
})
#: Stored bytes (``pg_column_size``) up to which a claimed row's input and upstream
#: outputs come with its claim; a bigger row comes without them ("big") and the
#: supervisor loads them alone (:meth:`Payloads.load`), so one huge row never slows
#: a claim past its bound nor holds back its neighbours.
INLINE_MAX = 512 * 1024
MIGRATION_LOCK = 0x6379636C6F6E65  # "cyclone": pg_advisory_xact_lock key for migrate()
NOTIFY_CHANNEL = "cyclone_mp"
CANCEL_CHANNEL = "cyclone_mp_cancel"  #: client.cancel's NOTIFY to the supervisors running its steps: "<id>.<generation>"


def _code(line: str) -> str:
    """A line of SQL without its trailing ``--`` comment (none of ours is inside a string
    literal): shorter texts keep the hot statements under psycopg's 4,096-character
    limit for caching a query's parsed form (above it, each call re-parsed ~6,700
    characters: about 75 us)."""
    at = line.find("--")
    while at >= 0:
        if line.count("'", 0, at) % 2 == 0:
            return line[:at].rstrip()
        at = line.find("--", at + 2)
    return line


def _load_queries() -> dict[str, str]:
    """Every named block of the ``sql/*.sql`` files (:func:`parse_queries`)."""
    files = sorted((f for f in importlib.resources.files("cyclone_mp.sql").iterdir() if f.name.endswith(".sql")),
                   key=lambda f: f.name)
    return parse_queries((f.name, f.read_text()) for f in files)


def parse_queries(files: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The ``-- name:`` blocks of ``(file name, text)`` files, by name, without comments
    and indentation (none of our literals spans lines), fragments spliced in. Raises
    RuntimeError when two blocks (in one file or two) share a name, or a block cites an
    unknown fragment."""
    queries: dict[str, str] = {}
    where: dict[str, str] = {}
    for file, text in files:
        for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
            name, _, body = block.partition("\n")
            name = name.strip()
            if name in queries:  # a second block of one name would silently replace the first
                raise RuntimeError(f"sql/{file}: {name!r} is already defined in sql/{where[name]}")
            body = "\n".join(code.strip() for code in map(_code, body.strip().splitlines()) if code.strip())
            queries[name], where[name] = body.strip().rstrip(";"), file
    # Fragments (names ending in _ctes or _expr) are spliced into the queries that cite
    # them, and into the fragments that cite them, until none is left.
    fragments = {name: sql for name, sql in queries.items() if name.endswith(("_ctes", "_expr"))}

    def splice(body: str) -> str:
        for _ in range(10):
            spliced = re.sub(r"\{(\w+_(?:ctes|expr))\}", lambda m: fragments.get(m[1], m[0]), body)
            if spliced == body:
                break
            body = spliced
        if left := re.findall(r"\{\w+_(?:ctes|expr)\}", body):
            raise RuntimeError(f"sql: unknown or circular fragments {left}")
        return body
    return {name: splice(body) for name, body in queries.items()}


Q = _load_queries()

#: psycopg keeps the parsed form of a query only up to this many characters (its
#: ``MAX_CACHED_STATEMENT_LENGTH``, 4,096); longer ones are parsed again at every call.
#: The claim and settle statements are longer (the fair, limited claim): parsing
#: settle_completions (10,600 characters) took 35 us a call, against 0.07 us cached. The limit is a module constant read at each call; it is raised to fit them.
PARSE_CACHE_LENGTH = 16_384


def _fit_parse_cache() -> None:
    from psycopg import _queries  # lazy: a private module of psycopg: absent from some versions

    if getattr(_queries, "MAX_CACHED_STATEMENT_LENGTH", PARSE_CACHE_LENGTH) < PARSE_CACHE_LENGTH:
        _queries.MAX_CACHED_STATEMENT_LENGTH = PARSE_CACHE_LENGTH


with contextlib.suppress(ImportError):  # a psycopg without it: the statements are parsed at each call
    _fit_parse_cache()


def _migrations() -> list[tuple[int, str, str]]:
    folder = importlib.resources.files("cyclone_mp.sql.migrations")
    found = []
    for entry in folder.iterdir():
        match = re.match(r"^(\d+)_.*\.sql$", entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text()))
    return sorted(found)


# The per-step arrays of the hot path go to the statement as PostgreSQL array literals
# (text), built in one join; the statement casts each (``%(ids)s::bigint[]``) and the
# server's array input parses it. psycopg would dump a list element by element in Python
# (its ListDumper, a regular expression per text element), the larger part of the
# outcome writer's CPU per step.


def completion_arrays(completions: Sequence[tuple[Any, ...]]) -> dict[str, str]:
    """The settle statements' completion parameters, built in one pass over
    ``(id, generation, output, progress[, start delay in seconds])`` items: ``ids``,
    ``outputs``, ``progress`` and ``start_delays_us`` as array literals (one join each, not
    psycopg's dump per element), and ``leases``, a JSON object of each ``"id:generation"``
    key's 1-based position in those arrays, which the statement finds by a binary search
    (jsonb keeps an object's keys sorted). An output is JSON text (``json.dumps``, as
    psycopg's ``Jsonb`` dumps it; None is JSON ``null``); a None progress or start delay is
    SQL NULL (the row keeps its own)."""
    ids, leases, outputs, progress, delays = [], [], [], [], []
    dumps = json.dumps
    for n, item in enumerate(completions, 1):
        step_id, generation, output, prog = item[0], item[1], item[2], item[3]
        ids.append(str(step_id))
        leases.append(f'"{step_id}:{generation}":{n}')
        outputs.append('"null"' if output is None else _quoted(dumps(output)))
        progress.append("NULL" if prog is None else _quoted(dumps(prog)))
        delay = item[4] if len(item) > 4 else None
        delays.append("NULL" if delay is None else str(to_us(delay)))
    return {"ids": "{" + ",".join(ids) + "}", "leases": "{" + ",".join(leases) + "}",
            "outputs": "{" + ",".join(outputs) + "}", "progress": "{" + ",".join(progress) + "}",
            "start_delays_us": "{" + ",".join(delays) + "}"}


def _quoted(text: str) -> str:
    """``text`` as an element of an array literal: in double quotes, with ``\\`` and ``"`` escaped."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def nullable_jsonb(value: Any) -> Jsonb | None:
    """``value`` as a jsonb parameter, or SQL NULL (not JSON ``null``) for None."""
    return None if value is None else Jsonb(value)


@dataclasses.dataclass(frozen=True)
class FailedAttempt:
    """One failed attempt for :meth:`Outcomes.settle`: ``kind`` is a
    :data:`~cyclone_mp.decisions.FAILURE_KINDS` value, ``entry`` the error entry (JSON),
    ``delay`` the backoff in seconds if the step is retried."""

    id: int
    generation: int
    kind: str
    entry: dict[str, Any]
    delay: float
    require_timed_out: bool
    progress: Any = None


@dataclasses.dataclass(frozen=True)
class Settled:
    """What :meth:`Outcomes.settle` did: the ``(id, lease generation)`` leases whose
    completion and whose failure CAS held (with the error kind each failure stored), and
    the claimed rows."""

    completed: set[tuple[int, int]]
    failed: set[tuple[int, int]]
    claimed: list[dict[str, Any]]
    wait: float | None = None  # the claim's rate-limit wait (see ClaimResult.wait)
    failed_kinds: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)  # the error kind stored
    discarded: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # failures that discarded their step
    #: outcomes whose run another session held locked: not tried, to write in a later statement
    skipped: set[tuple[int, int]] = dataclasses.field(default_factory=set)

