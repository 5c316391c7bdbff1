"""A fork server for test supervisor processes (``Env(worker="process")``).

A fresh interpreter spends about 0.3 s importing psycopg and the supervisor before it
can run; a test suite starts hundreds. The fork server is one process, started once per
test process, that has imported :mod:`cyclone_mp.testing.worker` and forks a supervisor
per :meth:`ForkServer.start`: the same ``main`` runs in the fork, with the caller's
environment, working directory, stdout and stderr, as a fresh process of its own pid
that signals, ``SIGKILL`` and ``SIGSTOP`` reach as before. The server is single-threaded
(a fork copies only the calling thread) and opens no connection.

:class:`ForkedProcess` is the part of :class:`subprocess.Popen` a test uses (``pid``,
``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``). The
server reaps its forks and reports each exit status. ``CYCLONE_TEST_FORKSERVER=0``
turns it off (every supervisor then starts from a fresh interpreter). Docs:
``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

# A request carries the worker's config and the caller's environment. What one message may
# hold is the socket's send buffer (about 208 KiB on Linux): a bigger request fails to
# send (OSError) and the caller spawns the supervisor instead.
_MAX_MESSAGE = 1 << 20


class ForkedProcess:
    """A supervisor forked by the server: ``subprocess.Popen``'s process methods.
    ``returncode`` is the exit code, or ``-N`` when signal N ended it (as Popen's)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the process has ended; raises :class:`subprocess.TimeoutExpired`
        after ``timeout`` seconds (None: no limit)."""
        code = self.server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked supervisor {self.pid}", timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a signal to a pid that was reaped (and may be reused)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The test process's side: starts the server, asks it for forks, hears their exits."""

    _shared: ForkServer | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> ForkServer | None:
        """This test process's server, started on first use; None when it is turned off
        (``CYCLONE_TEST_FORKSERVER=0``), could not start, or would be started from a
        thread other than the main one (callers then spawn). The server dies with the
        thread that started it (``PR_SET_PDEATHSIG``), so only the main thread starts one."""
        if os.environ.get("CYCLONE_TEST_FORKSERVER", "1") == "0":
            return None
        with cls._shared_lock:
            server = cls._shared
            if server is None or server.owner != os.getpid() or not server.alive():
                if threading.current_thread() is not threading.main_thread():
                    return None
                try:
                    server = cls._shared = cls()
                except (OSError, RuntimeError):
                    server = cls._shared = None
            return server

    def __init__(self) -> None:
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # -c, not -m: the package imports this module before runpy would run it as __main__
            self.popen = subprocess.Popen([sys.executable, "-c", "from cyclone_mp.testing.forkserver import main; main()",
                                           str(self.owner)],
                                          stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                          env={**os.environ, "CYCLONE_FORKSERVER_FD": str(theirs.fileno())})
        finally:
            theirs.close()
        self._attach(ours)
        try:
            hello = self._replies.get(timeout=30)
        except queue.Empty:
            hello = {}
        if "ready" not in hello:
            self.popen.kill()
            self.popen.wait()
            raise RuntimeError(f"the fork server did not start: {hello.get('error', 'no answer in 30 s')}")
        self.pid = self.popen.pid

    def _attach(self, sock: socket.socket) -> None:
        """Talk to the server over ``sock``: its replies and its forks' exits are read on a
        thread of their own."""
        self.sock = sock
        self._replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._exits: dict[int, int] = {}  # pid -> exit code, of forks not since replaced by a new one of that pid
        self._changed = threading.Condition()
        self.ended = False  # the server is gone: its forks died with it (PR_SET_PDEATHSIG)
        self._lock = threading.Lock()  # one request at a time
        self._seq = itertools.count(1)  # a reply names its request: a late one is never taken for the next
        threading.Thread(target=self._read, name="cyclone-forkserver", daemon=True).start()

    def alive(self) -> bool:
        return not self.ended and self.popen.poll() is None

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str) -> ForkedProcess:
        """Fork a supervisor running ``cyclone_mp.testing.worker.main(argv)`` with ``env``
        as its environment, ``cwd`` as its directory, and this process's stdout and
        stderr. Raises RuntimeError when the server cannot fork or answer, OSError when
        the request cannot be sent (one bigger than the socket's buffer)."""
        with self._lock:
            seq = next(self._seq)
            request = json.dumps({"seq": seq, "argv": argv, "env": env, "cwd": cwd}).encode()
            socket.send_fds(self.sock, [request], [1, 2])  # what a spawned process inherits
            deadline = time.monotonic() + 30
            while True:
                try:
                    reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError("the fork server did not answer in 30 s") from None
                if reply.get("seq") in (seq, None):  # ours, or the server's end
                    break
                if "pid" in reply:  # a fork whose caller gave up waiting: nobody will stop it
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(reply["pid"]), signal.SIGKILL)
        if "pid" not in reply:
            raise RuntimeError(f"the fork server could not fork: {reply.get('error')}")
        return ForkedProcess(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code; None while it runs. Once the server is gone, a fork it did
        not report ended by its SIGKILL (``PR_SET_PDEATHSIG``)."""
        with self._changed:
            code = self._exits.get(pid)
            return -signal.SIGKILL if code is None and self.ended else code

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits and not self.ended:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left if left is not None else 1.0)
            return self._exits.get(pid, -signal.SIGKILL)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:  # the server ended: no fork of it can be reaped or heard any more
                with self._changed:
                    self.ended = True
                    self._changed.notify_all()
                self._replies.put({"error": "the fork server ended"})
                return
            message = json.loads(data)
            if "exit" in message:
                with self._changed:
                    self._exits[int(message["exit"])] = int(message["code"])
                    self._changed.notify_all()
            else:
                if "pid" in message:  # a new fork may have the pid of one reaped before
                    with self._changed:
                        self._exits.pop(int(message["pid"]), None)
                self._replies.put(message)


# -- the server -------------------------------------------------------------------------------------


def _serve(sock: socket.socket, parent: int) -> None:
    # imported here, in the server only: the test process that imports this module to
    # start one need not import the supervisor's whole stack
    from .. import _process
    from . import worker  # what every fork runs, imported once for all of them

    _process.die_with_parent(parent)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the test process's
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(sock)
        if sock in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            except OSError:
                data, fds = b"", []
            if not data:
                os._exit(0)  # the test process is gone or done: its forks die with this one
            request = json.loads(data)
            try:
                pid = os.fork()
            except OSError as exc:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"seq": request["seq"], "error": str(exc)}).encode())
                continue
            if pid == 0:
                _run_worker(worker, request, fds, sock, (wake_r, wake_w))
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"seq": request["seq"], "pid": pid}).encode())  # before any exit of it


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _run_worker(worker: Any, request: dict[str, Any], fds: list[int], sock: socket.socket,
                wake: tuple[int, int]) -> None:
    """In the fork: the caller's streams, directory and environment, then the worker's
    ``main``; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        for fd in wake:
            os.close(fd)
        for target, fd in zip((1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [worker.__file__, *request["argv"]]
        worker.main(request["argv"])
        code = 0
    except SystemExit as exc:  # as the interpreter reads it: None is 0, a message is printed and 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught error ends a fresh interpreter
        traceback.print_exc()
    finally:
        worker._exit_now(code)  # atexit functions and the streams' flush, as an interpreter ends


def main() -> None:
    """The server's entry point: ``python -c "...; main()" PARENT_PID``, its socket's
    descriptor in ``CYCLONE_FORKSERVER_FD``."""
    _serve(socket.socket(fileno=int(os.environ.pop("CYCLONE_FORKSERVER_FD"))), int(sys.argv[1]))
