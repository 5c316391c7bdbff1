"""cyclone_mp: a PostgreSQL-backed durable step engine with a multiprocess supervisor.

Public surface (SPEC section 2)::

    import cyclone_mp as cy

    @cy.step("resize", timeout=30, max_attempts=5)
    def resize(ctx: cy.Context, inp: dict) -> dict: ...

    mux = cy.Mux(); mux.register(resize)
    client = cy.Client(dsn, mux, workers=4)
    run_id = client.enqueue(resize, {"path": "a.png"})

Importing this package has no side effects, and every public name loads on first use,
so a child process starts fast.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: a child starts faster

if TYPE_CHECKING:  # visible to type checkers and API docs; loaded lazily at run time
    from typing import Any

    from .async_client import AsyncClient
    from .client import Client, enqueue
    from .config import Config
    from .context import Cancellation, Context
    from .errors import (
        Cancelled,
        ConfigurationError,
        CycloneError,
        DatabaseError,
        DatabaseUnavailable,
        InvalidTransition,
        PayloadError,
        Permanent,
        QueryRejected,
        RunCancelled,
        RunFailed,
        RunNotFound,
        Snooze,
        UnknownStep,
        UnsupportedServer,
        WaitTimeout,
    )
    from .mapped import ItemFailed
    from .schedules import Schedule
    from .status import RunStatus, StepStatus
    from .mux import Mux
    from .steps import Step, Unique, step
    from .workflow import Workflow

__version__ = "0.1.0"

# Every public name loads on first use, so a child process (which imports this package
# before its runner) starts without paying for what it does not need.
_LAZY = {
    "Client": "client", "enqueue": "client", "AsyncClient": "async_client", "Config": "config",
    "Cancellation": "context", "Context": "context",
    "Cancelled": "errors", "ConfigurationError": "errors", "CycloneError": "errors",
    "DatabaseError": "errors", "DatabaseUnavailable": "errors", "InvalidTransition": "errors",
    "PayloadError": "errors", "Permanent": "errors", "QueryRejected": "errors", "RunNotFound": "errors", "UnknownStep": "errors",
    "RunFailed": "errors", "RunCancelled": "errors", "Snooze": "errors", "UnsupportedServer": "errors", "WaitTimeout": "errors",
    "RunStatus": "status", "StepStatus": "status", "Schedule": "schedules",
    "Mux": "mux", "Step": "steps", "step": "steps", "Unique": "steps",
    "Workflow": "workflow", "ItemFailed": "mapped",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cyclone_mp' has no attribute {name!r}")

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
