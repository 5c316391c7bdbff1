"""The dashboard's pure helpers, no database: a workflow's graph layout, the throughput
chart's bars, the runs list's keyset cursor and query parameters."""

from __future__ import annotations

import pytest

from cyclone_mp.dashboard.charts import chart
from cyclone_mp.dashboard.params import BadRequest, RunQuery, decode_cursor, encode_cursor
from cyclone_mp.dashboard.views import graph_layout


def test_pure_helpers() -> None:
    layout = graph_layout([
        {"name": "a", "kind": "task", "state": "completed", "depends_on": []},
        {"name": "b", "kind": "task", "state": "running", "depends_on": ["a"]},
        {"name": "c", "kind": "signal", "state": "pending", "depends_on": ["a"]},
        {"name": "d", "kind": "task", "state": "pending", "depends_on": ["b", "c"]},
    ])
    x = {n["name"]: n["x"] for n in layout["nodes"]}
    assert x["a"] < x["b"] == x["c"] < x["d"] and len(layout["edges"]) == 4
    bars = chart([{"minute": "m", "completed": 2, "discarded": 2}, {"minute": "n", "completed": 0, "discarded": 0}])
    assert bars["max"] == 4 and bars["bars"][0]["done_h"] == bars["bars"][0]["bad_h"] > 0 == bars["bars"][1]["done_h"]
    import datetime as dt

    when = dt.datetime(2026, 11, 30, 3, 4, 5, 6, tzinfo=dt.timezone.utc)
    assert decode_cursor(encode_cursor(when, "00000000-0000-4000-8000-000000000000")) == \
        (when, "00000000-0000-4000-8000-000000000000")
    query = RunQuery.parse({"state": "running", "since": "2026-11-30 03:00", "limit": "10"})
    assert query.since == dt.datetime(2026, 11, 30, 3, tzinfo=dt.timezone.utc)  # no offset: UTC
    assert query.params() == {"state": "running", "since": "2026-11-30T03:00:00+00:00", "limit": "10"}
    with pytest.raises(BadRequest):
        RunQuery.parse({"cursor": encode_cursor(when, "x")[:-3] + "!!!"})
