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


# -- the test process's side against a scripted server -------------------------------------------------


class ScriptedServer:
    """A ForkServer whose server end is this test's socket: what the real server would
    send is written by hand."""

    def __init__(self) -> None:
        import socket

        self.client = ForkServer.__new__(ForkServer)
        ours, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.client.owner, self.client.pid = os.getpid(), -1
        self.client._attach(ours)

    def send(self, **message) -> None:
        self.peer.send(json.dumps(message).encode())

    def request(self) -> dict:
        import socket

        data, fds, _, _ = socket.recv_fds(self.peer, 1 << 20, 2)
        for fd in fds:
            os.close(fd)
        return json.loads(data)


def _settle(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_new_fork_with_a_reaped_forks_pid_is_not_taken_for_ended():
    s = ScriptedServer()
    s.send(exit=4242, code=3)  # an earlier fork of pid 4242 ended...
    _settle(lambda: s.client.exit_code(4242) == 3)
    s.send(seq=7, pid=4242)  # ...and a new one got its pid
    _settle(lambda: s.client.exit_code(4242) is None)
    assert s.client.exit_code(4242) is None and s.client.wait_exit(4242, 0.1) is None


def test_a_late_reply_is_never_taken_for_the_next_request_and_its_fork_is_killed(tmp_path):
    import threading

    s = ScriptedServer()
    orphan = subprocess.Popen(["sleep", "60"])  # stands for the fork of a request given up on
    try:
        s.send(seq=0, pid=orphan.pid)  # the late answer to an earlier request
        answered = {}

        def serve() -> None:
            answered["request"] = s.request()
            s.send(seq=answered["request"]["seq"], pid=999999)

        threading.Thread(target=serve, daemon=True).start()
        proc = s.client.start(["{}"], env={}, cwd=str(tmp_path))
        assert proc.pid == 999999 and answered["request"]["seq"] == 1
        assert orphan.wait(timeout=5) == -signal.SIGKILL
    finally:
        orphan.kill()
        orphan.wait()


def test_when_the_server_is_gone_its_forks_read_as_killed_and_nothing_waits_forever():
    s = ScriptedServer()
    s.send(seq=1, pid=5151)
    s.peer.close()  # the server ended: its forks died with it (PR_SET_PDEATHSIG)
    _settle(lambda: s.client.ended)
    assert s.client.ended
    started = time.monotonic()
    assert s.client.wait_exit(5151, None) == -signal.SIGKILL and s.client.exit_code(5151) == -signal.SIGKILL
    assert time.monotonic() - started < 1.0
