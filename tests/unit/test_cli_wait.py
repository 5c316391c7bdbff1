"""``cyclone-mp enqueue --wait`` waits through an outage as ``client.wait`` does: a
refresh of its live view that finds the database down keeps the last status read."""

from __future__ import annotations

import types

import click
import pytest

from cyclone_mp.errors import DatabaseUnavailable, WaitTimeout
from cyclone_mp_cli import submit


class OutageClient:
    """``wait`` times out twice; ``status`` fails while the database is down (its 2nd and
    3rd calls: PgBouncer refusing logins after a restart), then says the run ended."""

    def __init__(self) -> None:
        self.status_calls = 0
        self.waits = 0

    def status(self, run_id: str) -> types.SimpleNamespace:
        self.status_calls += 1
        if self.status_calls in (2, 3):
            raise DatabaseUnavailable("server login has been failing, try again later (server_login_retry)")
        return types.SimpleNamespace(terminal=self.status_calls > 3, state="completed" if self.status_calls > 3
                                     else "running", steps={})

    def wait(self, run_id: str, timeout: float | None = None) -> types.SimpleNamespace:
        self.waits += 1
        if self.waits <= 3:
            raise WaitTimeout("not yet")
        return self.status(run_id)


def test_a_refresh_during_an_outage_keeps_waiting():
    client = OutageClient()
    status = submit._wait(client, "r1", timeout=30.0, live=False)
    assert status.terminal and client.status_calls == 4 and client.waits == 3


class DownClient(OutageClient):
    """The database is down for the first two waits too (a wait's first look fails)."""

    def wait(self, run_id: str, timeout: float | None = None) -> types.SimpleNamespace:
        self.waits += 1
        if self.waits <= 2:
            raise DatabaseUnavailable("server login has been failing, try again later (server_login_retry)")
        return super().wait(run_id, timeout)


def test_a_wait_that_finds_the_database_down_keeps_waiting_within_its_timeout(monkeypatch):
    monkeypatch.setattr(submit, "WAIT_REFRESH", 0.01)
    client = DownClient()
    assert submit._wait(client, "r1", timeout=30.0, live=False).terminal
    down = DownClient()
    down.wait = lambda run_id, timeout=None: (_ for _ in ()).throw(DatabaseUnavailable("down"))
    with pytest.raises(click.ClickException, match="r1"):  # still down at the timeout: the timeout's message
        submit._wait(down, "r1", timeout=0.1, live=False)
