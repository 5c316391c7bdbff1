"""The supervisor's reads of map nodes (SPEC section 10, ``wf.map``): a join's upstream
outputs, read in keyset pages (:mod:`cyclone_mp.mapped` writes them to a file)."""

from __future__ import annotations

from typing import Any

import psycopg

from .base import translate
from .queries import Q


class MapQueries:
    """Reads of a map's items (a part of :class:`~cyclone_mp.store.Store`)."""

    conn: psycopg.Connection

    @translate
    def map_outputs_page(self, run_id: str, node: str, after: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` items of map ``node`` of run ``run_id`` after item index ``after``
        (-1: from the first), in item order: ``item``, ``ok`` (completed), ``output`` (JSON
        text), ``error``, ``error_kind`` (``map_outputs_page``)."""
        with self.conn.cursor() as cur:
            cur.execute(Q["map_outputs_page"], {"run_id": run_id, "node": node, "after": after, "limit": limit})
            return cur.fetchall()
