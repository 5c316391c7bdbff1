"""What the dashboard's tests share (``tests/acceptance/test_dashboard_*.py``): the
repository, the test client's base URL, SQL on a test database, and the real
``cyclone-mp dashboard`` run as a subprocess."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any, Iterator

import pytest

from cyclone_mp.store import connect

from waiting import wait_for

REPO = pathlib.Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1"


def sql(dsn: str, query: str, *args: Any) -> list[dict[str, Any]]:
    with connect(dsn) as conn:
        return conn.execute(query, args).fetchall()


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CYCLONE_DSN", "CYCLONE_DASHBOARD_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.update(extra)
    return env


@contextlib.contextmanager
def dashboard_process(dsn: str, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``cyclone-mp --dsn DSN dashboard --port 0 ARGS`` as a subprocess; yields its URL."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", dsn, "dashboard",
                                 "--port", "0", *args], cwd=REPO, env=env or _cli_env(), stdout=subprocess.DEVNULL,
                                stderr=err, stdin=subprocess.DEVNULL, text=True)
        try:
            def url() -> str | None:
                err.seek(0)
                match = re.search(r"cyclone-mp dashboard: (http://\S+)", err.read())
                if proc.poll() is not None:
                    err.seek(0)
                    pytest.fail(f"the dashboard exited with {proc.returncode}: {err.read()}")
                return match.group(1) if match else None

            yield wait_for(url, 30, "the dashboard to listen")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
