"""Shared test setup: bytecode written once for the processes the tests start, and every
test must leave no child, grandchild or zombie behind (the supervisors' fork server, started
first, is the session's)."""

from __future__ import annotations

import compileall
import pathlib
import time

import psutil
import pytest

from cyclone_mp.testing.forkserver import ForkServer

REPO = pathlib.Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Write the bytecode of the package, the CLI and the tests' modules once, as pip does
    for an installed package. Where PYTHONDONTWRITEBYTECODE is set (this machine sets it)
    no import writes it, so every CLI, supervisor and child process the tests start would
    compile them again: 0.46 s instead of 0.63 s to import the CLI here. Up-to-date files
    are left as they are."""
    for name in ("cyclone_mp", "cli", "tests"):
        if (REPO / name).is_dir():
            compileall.compile_dir(str(REPO / name), quiet=2)
    ForkServer.shared()  # before any test: the supervisors' fork server is no test's leftover


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Fail a test that leaves a live or zombie descendant of the test process."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        zombies = [p for p in left if _status(p) == psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p.pid, _cmd(p)) for p in left]} (zombies: {[p.pid for p in zombies]})"


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.Error:
        return "gone"


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return "?"


@pytest.fixture(params=["Client", "AsyncClient"])
def client_kind(request):
    """``"Client"``, then ``"AsyncClient"``: a test that takes it runs once with each client."""
    return request.param


@pytest.fixture
def api_env(client_kind, cyclone_env_factory):
    """An Env whose client calls go through ``cy.Client`` or, in the second run of the
    test, ``cy.AsyncClient`` (issue 24: one behavioural test for both clients)."""
    from clients import use_async_client

    env = cyclone_env_factory()
    if client_kind == "AsyncClient":
        use_async_client(env)
    return env
