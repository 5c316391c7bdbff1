"""The pytest plugin (entry point ``pytest11: cyclone_mp``): fixtures for testing steps.

Fixtures:
    cyclone_server: session-wide PostgreSQL (``CYCLONE_TEST_DSN``, else the version
        ``CYCLONE_TEST_POSTGRES`` names, else testcontainers when Docker answers, else the
        embedded server) with a migrated template. The summary at the end of the run
        names the server and its version.
    cyclone_dsn: a fresh database cloned from the template, dropped after the test.
    cyclone_env: ``Env(cyclone_dsn)`` with the defaults (process-mode supervisor).
    cyclone_env_factory: ``factory(**options) -> Env`` for other settings.
Every Env made by these fixtures is closed after the test: supervisors stopped, and
no process of theirs left behind.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest


_servers: list[str] = []  # what each session's server was, for the summary


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the PostgreSQL the tests ran on (CI runs the suite on several versions)."""
    for line in _servers:
        terminalreporter.write_line(f"cyclone_mp tests ran on {line}")


@pytest.fixture(scope="session")
def cyclone_server() -> Iterator[Any]:
    """The session's test PostgreSQL server (see module docstring)."""
    from .database import TestServer  # lazy: pytest loads the plugin everywhere; servers only when used

    server = TestServer()
    _servers.append(server.describe())
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def cyclone_dsn(cyclone_server: Any) -> Iterator[str]:
    """DSN of a fresh, migrated database for this test only."""
    dsn = cyclone_server.new_database()
    try:
        yield dsn
    finally:
        cyclone_server.release(dsn)  # dropped in the background


@pytest.fixture
def cyclone_env_factory(cyclone_dsn: str) -> Iterator[Callable[..., Any]]:
    """``factory(**options) -> Env``; every Env shares this test's database."""
    from .env import Env  # lazy: as TestServer

    made: list[Env] = []

    def factory(**options: Any) -> Env:
        env = Env(cyclone_dsn, **options)
        made.append(env)
        return env

    try:
        yield factory
    finally:
        for env in reversed(made):
            env.close()


@pytest.fixture
def cyclone_env(cyclone_env_factory: Callable[..., Any]) -> Any:
    """An :class:`~cyclone_mp.testing.Env` with default options."""
    return cyclone_env_factory()
