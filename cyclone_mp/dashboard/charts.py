"""The dashboard's charts: per-minute rows turned into SVG bar geometry and the text of
each bar's tooltip (throughput, pick-up latency, kills by trigger). Pure functions of
rows, tested without a database; every time is the database's.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable, Sequence


def iso(value: dt.datetime | None) -> str | None:
    """An aware datetime as ISO 8601 in UTC (``...+00:00``), or None."""
    return None if value is None else value.astimezone(dt.timezone.utc).isoformat()


def throughput(rows: Sequence[dict[str, Any]], minutes: int) -> dict[str, Any]:
    """``dash_throughput`` rows -> the chart's data (oldest minute first)."""
    per_minute = [{"minute": iso(r["minute"]), "completed": int(r["completed"]), "discarded": int(r["discarded"])}
                  for r in rows]
    return {
        "minutes": minutes,
        "per_minute": per_minute,
        "completed": sum(p["completed"] for p in per_minute),
        "discarded": sum(p["discarded"] for p in per_minute),
        "max": max((p["completed"] + p["discarded"] for p in per_minute), default=0),
    }


def chart(per_minute: Sequence[dict[str, Any]], width: int = 600, height: int = 120) -> dict[str, Any]:
    """Bar geometry of the throughput chart (the SVG the page starts with; the page's
    script redraws it the same way on every refresh)."""
    n = max(1, len(per_minute))
    top = max((p["completed"] + p["discarded"] for p in per_minute), default=0)
    scale = (height - 4) / top if top else 0.0
    slot = width / n
    bars = []
    for i, p in enumerate(per_minute):
        done_h = round(p["completed"] * scale, 2)
        bad_h = round(p["discarded"] * scale, 2)
        x = round(i * slot + 1, 2)
        w = round(max(1.0, slot - 2), 2)
        bars.append({"x": x, "w": w, "done_y": round(height - done_h, 2), "done_h": done_h,
                     "bad_y": round(height - done_h - bad_h, 2), "bad_h": bad_h,
                     "title": f"{p['minute']}: {p['completed']} completed, {p['discarded']} discarded"})
    return {"width": width, "height": height, "max": top, "bars": bars}


def _bars(per_minute: Sequence[dict[str, Any]], parts: Callable[[dict[str, Any]], list[tuple[str, float, bool]]],
          title: Callable[[dict[str, Any]], str], width: int = 600, height: int = 90) -> dict[str, Any]:
    """Bar geometry, one bar per minute: ``parts(p)`` gives ``(css class, value, stacked)``
    segments (a stacked one sits on the one before, else it starts at the axis); the page
    draws what the API returns (dashboard.js ``bars``), so the geometry lives here only."""
    n = max(1, len(per_minute))
    tops = []
    for p in per_minute:
        stack = 0.0
        top = 0.0
        for _, value, stacked in parts(p):
            stack = stack + value if stacked else value
            top = max(top, stack)
        tops.append(top)
    top = max(tops, default=0.0)
    scale = (height - 4) / top if top else 0.0
    slot = width / n
    bars = []
    for i, p in enumerate(per_minute):
        base = 0.0
        segments = []
        for cls, value, stacked in parts(p):
            bottom = base if stacked else 0.0
            h = round(value * scale, 2)
            segments.append({"cls": cls, "y": round(height - (bottom + value) * scale, 2), "h": h})
            base = bottom + value
        bars.append({"x": round(i * slot + 1, 2), "w": round(max(1.0, slot - 2), 2), "title": title(p),
                     "segments": segments})
    return {"width": width, "height": height, "max": top, "bars": bars}


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def pickup(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``dash_pickup`` rows -> the pickup latency chart (per minute: p95 behind p50)."""
    per_minute = [{"minute": iso(r["minute"]), "n": int(r["n"]), "p50": r["p50"], "p95": r["p95"]} for r in rows]
    return {
        "minutes": len(per_minute), "per_minute": per_minute, "steps": sum(p["n"] for p in per_minute),
        "worst_p95": max((p["p95"] for p in per_minute if p["p95"] is not None), default=None),
        "chart": _bars(per_minute, lambda p: [("bar-p95", p["p95"] or 0.0, False), ("bar-p50", p["p50"] or 0.0, False)],
                       lambda p: f"{p['minute']}: {p['n']} steps, p50 {_secs(p['p50'])}, p95 {_secs(p['p95'])}"),
    }


def kills_by_trigger(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``dash_kills_by_trigger`` rows -> per minute kills stacked by trigger, and the totals."""
    per_minute = [{"minute": iso(r["minute"]), "triggers": {k: int(v) for k, v in (r["triggers"] or {}).items()}}
                  for r in rows]
    totals: dict[str, int] = {}
    for p in per_minute:
        for trigger, n in p["triggers"].items():
            totals[trigger] = totals.get(trigger, 0) + n
    order = sorted(totals, key=lambda t: (-totals[t], t))
    classes = {trigger: f"trig-{i % 6}" for i, trigger in enumerate(order)}
    return {
        "minutes": len(per_minute), "per_minute": per_minute, "total": sum(totals.values()),
        "by_trigger": [{"trigger": t, "n": totals[t], "cls": classes[t]} for t in order],
        "chart": _bars(per_minute, lambda p: [(classes[t], float(p["triggers"].get(t, 0)), True) for t in order],
                       lambda p: p["minute"] + ": " + (", ".join(f"{n} {t}" for t, n in sorted(p["triggers"].items()))
                                                       or "no kills")),
    }
