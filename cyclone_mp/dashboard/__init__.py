"""The operator dashboard: ``cyclone-mp dashboard``, or ``create_app(client)``.

Needs the ``dashboard`` extra (Starlette, Jinja2, uvicorn, PyYAML). Pages: the overview,
the runs list, a run's detail, and confirmed operator actions; the JSON API behind them
is under ``/api/`` (OpenAPI at ``/api/openapi.json``). Bound to loopback unless a token
guards it.
"""

from __future__ import annotations

from .app import create_app
from .server import check_bind, serve

__all__ = ["create_app", "serve", "check_bind"]
