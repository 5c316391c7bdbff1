"""The claim (``sql/claim.sql``): take available steps under a lease, SKIP LOCKED (SPEC 1
and 4), fair by key and within the steps' concurrency and rate limits.

Four claim statements do this, from the least work to the most; :class:`Claims` picks
one per call from the queues' flow marks, which every claim's meta row brings back (no
round trip of their own), and keeps each queue's fairness cursor between calls. The
settle statements (:mod:`.outcomes`) end with the same claim and use the same choice.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from ..noderows import to_us
from .queries import INLINE_MAX, Q
from .session import Session, translate


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    """What :meth:`Claims.claim` took: the claimed ``rows`` (dicts, as the claim statement
    returns them); ``wait``, the seconds until a rate-limited step this claim held back
    may start, or None; ``marks``, the queues' flow marks as the last meta row said
    (queue -> ``"keys"``, ``"limits"`` or ``"rates"``; a queue without one is plain), or
    None while no claim has said."""

    rows: list[dict[str, Any]]
    wait: float | None
    marks: dict[str, str] | None


class Claims:
    """The claim statements on ``session``, and what they keep between calls: per queue,
    the key the last walk ended at (``cursors``) and the flow marks (``marks``, for the
    queues in ``marks_for``)."""

    #: The claim statements' suffixes, from the least work to the most: each takes every
    #: step the ones before it take, and more.
    CLAIMS = ("_plain", "_fair", "_concurrency", "")
    _FOR_MARK = {None: "_plain", "keys": "_fair", "limits": "_concurrency", "rates": ""}

    def __init__(self, session: Session) -> None:
        self.session = session
        #: Per queue, the concurrency key the last claim's walk ended at: the next claim
        #: serves the keys after it first (round-robin).
        self.cursors: dict[str, str] = {}
        #: The marks of the queues the last claim statement asked for (see :meth:`statement`),
        #: as its meta row said; None until a claim said.
        self.marks: dict[str, str] | None = None
        self.marks_for: frozenset[str] = frozenset()  # the queues ``marks`` covers

    def statement(self, name: str, queues: Sequence[str], limit: int) -> str:
        """Which claim a statement of ``name`` (``claim``, ``settle``, ``settle_completions``)
        uses, from the least to the most work:

        - ``name_plain``: no requested queue was ever entered by a step with a key or a
          limit (it takes no such step);
        - ``name_fair``: keyed steps did, no limited one (no slots; it takes no limited step);
        - ``name_concurrency``: a step with a concurrency limit did, none with a rate limit
          (concurrency slots only; it takes no rate-limited step);
        - ``name``, the full limited claim: a rate-limited step did, or the marks of these
          queues are not known yet (it takes every kind of step).

        The marks (cyclone_flow_queues, written at enqueue, never cleared) come back in
        every claim statement's meta row (:meth:`keep_meta`), so they cost no round trip
        of their own (under 250 ms of latency, a read of its own per claim pushed claims
        past their bound). A claim chosen from older marks never passes a limit (each
        claim leaves alone what it is not made for); :meth:`claim` claims again at once
        when the marks it got back call for a claim that takes more."""
        if limit <= 0:
            return name + "_plain"
        if self.marks is None or not set(queues) <= self.marks_for:
            return name
        rank = max((self.CLAIMS.index(self._FOR_MARK[self.marks.get(q)]) for q in queues), default=0)
        return name + self.CLAIMS[rank]

    @classmethod
    def rank(cls, statement: str) -> int:
        """The place of a claim statement in :data:`CLAIMS` (more: it takes more kinds of steps)."""
        return next((i for i, suffix in enumerate(cls.CLAIMS[:-1]) if statement.endswith(suffix)), len(cls.CLAIMS) - 1)

    def params(self, queues: Sequence[str], statement: str) -> dict[str, Any]:
        """The fairness cursors of a claim (per queue, the key its last walk ended at) and
        which limited steps it may take: ``limits``, any (the limited claims); ``rates``,
        rate-limited ones too (the full claim only)."""
        rank = self.rank(statement)
        return {"queues": list(queues), "cursors": [self.cursors.get(q) for q in queues],
                "limits": rank >= self.CLAIMS.index("_concurrency"), "rates": rank == len(self.CLAIMS) - 1}

    def keep_meta(self, meta: dict[str, Any] | None, queues: Sequence[str]) -> float | None:
        """Keep what a claim's meta row says (the queues' marks, where each queue's walk
        ended); returns its rate-limit wait (seconds, or None)."""
        if meta is None:
            return None
        if meta.get("step_name") is not None:
            self.marks = json.loads(meta["step_name"])
            self.marks_for = frozenset(queues)
        if meta.get("node"):
            self.cursors.update(json.loads(meta["node"]))
        wait = meta.get("timeout")
        return None if wait is None else float(wait)

    @translate
    def claim(self, *, owner: str, queues: Sequence[str], names: Sequence[str], limit: int, ttl: float,
              kill_within: float = 0.0, start_now: int | None = None) -> ClaimResult:
        """Claim up to ``limit`` available steps (SKIP LOCKED) of ``queues`` and step
        ``names``, each under a ``ttl``-second lease, in one statement.

        Fair by key (round-robin within each queue) and within the steps' concurrency
        and rate limits. When the marks that came back call for a claim that takes more
        kinds of steps than the one just made (a queue's first keyed or limited step),
        and it took fewer than ``limit``, the rest is claimed at once with that one (a
        second statement, once per change of a queue's marks). ``kill_within`` (seconds)
        is stored on each claimed row: how long after a cancel the claimer's handler may
        live (:attr:`Config.kill_within`). ``start_now``: how many of the steps claimed
        can start at once (idle children; default ``limit``): no more rate-limited steps
        are claimed, since a rate limit counts handler starts (each claimed rate-limited
        row has ``rated`` true). Raises DatabaseError.
        """
        if limit <= 0 or not names:
            return ClaimResult([], None, self.marks)
        claimed: list[dict[str, Any]] = []
        while True:
            statement = self.statement("claim", queues, limit - len(claimed))
            with self.session.conn.cursor() as cur:
                cur.execute(Q[statement], {
                    "owner": owner, "names": list(names), "limit": limit - len(claimed), "ttl_us": to_us(ttl),
                    "kill_within_us": to_us(kill_within), "inline_max": INLINE_MAX,
                    "start_now": limit if start_now is None else max(0, start_now - len(claimed)),
                    **self.params(queues, statement),
                })
                rows = cur.fetchall()
            wait = self.keep_meta(next((r for r in rows if r["id"] is None), None), queues)
            claimed += [r for r in rows if r["id"] is not None]
            if len(claimed) >= limit or self.rank(self.statement("claim", queues, 1)) <= self.rank(statement):
                return ClaimResult(claimed, wait, self.marks)
