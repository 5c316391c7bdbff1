"""Test helpers for cyclone_mp users: the Python counterpart of the seed's ``cyclonetest``.

Installing cyclone_mp registers the pytest plugin :mod:`cyclone_mp.testing.plugin` by
entry point, which provides the ``cyclone_env`` and ``cyclone_env_factory`` fixtures
(and ``cyclone_dsn``, a fresh migrated database per test). See :class:`Env` for the
crash-simulation helpers.
"""

from __future__ import annotations

from .env import Env, WorkerHandle

__all__ = ["Env", "WorkerHandle"]
