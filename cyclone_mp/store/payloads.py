"""What a claimed step reads beside its claim (``sql/payload.sql``): an input or upstream
object too big to come with the claim, the runs its upstream spawned, and a map node's
item outputs in keyset pages (SPEC section 10, ``wf.map``: :mod:`cyclone_mp.mapped`
writes them to a file for the join)."""

from __future__ import annotations

from typing import Any

from ..protocol import DEFAULT_MAX_PAYLOAD, upstream_limit
from .queries import Q
from .session import Session, translate


class Payloads:
    """Reads of a claimed step's inputs on ``session``."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @translate
    def load(self, id: int, *, statement_timeout: float | None = None,
             max_upstream: int = upstream_limit(DEFAULT_MAX_PAYLOAD)) -> dict[str, Any] | None:
        """A claimed step's ``input`` and ``upstream`` as JSON text, and ``upstream_bytes``
        and ``upstream_outputs`` (the size of its upstream object and how many outputs it
        holds); ``upstream`` is None when the step has no upstream node or when the object
        would be over ``max_upstream`` bytes (:func:`~cyclone_mp.protocol.upstream_limit`);
        ``maps``: its upstream map nodes, ``[[node, items], ...]`` or None (their outputs are
        read in pages: :meth:`map_outputs_page`); ``spawned``: for a step that waited for
        the runs its upstream spawned, those runs as JSON text (``ctx.spawned``), else None.
        None when the step is gone. ``statement_timeout`` (seconds): the statement's own,
        in place of the session's (a write's bound: building a fan-in of hundreds of
        megabytes takes longer). Raises DatabaseError."""
        with self.session.tx() as cur:
            if statement_timeout is not None:
                cur.execute(Q["local_statement_timeout"], {"timeout": f"{max(1, int(statement_timeout * 1000))}ms"})
            return self.session.one(cur, "load_payload", {"id": id, "max_upstream": max_upstream})

    @translate
    def map_outputs_page(self, run_id: str, node: str, after: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` items of map ``node`` of run ``run_id`` after item index ``after``
        (-1: from the first), in item order: ``item``, ``ok`` (completed), ``output`` (JSON
        text), ``error``, ``error_kind``. Raises DatabaseError."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["map_outputs_page"], {"run_id": run_id, "node": node, "after": after, "limit": limit})
            return cur.fetchall()
