"""The real ``cyclone-mp dashboard`` command, run as a subprocess: it refuses a
non-loopback bind without a token, and with a token answers 401 without it; Ctrl-C stops
it quietly with exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import pytest

from dashboard_support import REPO, _cli_env, dashboard_process
from waiting import wait_for


# -- the real CLI ----------------------------------------------------------------------------------


def test_cli_refuses_a_public_bind_without_a_token_and_guards_with_one(cyclone_dsn: str) -> None:
    for host in ("0.0.0.0", "::", "192.0.2.10"):
        proc = subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", "postgresql://nobody@127.0.0.1:1/x",
                               "dashboard", "--host", host], cwd=REPO, env=_cli_env(), capture_output=True, text=True,
                              timeout=60)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and lines[0].startswith("Error: refusing to serve the dashboard on") and "--token" in lines[0]
    with dashboard_process(cyclone_dsn, env=_cli_env(CYCLONE_DASHBOARD_TOKEN="tok-from-env-123")) as url:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(url + "api/overview", timeout=10)
        assert info.value.code == 401
        request = urllib.request.Request(url + "api/overview", headers={"Authorization": "Bearer tok-from-env-123"})
        with opener.open(request, timeout=10) as response:
            assert json.loads(response.read())["runs"]["total"] == 0


def test_ctrl_c_stops_the_dashboard_quietly_with_exit_0(cyclone_dsn: str) -> None:
    """Ctrl-C is how a dashboard stops: one line, exit 0, no "Error:" (a newcomer's report)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", cyclone_dsn, "dashboard",
                                 "--port", "0"], cwd=REPO, env=_cli_env(), stdout=subprocess.DEVNULL, stderr=err,
                                stdin=subprocess.DEVNULL, text=True)
        try:
            def listening() -> bool:
                err.seek(0)
                return "cyclone-mp dashboard: http://" in err.read()

            wait_for(listening, 30, "the dashboard to listen")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=15) == 0
            err.seek(0)
            text = err.read()
            assert "cyclone-mp dashboard: stopped" in text and "Error" not in text and "Traceback" not in text, text
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
