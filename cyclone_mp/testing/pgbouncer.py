"""A PgBouncer of a test's own, in transaction mode, in front of the test server.

:class:`PgBouncer` writes an ini file, runs ``pgbouncer`` as a subprocess listening on a
free port of 127.0.0.1, and ends it by its pid. Every database of the upstream server is
reachable through it under its own name (a ``*`` fallback entry), so the per-test
databases of :mod:`cyclone_mp.testing.database` work as they are.

:func:`find_pgbouncer` locates a binary: ``$CYCLONE_PGBOUNCER``, then Debian's
``/usr/sbin/pgbouncer`` (``apt-get install pgbouncer``), then ``pgbouncer`` on the PATH,
then a build under :data:`LOCAL_BUILDS` (``.ci/pgbouncer`` builds Debian 13's source
package there when the installed one is too old for ``max_prepared_statements``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from ..embedded_host import SERVER_USER, server_user

ENV_BINARY = "CYCLONE_PGBOUNCER"  #: a pgbouncer binary to use before any other
LOCAL_BUILDS = "/usr/local/pgbouncer-*/bin/pgbouncer"  #: where .ci/pgbouncer puts a newer build
PREPARED_SINCE = (1, 21)  #: the first PgBouncer with ``max_prepared_statements``


class PgBouncerMissing(RuntimeError):
    """No PgBouncer binary (of the version asked for) is installed; the message says how to get one."""


def version_of(binary: str) -> tuple[int, int, int]:
    """The version of a ``pgbouncer`` binary, e.g. ``(1, 18, 0)`` (``(0, 0, 0)`` if unreadable)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        match = re.search(r"PgBouncer (\d+)\.(\d+)\.(\d+)", out)
        if match:
            return (int(match[1]), int(match[2]), int(match[3]))
    return (0, 0, 0)


def candidates() -> list[str]:
    """Every pgbouncer binary found, in the order of preference (see the module docstring)."""
    found = [os.environ.get(ENV_BINARY, ""), "/usr/sbin/pgbouncer", shutil.which("pgbouncer") or "",
             *sorted(glob.glob(LOCAL_BUILDS), reverse=True)]
    seen: list[str] = []
    for path in found:
        if path and os.access(path, os.X_OK) and os.path.realpath(path) not in map(os.path.realpath, seen):
            seen.append(path)
    return seen


def find_pgbouncer(min_version: tuple[int, ...] = (1, 0)) -> str:
    """The first binary of :func:`candidates` at least ``min_version``.

    Raises:
        PgBouncerMissing: none is installed, or none is that new.
    """
    found = candidates()
    for path in found:
        if version_of(path) >= tuple(min_version):
            return path
    want = ".".join(map(str, min_version))
    if not found:
        raise PgBouncerMissing("pgbouncer is not installed (apt-get install pgbouncer; .ci/pgbouncer does it)")
    raise PgBouncerMissing(f"no pgbouncer >= {want} is installed (found {', '.join(found)}); "
                           f"bash .ci/pgbouncer builds Debian 13's package into /usr/local")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """One PgBouncer process in front of the server of ``upstream_dsn``.

    Args:
        upstream_dsn: a DSN of the server (its host, port, user and password are used).
        pool_mode: ``"transaction"`` (the point of this class), ``"session"`` or ``"statement"``.
        max_prepared_statements: PgBouncer's setting (0: off; above 0 needs PgBouncer >= 1.21).
        pool_size: server connections per (database, user): fewer than the clients, so
            clients really share server connections.
        binary: the pgbouncer to run (default: :func:`find_pgbouncer` of a version that
            supports ``max_prepared_statements`` when it is asked for).

    Raises:
        PgBouncerMissing: no suitable binary.
        RuntimeError: it did not start (the message has its log's tail).
    """

    def __init__(self, upstream_dsn: str, *, pool_mode: str = "transaction", max_prepared_statements: int = 0,
                 pool_size: int = 4, binary: str | None = None) -> None:
        self.binary = binary or find_pgbouncer(PREPARED_SINCE if max_prepared_statements else (1, 0))
        self.version = version_of(self.binary)
        self.upstream_dsn = upstream_dsn
        self.max_prepared_statements = max_prepared_statements
        self.upstream = conninfo_to_dict(upstream_dsn)
        self.port = free_port()
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="cyclone-pgbouncer-"))
        self.log = self.dir / "pgbouncer.log"
        self.proc: subprocess.Popen[bytes] | None = None
        user = str(self.upstream.get("user") or "postgres")
        host = str(self.upstream.get("host") or "/var/run/postgresql").split(",")[0]
        port = str(self.upstream.get("port") or 5432).split(",")[0]
        target = {"host": host, "port": port, "user": user}
        if self.upstream.get("password"):
            target["password"] = str(self.upstream["password"])
        settings = {
            "listen_addr": "127.0.0.1", "listen_port": str(self.port), "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": str(self.dir / "userlist.txt"),
            "pool_mode": pool_mode, "default_pool_size": str(pool_size), "max_client_conn": "500",
            "logfile": str(self.log), "pidfile": str(self.dir / "pgbouncer.pid"), "admin_users": user,
            "server_check_delay": "0", "server_login_retry": "0.2", "server_connect_timeout": "3",
            "ignore_startup_parameters": "extra_float_digits",
        }
        if max_prepared_statements:
            settings["max_prepared_statements"] = str(max_prepared_statements)
        entry = " ".join(f"{k}={_quote(v)}" for k, v in target.items())
        ini = "[databases]\n* = " + entry + "\n\n[pgbouncer]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())
        (self.dir / "pgbouncer.ini").write_text(ini)
        (self.dir / "userlist.txt").write_text(f'"{user}" ""\n')
        self.user = user
        self._start()

    def _start(self) -> None:
        args = [self.binary, "-q", str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer refuses root: run it as the embedded server's user
            account = server_user()
            os.chown(self.dir, account.pw_uid, account.pw_gid)
            for path in self.dir.iterdir():
                os.chown(path, account.pw_uid, account.pw_gid)
            args[1:1] = ["-u", SERVER_USER]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with code {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"pgbouncer did not listen within 15 s: {self.log_tail()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int | None:
        """PgBouncer's pid while it runs, else None."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def dsn(self, upstream_dsn: str) -> str:
        """``upstream_dsn`` (a database of the same server) reached through this PgBouncer."""
        params: dict[str, Any] = conninfo_to_dict(upstream_dsn)
        for key in ("host", "hostaddr", "port", "target_session_attrs", "password"):
            params.pop(key, None)
        params.update(host="127.0.0.1", port=str(self.port), user=self.user)
        return make_conninfo(**params)

    def admin_dsn(self) -> str:
        """The admin console (``SHOW POOLS``, ``SHOW SERVERS``, ...)."""
        return make_conninfo(host="127.0.0.1", port=str(self.port), user=self.user, dbname="pgbouncer")

    def show(self, what: str) -> list[dict[str, Any]]:
        """Rows of ``SHOW <what>`` on the admin console (``what`` is a word: POOLS, SERVERS, ...)."""
        if not what.isalpha():
            raise ValueError(f"not a SHOW command: {what!r}")
        with psycopg.connect(self.admin_dsn(), autocommit=True, prepare_threshold=None,
                             row_factory=dict_row) as conn:
            with conn.cursor() as cur:
                cur.execute(f"SHOW {what}", prepare=False)  # the console speaks the simple protocol only
                return cur.fetchall()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of PgBouncer's log."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def close(self) -> None:
        """End PgBouncer (SIGTERM to its pid, SIGKILL 5 s later) and remove its files."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PgBouncer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quote(value: str) -> str:
    """A libpq connection-string value, quoted when it needs it."""
    if value and not re.search(r"[\s'\\]", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
