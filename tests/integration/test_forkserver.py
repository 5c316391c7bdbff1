"""The test supervisors' fork server (cyclone_mp.testing.forkserver): a fork runs the
worker's ``main`` with the caller's environment, directory and streams, its exit code
and signals come back as Popen's would, and nothing of it is left once it is waited for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import psutil
import pytest

from cyclone_mp.testing.forkserver import ForkServer


def _start(server: ForkServer, tmp_path, module: str, **env: str):
    config = {"dsn": "dbname=unused", "steps": [{"module": module, "qualname": "step", "path": None}],
              "workflows": [], "options": {}, "ready_file": str(tmp_path / "ready"),
              "parent_pid": server.pid, "sys_path": ["."]}
    return server.start([json.dumps(config)], env={**os.environ, **env}, cwd=str(tmp_path))


@pytest.fixture
def server() -> ForkServer:
    found = ForkServer.shared()
    if found is None:
        pytest.skip("the fork server is turned off (CYCLONE_TEST_FORKSERVER=0)")
    return found


def test_a_fork_runs_in_the_callers_directory_and_environment_and_exits_with_its_code(server, tmp_path, capfd):
    # the handlers' module is found through sys_path "." (the fork's directory) and
    # reports what the fork sees before it ends the process with code 3
    (tmp_path / "fs_probe.py").write_text(textwrap.dedent("""
        import json, os, sys
        with open("seen.json", "w") as fh:
            json.dump({"cwd": os.getcwd(), "probe": os.environ.get("FS_PROBE"), "pid": os.getpid()}, fh)
        print("fs_probe says hello on stderr", file=sys.stderr, flush=True)
        raise SystemExit(3)
    """))
    proc = _start(server, tmp_path, "fs_probe", FS_PROBE="from the test")
    assert proc.wait(timeout=30) == 3 and proc.returncode == 3 and proc.poll() == 3
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"cwd": str(tmp_path), "probe": "from the test", "pid": proc.pid}
    assert "fs_probe says hello on stderr" in capfd.readouterr().err
    assert "FS_PROBE" not in os.environ  # the caller's own environment is untouched


def test_an_import_error_is_a_traceback_and_exit_code_1(server, tmp_path, capfd):
    proc = _start(server, tmp_path, "no_such_module_for_the_fork_server")
    assert proc.wait(timeout=30) == 1
    err = capfd.readouterr().err
    assert "ModuleNotFoundError" in err and "no_such_module_for_the_fork_server" in err, err


def test_signals_reach_a_fork_and_its_end_says_which(server, tmp_path):
    (tmp_path / "fs_sleeper.py").write_text("import time\ntime.sleep(60)\n")
    proc = _start(server, tmp_path, "fs_sleeper")
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    assert server.pid in [p.pid for p in psutil.Process(proc.pid).parents()]
    os.kill(proc.pid, signal.SIGSTOP)  # a frozen fork is still alive
    time.sleep(0.1)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).ppid() != server.pid  # reaped
    proc.kill()  # a second signal to a reaped fork is a no-op, never a signal to a reused pid
