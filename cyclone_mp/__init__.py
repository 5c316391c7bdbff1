"""cyclone_mp: a PostgreSQL-backed durable step engine with a multiprocess supervisor.

Public surface (SPEC section 2)::

    import cyclone_mp as cy

    @cy.step("resize", timeout=30, max_attempts=5)
    def resize(ctx: cy.Context, inp: dict) -> dict: ...

    mux = cy.Mux(); mux.register(resize)
    client = cy.Client(dsn, mux, workers=4)
    run_id = client.enqueue(resize, {"path": "a.png"})

Importing this package has no side effects. The light parts (steps, context, errors)
load eagerly so a child process starts fast; ``Client`` and the rest load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .context import Cancellation, Context
from .errors import (
    Cancelled,
    ConfigurationError,
    CycloneError,
    DatabaseError,
    InvalidTransition,
    PayloadError,
    Permanent,
    RunNotFound,
    UnknownStep,
)
from .status import RunStatus, StepStatus
from .steps import Mux, Step, step
from .workflow import Workflow

if TYPE_CHECKING:  # visible to type checkers and API docs; loaded lazily at run time
    from .client import Client, enqueue
    from .config import Config

__version__ = "0.1.0"

_LAZY = {
    "Client": ("cyclone_mp.client", "Client"),
    "enqueue": ("cyclone_mp.client", "enqueue"),
    "Config": ("cyclone_mp.config", "Config"),
}

__all__ = [
    "Cancellation", "Cancelled", "Client", "Config", "ConfigurationError", "Context", "CycloneError",
    "DatabaseError", "InvalidTransition", "Mux", "PayloadError", "Permanent", "RunNotFound", "RunStatus",
    "Step", "StepStatus", "UnknownStep", "Workflow", "enqueue", "step",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cyclone_mp' has no attribute {name!r}")
