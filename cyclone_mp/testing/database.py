"""The PostgreSQL that tests run against, and one fresh database per test (SPEC section 7).

Chosen in this order: ``CYCLONE_TEST_DSN``; the PostgreSQL that ``CYCLONE_TEST_POSTGRES``
names (a major version or a directory of binaries, :mod:`cyclone_mp.testing.servers`),
started on a temporary data directory, or where no such binaries exist and a Docker engine
answers, testcontainers' image of that version; testcontainers' PostgreSQL when a Docker
engine answers; otherwise the embedded server on a temporary data directory (removed at
the end of the session). :attr:`TestServer.version` says which version it is (pytest's
header shows it). A migrated template database is cloned for every test
(``CREATE DATABASE ... TEMPLATE``), so tests are isolated and child processes see
committed rows (STYLE pattern 10). A clone takes 0.2-0.4 s on a 2-core VM, a third of
what a short test takes, so :data:`SPARE_DATABASES` clones are made ahead by a
background thread while tests run, and a test takes one that is ready; the same thread
drops a finished test's database (:meth:`TestServer.release`, 0.1 s each).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import queue
import tempfile
import threading
import time
import uuid
from typing import Any, Iterator

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from ..embedded import EmbeddedServer
from ..store import Store, redact
from . import servers
from .servers import ENV_POSTGRES

log = logging.getLogger("cyclone_mp.testing")

ENV_DSN = "CYCLONE_TEST_DSN"
SPARE_DATABASES = 2  #: clones of the template kept ready for the next tests
POSTGRES_IMAGE = "postgres:16-alpine"
RESTART_TIMEOUT = 180.0  #: seconds a restarted test server may take to recover and accept connections


def docker_available(timeout: float = 2.0) -> bool:
    """True when a Docker engine answers a ping (fast False when there is no socket)."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker  # lazy: testcontainers' dependency, present only where it is installed

        client = docker.from_env(timeout=int(max(1, timeout)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False


class TestServer:
    """One PostgreSQL server for the session and a migrated template on it.

    Attributes:
        admin_dsn: DSN of a maintenance database on the server.
        source: ``"env"``, ``"testcontainers"``, ``"embedded"`` or ``"binaries"`` (the
            server of ``CYCLONE_TEST_POSTGRES``, started from its binaries).
        version: the server's ``server_version`` (e.g. ``"15.18 (Debian 15.18-0+deb12u1)"``).
        version_num: its ``server_version_num`` (e.g. ``150018``).
    """

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self._container: Any = None
        self._embedded: Any = None
        self._tmpdir: str | None = None
        env_dsn = os.environ.get(ENV_DSN)
        wanted = os.environ.get(ENV_POSTGRES, "").strip()
        if env_dsn:
            self.admin_dsn, self.source = env_dsn, "env"
        elif wanted:
            try:
                bin_dir = servers.find(wanted)
            except servers.ServerNotFound:
                if not (wanted.isdigit() and docker_available()):
                    raise
                self._start_container(f"postgres:{wanted}-alpine")
            else:
                self._start_local(bin_dir)
        elif docker_available():
            self._start_container(POSTGRES_IMAGE)
        else:
            self._start_local(None)
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            self.version = str(conn.execute("SHOW server_version").fetchone()[0])
            self.version_num = int(conn.info.server_version)
        self._spares: queue.SimpleQueue[str] = queue.SimpleQueue()  # clones made ahead, oldest first
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()  # DSNs of finished tests' databases, to drop
        self._filler: threading.Thread | None = None
        self._filling = threading.Event()  # set: the filler may make more (cleared around a restart and at close)
        self._filling.set()
        self.template = f"cyclone_tpl_{uuid.uuid4().hex[:10]}"
        self._create(self.template, template=None)
        store = Store.open(self.dsn_for(self.template))
        try:
            store.migrate()
        finally:
            store.close()
        log.info("test database server: %s (%s)", self.source, redact(self.admin_dsn))

    def _start_container(self, image: str) -> None:
        from testcontainers.postgres import PostgresContainer  # lazy: used only where Docker answers

        self._container = PostgresContainer(image, driver=None)
        self._container.start()
        self.admin_dsn, self.source = self._container.get_connection_url(), "testcontainers"

    def _start_local(self, bin_dir: Any) -> None:
        """The embedded server (``bin_dir`` None) or the one of ``bin_dir``, on a temporary
        data directory."""
        self._tmpdir = tempfile.mkdtemp(prefix="cyclone-mp-test-")
        os.chmod(self._tmpdir, 0o755)  # the server runs as its own user when we are root
        self._embedded = EmbeddedServer(os.path.join(self._tmpdir, "pgdata"), bin_dir=bin_dir)
        self.admin_dsn = self._embedded.start()
        self.source = "embedded" if bin_dir is None else "binaries"

    def describe(self) -> str:
        """One line: which server the tests run on."""
        where = {"env": f"{ENV_DSN}", "testcontainers": "testcontainers", "embedded": "the embedded server",
                 "binaries": f"{self._embedded.binaries() if self._embedded else '?'}"}[self.source]
        return f"PostgreSQL {self.version} ({where})"

    @property
    def restartable(self) -> bool:
        """True when this object runs the server itself (embedded), so tests may restart it."""
        return self._embedded is not None

    def checkpoint(self) -> None:
        """Make the server write a checkpoint now. A test that will :meth:`restart` the
        server calls it before its timed part: the crash's recovery then replays only what
        was written since. The suite writes much WAL (each test's database is a WAL-logged
        copy of the template), and replaying up to ``max_wal_size`` of it on a loaded
        machine took over a minute, during which the tests after found it starting up."""
        with self.quiet(), psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute("CHECKPOINT")  # after the copy or drop in the background: none is replayed

    def restart(self, down_for: float = 2.0) -> None:
        """Crash-stop the server (``immediate``), wait ``down_for`` seconds, start it again,
        waiting up to RESTART_TIMEOUT seconds for its recovery (see :meth:`checkpoint`).

        Raises:
            RuntimeError: the server is not one this object started.
        """
        if self._embedded is None:
            raise RuntimeError("only an embedded test server can be restarted")
        with self.quiet():
            self._embedded.stop(mode="immediate")
            time.sleep(down_for)
            self._embedded.start(timeout=RESTART_TIMEOUT)

    def dsn_for(self, dbname: str) -> str:
        """The server's DSN pointed at ``dbname``."""
        return make_conninfo(self.admin_dsn, dbname=dbname)

    def _create(self, name: str, template: str | None) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
            if template:
                query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
            conn.execute(query)

    def new_database(self) -> str:
        """A fresh clone of the migrated template, made ahead when one is ready (then
        another is started in the background); returns its DSN."""
        try:
            name = self._spares.get_nowait()
        except queue.Empty:
            name = f"cyclone_t_{uuid.uuid4().hex[:12]}"
            self._create(name, template=self.template)
        self._fill()
        return self.dsn_for(name)

    def release(self, dsn: str) -> None:
        """A test is done with the database of ``dsn`` (from :meth:`new_database`): it is
        dropped in the background (or at :meth:`close`)."""
        self._released.put(dsn)
        self._fill()

    def _fill(self) -> None:
        """Start the background filler unless it runs (it drops released databases and
        makes clones until :data:`SPARE_DATABASES` are ready)."""
        if self._filler is not None and self._filler.is_alive():
            return
        self._filler = threading.Thread(target=self._background, name="cyclone-test-databases", daemon=True)
        self._filler.start()

    def _background(self) -> None:
        """Drop the released databases, then make clones until enough are ready."""
        while self._filling.is_set() and not self._released.empty():
            self.drop_database(self._released.get_nowait())
        while self._filling.is_set() and self._spares.qsize() < SPARE_DATABASES:
            name = f"cyclone_t_{uuid.uuid4().hex[:12]}"
            try:
                self._create(name, template=self.template)
            except psycopg.Error as exc:  # the server restarts, or stops: the next test makes its own
                log.debug("no spare test database now (%s)", exc)
                return
            self._spares.put(name)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Make no database in the background meanwhile: for a test that watches the whole
        cluster (its oldest running transaction, every session), in which a clone being
        made would show."""
        self._pause_filling()
        try:
            yield
        finally:
            self._filling.set()

    def _pause_filling(self) -> None:
        self._filling.clear()
        if self._filler is not None:
            self._filler.join(timeout=60)

    def drop_database(self, dsn: str) -> None:
        """Drop a database made by :meth:`new_database` (closing its connections)."""
        name = psycopg.conninfo.conninfo_to_dict(dsn).get("dbname")
        if not name or not str(name).startswith("cyclone_t_"):
            return
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(str(name))))

    def close(self) -> None:
        """Drop the spare clones and the template and stop whatever this object started
        (an embedded server is deleted with all its databases: nothing is dropped first)."""
        self._pause_filling()
        if self._embedded is not None:
            with contextlib.suppress(Exception):
                self._embedded.destroy()
        else:
            while not self._released.empty():
                self.drop_database(self._released.get_nowait())
            while not self._spares.empty():
                self.drop_database(self.dsn_for(self._spares.get_nowait()))
            with contextlib.suppress(psycopg.Error), psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.template)))
        if self._container is not None:
            with contextlib.suppress(Exception):
                self._container.stop()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
