"""The named SQL as loaded from ``cyclone_mp/sql/*.sql``: a name is defined once across the
files, and the claim and settle statements, each written out whole, agree on the parts
they share (a fix made in one copy and not the others fails here)."""

from __future__ import annotations

import re

import pytest

from cyclone_mp.store import Claims, Q
from cyclone_mp.store.queries import parse_queries

#: Every claim and settle statement: the three families times the four claims.
FAMILIES = {family + suffix: family for family in ("claim", "settle", "settle_completions") for suffix in Claims.CLAIMS}
HEARTS = list(FAMILIES)

#: How many different texts each common table expression has across HEARTS: one, unless
#: the kind of claim makes it differ (the plain claim has no walk, the fair one no slots,
#: the concurrency one no rate slots; "finished" differs with and without failures).
VARIANTS = {
    "walk": 1, "cand": 1, "ranked": 1, "cslots": 1, "rslots": 1, "allowed": 1, "claimed": 1,
    "runs": 1, "done": 1, "items_done": 1, "completed_runs": 1, "fail_in": 1, "judged": 1, "ended": 1,
    "discarded_runs": 1, "settled_completed": 1, "settled_claimed": 1,
    "picked": 2, "grp": 2, "took_slots": 2, "claim_wait": 2, "claim_meta": 2, "eligible": 3, "finished": 3,
}


def ctes(sql: str) -> tuple[dict[str, str], str]:
    """The top-level common table expressions of a ``WITH`` statement, ``{name: body}``,
    and the statement after them."""
    at = re.match(r"WITH(?: RECURSIVE)?\s+", sql).end()
    found: dict[str, str] = {}
    head = re.compile(r"(\w+)\s*(?:\([^)]*\))?\s*AS\s*(?:MATERIALIZED\s*)?\(")
    while (match := head.match(sql, at)) is not None:
        depth, end, quoted = 1, match.end(), False
        while depth:
            char = sql[end]
            if char == "'":
                quoted = not quoted
            elif not quoted:
                depth += {"(": 1, ")": -1}.get(char, 0)
            end += 1
        found[match[1]] = sql[match.end():end - 1]
        comma = re.compile(r"\s*,\s*").match(sql, end)
        at = comma.end() if comma else end
    return found, sql[at:].strip()


def test_the_claim_and_settle_statements_agree_on_what_they_share():
    bodies: dict[str, set[str]] = {}
    tails: dict[str, set[str]] = {}
    for name in HEARTS:
        parts, tail = ctes(Q[name])
        assert tail.startswith("SELECT"), name  # every CTE was read
        for cte, body in parts.items():
            bodies.setdefault(cte, set()).add(body)
        tails.setdefault(FAMILIES[name], set()).add(tail)
    assert {cte: len(texts) for cte, texts in bodies.items()} == VARIANTS
    assert {family: len(texts) for family, texts in tails.items()} == {"claim": 1, "settle": 1, "settle_completions": 1}


def test_the_heart_statements_cite_no_fragment():
    from importlib.resources import files

    for name in ("claim.sql", "settle.sql", "sweep.sql"):
        text = files("cyclone_mp.sql").joinpath(name).read_text()
        assert not re.findall(r"\{\w+_(?:ctes|expr)\}", text), name


def test_a_name_defined_twice_across_files_is_refused():
    assert parse_queries([("a.sql", "-- name: one\nSELECT 1;\n"), ("b.sql", "-- name: two\nSELECT 2;\n")]) == {
        "one": "SELECT 1", "two": "SELECT 2"}
    with pytest.raises(RuntimeError, match=r"sql/b.sql: 'one' is already defined in sql/a.sql"):
        parse_queries([("a.sql", "-- name: one\nSELECT 1;\n"), ("b.sql", "-- name: one\nSELECT 2;\n")])
    with pytest.raises(RuntimeError, match="unknown"):
        parse_queries([("a.sql", "-- name: one\nSELECT {nothing_expr};\n")])
