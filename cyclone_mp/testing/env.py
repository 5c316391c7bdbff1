"""``Env``: a cyclone_mp test environment with real crash simulation (SPEC section 7).

The Python counterpart of the seed's ``cyclonetest``. ``worker="process"`` runs each
supervisor as a real separate process, so :meth:`Env.crash_worker` is a real SIGKILL
and :meth:`Env.freeze_worker` a real SIGSTOP; ``worker="thread"`` runs the supervisor
inside the test process (faster; crash helpers are then unavailable). Handlers always
run in child processes, so they must be importable by module path (defined at module
level of an importable module).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .. import procs
from ..client import Client
from ..errors import ConfigurationError
from ..status import RunStatus, StepStatus
from ..mux import Mux
from ..steps import Step
from ..store import connect
from ..workflow import Workflow
from .forkserver import ForkedProcess, ForkServer
from .network import FaultProxy
from .worker import skewed_clocks


class WorkerHandle:
    """One supervisor started by an Env: a process (``popen``) or a thread (``client``).
    ``proxy``: the :class:`~cyclone_mp.testing.network.FaultProxy` between it and
    PostgreSQL (``Env(proxy=True)``), or None."""

    def __init__(self, *, popen: subprocess.Popen[bytes] | ForkedProcess | None = None, client: Client | None = None,
                 supervisor_id: str = "", proxy: FaultProxy | None = None) -> None:
        self.popen = popen
        self.client = client
        self.supervisor_id = supervisor_id
        self.proxy = proxy

    @property
    def pid(self) -> int:
        """The supervisor's pid (the test process itself in thread mode)."""
        return self.popen.pid if self.popen is not None else os.getpid()

    def alive(self) -> bool:
        """True while the supervisor runs."""
        if self.popen is not None:
            return self.popen.poll() is None
        return self.client is not None and self.client.supervisor is not None and not self.client.supervisor.stopped.is_set()


class Env:
    """A test environment bound to one fresh database.

    Args:
        dsn: the test database (the fixtures give each test its own).
        workers: child slots per supervisor. lease_ttl, kill_grace, shutdown_grace:
            seconds (short defaults for fast tests). poll_interval: seconds or (min, max).
        worker: ``"process"`` (a real supervisor process) or ``"thread"``.
        proxy: put a :class:`~cyclone_mp.testing.network.FaultProxy` between each
            supervisor started and PostgreSQL, so :meth:`partition`, :meth:`heal`,
            :meth:`add_latency` and :meth:`reset_connections` can act on it.
        **options: any other :class:`~cyclone_mp.Client` option.

    Raises:
        ConfigurationError: an unknown ``worker`` mode.
    """

    def __init__(
        self,
        dsn: str,
        *,
        workers: int = 2,
        lease_ttl: float = 0.2,
        kill_grace: float = 0.5,
        shutdown_grace: float = 5.0,
        poll_interval: Any = (0.02, 0.1),
        worker: str = "process",
        proxy: bool = False,
        **options: Any,
    ) -> None:
        if worker not in ("process", "thread"):
            raise ConfigurationError(f"worker must be 'process' or 'thread', not {worker!r}")
        self.dsn = dsn
        self.mode = worker
        self.proxy = proxy
        self.options: dict[str, Any] = {
            "workers": workers, "lease_ttl": lease_ttl, "kill_grace": kill_grace,
            "shutdown_grace": shutdown_grace, "poll_interval": list(poll_interval) if isinstance(poll_interval, (tuple, list)) else poll_interval,
            "registry_interval": 0.1, **options,
        }
        self._mux = Mux()
        self._client = Client(dsn, self._mux, **self.options)
        self.workers: list[WorkerHandle] = []
        self.clock_skew = 0.0
        self._tmp = tempfile.mkdtemp(prefix="cyclone-env-")
        self._pids_seen: set[int] = set()

    # -- accessors ----------------------------------------------------------------------------

    def mux(self) -> Mux:
        """The environment's mux: register steps and workflows here."""
        return self._mux

    def client(self) -> Client:
        """A client on the test database (enqueue, status, cancel, ...)."""
        return self._client

    def enqueue(self, target: Step | Workflow | str, input: Any = None, **options: Any) -> str:
        """Register ``target`` if needed and enqueue it; returns the run id.

        Raises:
            ConfigurationError: ``target`` is new but a supervisor already runs (it would
                never claim it: register every step before :meth:`start_worker`).
        """
        if isinstance(target, (Step, Workflow)) and target.name not in self._mux.steps and target.name not in self._mux.workflows:
            if any(w.alive() for w in self.workers):
                raise ConfigurationError(
                    f"{target.name!r} was not registered when the worker started; register it first "
                    "(env.mux().register(...)) or enqueue it before env.start_worker()"
                )
            self._mux.register(target)
        return self._client.enqueue(target, input, **options)

    # -- supervisors ---------------------------------------------------------------------------

    def start_worker(self, *, proxy: bool | None = None, dsn: str | None = None, prefix: list[str] | None = None,
                     environ: dict[str, str] | None = None, user: str | None = None, python: str | None = None,
                     **overrides: Any) -> WorkerHandle:
        """Start one more supervisor (process or thread per the mode) and wait until it runs.

        ``proxy`` (default: the Env's): reach PostgreSQL through a fault proxy of its own.
        ``dsn``: connect there instead of the Env's database (the same database reached
        another way, say from a network namespace). ``prefix``: a command the process
        supervisor's command line is run under (``["ip", "netns", "exec", NAME]``).
        ``environ``: variables added to a worker process's environment (process mode),
        for example ``LD_PRELOAD`` and ``FAKETIME`` to run it under libfaketime.
        ``user``: run the worker process as this ordinary user (the test runs as root),
        with only ``environ`` and a ``PATH``, ``HOME`` and ``USER`` of that user as its
        environment; it must be able to read ``python`` and what the worker imports.
        ``python``: the interpreter of a worker process (default: this one's), e.g. the
        system's for a user who cannot read this one."""
        options = {**self.options, **overrides}
        dsn = dsn or self.dsn
        fault = None
        if self.proxy if proxy is None else proxy:
            fault = FaultProxy(upstream_of(dsn))
            dsn = through(dsn, fault)
        try:
            if self.mode == "thread":
                client = Client(dsn, self._mux, **skewed_clocks(self.clock_skew), **options)
                client.start()
                handle = WorkerHandle(client=client, supervisor_id=client.supervisor.id)
            else:
                handle = self._spawn_process(options, dsn, prefix, environ, user, python)
        except BaseException:
            if fault is not None:
                fault.close()
            raise
        handle.proxy = fault
        self.workers.append(handle)
        return handle

    def _spawn_process(self, options: dict[str, Any], dsn: str, prefix: list[str] | None = None,
                       environ: dict[str, str] | None = None, user: str | None = None,
                       python: str | None = None) -> WorkerHandle:
        steps, workflows = [], []
        for step in self._mux.steps.values():
            if not step.ref.importable():
                raise ConfigurationError(
                    f"step {step.name!r}: handler {step.ref.qualname} must be defined at module level of an "
                    f"importable module to run in a worker process (it is in {step.ref.module})"
                )
            steps.append({"module": step.ref.module, "qualname": step.ref.qualname, "path": step.ref.path})
        for wf in self._mux.workflows.values():
            workflows.append({"module": wf.module, "name": wf.name})
        schedules = [{"target": s.target.name, "name": s.name, "cron": s.cron, "every": s.every, "tz": s.tz,
                      "input": s.input, "catch_up": s.catch_up} for s in self._mux.schedules.values()]
        where, identity = self._tmp, {}
        if user is not None:  # the worker writes its ready file where that user can

            account = pwd.getpwnam(user)
            where = tempfile.mkdtemp(prefix="ready-", dir=self._tmp)
            os.chmod(self._tmp, 0o755)
            os.chown(where, account.pw_uid, account.pw_gid)
            identity = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            environ = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": account.pw_dir, "USER": user,
                       **(environ or {})}
        ready = os.path.join(where, f"ready-{len(self.workers)}-{time.monotonic_ns()}")
        config = {
            "dsn": dsn, "steps": steps, "workflows": workflows, "schedules": schedules, "options": options,
            "ready_file": ready, "parent_pid": os.getpid(), "sys_path": [p for p in sys.path if p],
            "clock_skew": self.clock_skew,
        }
        server = ForkServer.shared() if not (prefix or environ or user or python) else None
        popen: Any = None
        if server is not None:  # a fork of a process that imported the worker: 0.3 s sooner
            try:
                popen = server.start([json.dumps({**config, "parent_pid": server.pid})], env=dict(os.environ),
                                     cwd=os.getcwd())
            except (OSError, RuntimeError):  # a request past the socket's buffer, a server gone: spawn
                pass
        if popen is None:
            popen = subprocess.Popen([*(prefix or []), python or sys.executable, "-m", "cyclone_mp.testing.worker",
                                      json.dumps(config)], stdin=subprocess.DEVNULL,
                                     env=environ if user is not None else {**os.environ, **environ} if environ else None,
                                     **identity)
        self._pids_seen.add(popen.pid)
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if popen.poll() is not None:
                raise RuntimeError(f"test worker exited with code {popen.returncode} before it was ready")
            if time.monotonic() > deadline:
                popen.kill()
                popen.wait()
                raise TimeoutError("test worker did not become ready in 30 s")
            time.sleep(0.01)
        with open(ready) as fh:
            return WorkerHandle(popen=popen, supervisor_id=fh.read().strip())

    def _worker(self) -> WorkerHandle:
        live = [w for w in self.workers if w.alive()]
        if not live:
            raise RuntimeError("no live worker: call env.start_worker() first")
        return live[-1]

    def _require_process(self, what: str) -> WorkerHandle:
        if self.mode != "process":
            raise ConfigurationError(f"{what} needs Env(worker='process')")
        return self._worker()

    def crash_worker(self) -> int:
        """SIGKILL the newest live supervisor process (a real crash); returns its pid.

        Its children die with it (PDEATHSIG); its leases expire and are reclaimed by
        another supervisor's sweep.
        """
        handle = self._require_process("crash_worker()")
        assert handle.popen is not None
        handle.popen.send_signal(signal.SIGKILL)
        handle.popen.wait()
        return handle.popen.pid

    def freeze_worker(self) -> None:
        """SIGSTOP the newest supervisor process (a partition or a long pause)."""
        handle = self._require_process("freeze_worker()")
        os.kill(handle.pid, signal.SIGSTOP)

    def thaw_worker(self) -> None:
        """SIGCONT every frozen supervisor process."""
        for handle in self.workers:
            if handle.popen is not None and handle.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(handle.pid, signal.SIGCONT)

    def _proxied(self, handle: WorkerHandle | None, what: str) -> FaultProxy:
        handle = handle or self._worker()
        if handle.proxy is None:
            raise ConfigurationError(f"{what} needs a supervisor started with a proxy: Env(proxy=True)")
        return handle.proxy

    def partition(self, handle: WorkerHandle | None = None) -> None:
        """Black-hole the database traffic of the newest supervisor (or ``handle``): nothing
        is answered, nothing is reset, as when a network silently drops packets. Its
        handlers must be dead before its leases can expire (SPEC 9). Needs ``proxy=True``."""
        self._proxied(handle, "partition()").partition()

    def heal(self, handle: WorkerHandle | None = None) -> None:
        """End a :meth:`partition`."""
        self._proxied(handle, "heal()").heal()

    def add_latency(self, seconds: float, handle: WorkerHandle | None = None) -> None:
        """Add ``seconds`` of round trip between the newest supervisor (or ``handle``) and
        PostgreSQL (0 removes it). Needs ``proxy=True``."""
        self._proxied(handle, "add_latency()").add_latency(seconds)

    def reset_connections(self, handle: WorkerHandle | None = None) -> None:
        """Close the newest supervisor's (or ``handle``'s) database connections with an RST."""
        self._proxied(handle, "reset_connections()").reset()

    def terminate_worker(self, sig: int = signal.SIGTERM) -> WorkerHandle:
        """Send ``sig`` to the newest supervisor process (SIGTERM drains, SPEC 5)."""
        handle = self._require_process("terminate_worker()")
        os.kill(handle.pid, sig)
        return handle

    def skew_worker_clock(self, seconds: float) -> None:
        """Shift the local clocks of supervisors started from now on by ``seconds``.

        Durable timeouts and lease expiries are decided on the database clock, so a
        skew must change nothing; restart workers after calling this to apply it.
        """
        self.clock_skew = float(seconds)

    def kill_child(self, run_id: str, node: str | None = None, timeout: float = 10.0) -> int:
        """SIGKILL the child process running ``(run_id, node)``; returns its pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for row in self._client.workers(within=5.0):
                for child in (row.get("info") or {}).get("children", []):
                    if child.get("run_id") == run_id and (node is None or child.get("node") == node):
                        pid = int(child["pid"])
                        if _is_our_descendant(pid):
                            os.kill(pid, signal.SIGKILL)
                            return pid
            time.sleep(0.02)
        raise TimeoutError(f"no child is running {run_id}/{node}")

    def child_pids(self) -> list[int]:
        """Pids of every child process (handler runner) of every live supervisor; not its
        zygote, which carries the supervisor's marker too."""
        return self._marked_children(zygote=False)

    def zygote_pids(self) -> list[int]:
        """Pids of the zygotes of every live supervisor (none with
        ``start_method="spawn"``)."""
        return self._marked_children(zygote=True)

    def _marked_children(self, *, zygote: bool) -> list[int]:
        pids: list[int] = []
        for handle in self.workers:
            if not handle.alive():
                continue
            try:
                children = psutil.Process(handle.pid).children()
            except psutil.Error:  # it exited: the fork server reaped it before its exit was heard here
                continue
            for proc in children:
                with contextlib.suppress(psutil.Error):
                    ours = proc.environ().get(procs.MARKER_ENV) == handle.supervisor_id
                    if ours and procs.is_zygote(proc) == zygote:
                        pids.append(proc.pid)
        return pids

    # -- waiting -------------------------------------------------------------------------------

    def status(self, run_id: str) -> RunStatus:
        """``client.status(run_id)``."""
        return self._client.status(run_id)

    def run_until_complete(self, run_id: str, timeout: float = 30.0) -> RunStatus:
        """Start a worker if none runs, wait until the run is terminal, return its status.

        Raises:
            TimeoutError: still not terminal after ``timeout`` seconds (message has the states).
        """
        if not any(w.alive() for w in self.workers):
            self.start_worker()
        deadline = time.monotonic() + timeout
        while True:
            status = self._client.status(run_id)
            if status.terminal:
                return status
            if time.monotonic() > deadline:
                states = {n: s.state for n, s in status.steps.items()}
                raise TimeoutError(f"run {run_id} is still {status.state} after {timeout}s: {states}")
            time.sleep(0.02)

    def wait_for_state(
        self, run_id: str, node: str | None, state: str | tuple[str, ...], timeout: float = 10.0,
        owner: "WorkerHandle | None" = None,
    ) -> StepStatus:
        """Wait until step ``node`` (None: the only step) is in ``state``; returns its status.

        With ``owner``, also wait until that supervisor holds the step's lease (for
        example the new worker after a crash, once it reclaimed and claimed the step).
        """
        wanted = (state,) if isinstance(state, str) else tuple(state)
        deadline = time.monotonic() + timeout
        while True:
            run = self._client.status(run_id)
            step = run.steps[node] if node is not None else run.step
            if step.state in wanted and (owner is None or step.lease_owner == owner.supervisor_id):
                return step
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run_id}/{step.name} is {step.state}, not {wanted}, after {timeout}s")
            time.sleep(0.01)

    def expire_lease(self, run_id: str, node: str | None = None) -> int:
        """Set the step's ``lease_expiry`` to the past; the next sweep reclaims it. Returns rows hit."""
        with connect(self.dsn) as conn:
            cur = conn.execute(
                "UPDATE cyclone_steps SET lease_expiry = now() - interval '1 second' "
                "WHERE run_id = %s AND (%s::text IS NULL OR node = %s) AND state = 'running'",
                (run_id, node, node),
            )
            return cur.rowcount

    # -- teardown ------------------------------------------------------------------------------

    def stop_workers(self) -> None:
        """Stop every supervisor: SIGKILL processes (their children die with them), stop threads."""
        for handle in self.workers:
            if handle.proxy is not None:  # a clean stop writes what it has
                handle.proxy.heal()
                handle.proxy.add_latency(0)
            if handle.popen is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(handle.popen.pid, signal.SIGCONT)
                if handle.popen.poll() is None:
                    handle.popen.terminate()
                    try:
                        handle.popen.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        handle.popen.kill()
                        handle.popen.wait()
            elif handle.client is not None:
                handle.client.stop()
                handle.client.close()
            if handle.proxy is not None:
                handle.proxy.close()
        self.workers.clear()

    def close(self) -> None:
        """Stop workers, close the client, and check that no process of ours is left."""
        self.stop_workers()
        self._client.close()
        _wait_gone(self._pids_seen, timeout=5.0)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def upstream_of(dsn: str) -> tuple[str, int] | str:
    """Where a DSN's connections go: ``(host, port)``, or a Unix socket's path."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "/var/run/postgresql").split(",")[0]
    port = int(str(params.get("port") or 5432).split(",")[0])
    if host.startswith("/"):
        return os.path.join(host, f".s.PGSQL.{port}")
    return (host, port)


def through(dsn: str, proxy: FaultProxy) -> str:
    """``dsn`` with its host and port replaced by the proxy's."""
    params = conninfo_to_dict(dsn)
    params.update(proxy.dsn_options())
    params.pop("hostaddr", None)
    return make_conninfo(**params)


def _is_our_descendant(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        me = os.getpid()
        return any(p.pid == me for p in psutil.Process(pid).parents())
    return False


def _wait_gone(pids: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            time.sleep(0.01)
