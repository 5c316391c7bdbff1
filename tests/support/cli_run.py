"""Running the ``cyclone-mp`` CLI as a user does, for the tests of the CLI and the ones
that check what it prints: ``run_cli`` (a subprocess from the repository root),
``Worker`` (a ``cyclone-mp worker`` subprocess), and the fixtures ``pg`` (one embedded
server per importing module, on a temp data dir), ``dsn`` (a fresh database on it) and
``worker`` (start workers; at teardown every child they ever had must be gone). A test
module imports the fixtures it uses by name."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Callable, Iterator

import psutil
import psycopg
import pytest

import cyclone_mp as cy
from cyclone_mp.embedded import EmbeddedServer

from waiting import wait_for

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository: tests/support/ is two below it
APP = "tests/support/cli_app.py:mux"  # relative to REPO, the cwd of every CLI subprocess
UNREACHABLE = "postgresql://nobody:s3cret@127.0.0.1:1/x"


def _cli_import_path() -> str | None:
    """A directory that makes ``cyclone_mp_cli`` importable when the project is not
    installed (``cli/``, where it lives, is mapped to that name by pyproject.toml)."""
    try:
        import cyclone_mp_cli  # noqa: F401

        return None
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "cyclone_mp_cli", REPO / "cli" / "__init__.py", submodule_search_locations=[str(REPO / "cli")])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["cyclone_mp_cli"] = module
        spec.loader.exec_module(module)
        return str(REPO / "cli")


_SHIM = _cli_import_path()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CYCLONE_DSN"}
    paths = [str(REPO)] + ([_SHIM] if _SHIM else []) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["COLUMNS"] = "200"
    return env


def run_cli(*args: str, dsn: str | None = None, timeout: float = 60.0, stdin: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cyclone-mp [--dsn DSN] ARGS`` from the repository root; returns the finished process."""
    cmd = [sys.executable, "-m", "cyclone_mp_cli.main"] + (["--dsn", dsn] if dsn else []) + list(args)
    return subprocess.run(cmd, cwd=REPO, env=env or _env(), input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """Assert stderr is exactly one ``Error: ...`` line, without a traceback; return it."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("Error: "), lines[0]
    return lines[0]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg() -> Iterator[EmbeddedServer]:
    """One embedded PostgreSQL for this module's tests, on a temp data dir (mode 755 so
    that, as root, the server user can traverse it); destroyed at the end."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="cyclone-mp-cli-test-", dir="/tmp"))
    os.chmod(base, 0o755)
    server = EmbeddedServer(base / "pgdata")
    server.start()
    try:
        yield server
    finally:
        server.destroy()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def dsn(pg: EmbeddedServer) -> Iterator[str]:
    """A fresh, empty database on the session server (the CLI migrates it itself)."""
    name = f"cli_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg.uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg.uri(name)
    with psycopg.connect(pg.uri(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Worker:
    """A ``cyclone-mp worker`` subprocess; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, app: str, dsn: str, *options: str) -> None:
        cmd = [sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", dsn, "worker", app, *options]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.seen: set[int] = set()
        self.stderr = ""

    def children(self) -> list[int]:
        """Pids of the worker's live descendants (remembered for the leak check)."""
        with contextlib.suppress(psutil.Error):
            pids = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
            self.seen.update(pids)
            return pids
        return []

    def wait_ready(self, workers: int, timeout: float = 20.0) -> None:
        """Wait until the worker runs ``workers`` children."""
        wait_for(lambda: self.proc.poll() is not None or len(self.children()) >= workers, timeout, "worker children")
        assert self.proc.poll() is None, self.proc.communicate()[1]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the worker and wait for it; returns its exit code."""
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the worker and whatever of its tree is left (teardown after a failure)."""
        pids = [self.proc.pid] + self.children()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.communicate(timeout=10)


@pytest.fixture
def worker(dsn: str) -> Iterator[Callable[..., Worker]]:
    """Start workers with ``worker(app, *options)``; at teardown every worker is stopped and
    every child it ever had must be gone."""
    started: list[Worker] = []

    def start(app: str = APP, *options: str, workers: int = 2) -> Worker:
        w = Worker(app, dsn, "--workers", str(workers), "--lease-ttl", "3", "--kill-grace", "0.5",
                   "--poll-interval", "0.05,0.5", *options)
        started.append(w)
        w.wait_ready(workers)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            try:
                w.stop(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        wait_for(lambda: not _alive(sorted(w.seen)), 5.0, "the worker's children to exit")


def client_for(dsn: str) -> cy.Client:
    """A plain API client (no supervisor) for checks."""
    return cy.Client(dsn)
