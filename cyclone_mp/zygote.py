"""The supervisor's end of its zygote: children forked in milliseconds.

A fresh child takes tens of milliseconds to start an interpreter and import the runner
and the handlers' modules, and every crash, kill and recycle pays it. With
``start_method="zygote"`` (the default) the pool keeps one more process, the zygote
(:mod:`cyclone_mp._zygote`), which has done that once, and asks it for each new child.
The child it forks (``clone(CLONE_PARENT)``) is this process's own child exactly as a
spawned one: own process group, ``PR_SET_PDEATHSIG``, slot cgroups, pidfd, ``wait4``
forensics, scrubbed environment (SPEC 1).

:class:`Zygote` is driven by process control's thread and never blocks it for long
(:meth:`Zygote.fork` waits at most :data:`FORK_TIMEOUT`). A dead zygote is started again
without a module whose import killed or hung it; after :data:`DEATHS_MAX` deaths within
:data:`DEATHS_WINDOW` seconds, or without ``clone(CLONE_PARENT)``, children are spawned.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import psutil

from . import procs, protocol
from .config import PRELOAD_TIMEOUT
from .mailbox import readable

log = logging.getLogger("cyclone_mp.supervisor")

FORK_TIMEOUT = 1.0  # seconds the zygote may take to answer a fork (it takes about 1 ms); then it is killed
DEATHS_MAX = 3  # deaths of the zygote within DEATHS_WINDOW after which children are spawned instead
DEATHS_WINDOW = 60.0  # seconds

Module = tuple[str, "str | None"]


def _decoded(data: bytes) -> dict[str, Any]:
    """A message from the zygote ({} when it is not one)."""
    try:
        message = json.loads(data)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


class ZygoteError(Exception):
    """The zygote could not fork a child (it died, hung, or refused); the caller spawns it."""


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``, or None when it is gone."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


class Zygote:
    """One zygote at a time, started again when it dies (see the module docstring).

    Args:
        owner: the supervisor's id (the zygote's and its children's environment marker).
        limit: the largest message in bytes (the children's).
        preload: the pool's ``(module, path)`` list of the handlers' modules: the zygote
            imports them (but those in :attr:`excluded`); a module dropped from it (it
            killed or hung a child) is dropped here too.
        selector: process control's selector (the zygote's socket is registered with the
            data ``("zygote", None)``: readiness wakes the loop, which calls :meth:`poll`).
        clock: local monotonic clock in seconds.
        preload_timeout: seconds one module's import may take before the zygote is killed
            and the module left out (the children's :data:`~cyclone_mp.config.PRELOAD_TIMEOUT`).

    Attributes:
        state: ``"starting"`` (importing), ``"ready"`` (forks children), or ``"off"``
            (children are spawned: :attr:`gave_up` says why).
        imported: the modules the running zygote has imported (a child forked from it
            imports the rest of ``preload`` itself, before it says ready).
        excluded: modules that left a zygote unsafe to fork: never imported by one again.
    """

    def __init__(self, owner: str, limit: int, preload: list[Module], *, selector: Any,
                 clock: Callable[[], float] = time.monotonic,
                 preload_timeout: float = PRELOAD_TIMEOUT) -> None:
        self.owner = owner
        self.limit = limit
        self.preload = preload
        self.selector = selector
        self.clock = clock
        self.preload_timeout = preload_timeout
        self.state = "off"
        self.gave_up: str | None = None
        self.imported: set[Module] = set()
        self.excluded: set[Module] = set()
        self.popen: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.preloading: Module | None = None
        self.since = clock()  # when it started, or began importing its current module
        self.deaths: list[float] = []
        self._unsafe = False  # it said it is unsafe to fork and exits: started again without that module
        self._n = 0
        self.readable = False  # the selector saw its socket readable since the last poll (process control sets it)

    @staticmethod
    def unsupported() -> str | None:
        """Why children cannot be forked from a zygote here, or None."""
        if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"):
            return f"no clone(CLONE_PARENT) on {sys.platform} {os.uname().machine} (Linux x86-64 and arm64 only)"
        return None

    @property
    def pid(self) -> int | None:
        """The running zygote's pid, or None."""
        return self.popen.pid if self.popen is not None and self.popen.returncode is None else None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    # -- life ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start a zygote (it imports in the background; :meth:`poll` sees it ready)."""
        why = self.unsupported()
        if why is not None:
            self._give_up(why)
            return
        modules = [list(m) for m in self.preload if tuple(m) not in self.excluded]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = procs.helper_env({procs.MARKER_ENV: self.owner, protocol.PRELOAD_ENV: json.dumps(modules)})
        try:
            self.popen = subprocess.Popen(
                procs.helper_command("_child", "zygote", str(theirs.fileno()), str(os.getpid()), str(self.limit)),
                pass_fds=(theirs.fileno(),), process_group=0, stdin=subprocess.DEVNULL, env=env, close_fds=True,
            )
        except OSError as exc:
            ours.close()
            self._give_up(f"cannot start it ({exc})")
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.selector.register(ours, selectors.EVENT_READ, ("zygote", None))
        self.state = "starting"
        self.imported = set()
        self.preloading = None
        self._unsafe = False
        self.since = self.clock()

    def poll(self) -> None:
        """Handle what the zygote said (non-blocking); notice its death and an import that
        hangs it (``preload_timeout``), and start another. A ready zygote's socket is read
        only once the selector said it is readable (:attr:`readable`: process control's
        turn runs this each time, and a ready zygote speaks only when it dies)."""
        if self.sock is None or not (self.readable or self.state == "starting"):
            return
        self.readable = False
        while self.sock is not None:
            data = self._recv()
            if data is None:
                break
            if not data:
                self._died()
                return
            self._on_message(_decoded(data))
        if self.state == "starting" and self.clock() - self.since > self.preload_timeout:
            module = self.preloading
            log.error("the zygote hung %s; killing it", f"importing {module[0]}" if module else "starting")
            self._kill()
            self._died()

    def _recv(self) -> bytes | None:
        """One message from the zygote; None: none waiting; b"": the zygote is gone."""
        assert self.sock is not None
        try:
            return self.sock.recv(protocol.ZYGOTE_MESSAGE_MAX)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("t")
        if kind == "preloading":
            self.preloading = (message.get("module"), message.get("path"))
            self.since = self.clock()
        elif kind == "ready":
            self.state = "ready"
            self.preloading = None
            self.imported = {(m[0], m[1]) for m in message.get("modules") or []}
            log.debug("zygote %s ready (%d handler module(s) imported)", self.pid, len(self.imported))
        elif kind == "unsafe":
            module = message.get("module")
            self._unsafe = True
            if module is None:
                self._give_up(f"it cannot fork safely ({message.get('why')})")
            else:
                self.excluded.add((module, message.get("path")))
                log.warning("module %s cannot be imported before the fork: %s; each child imports it after "
                            "the fork instead (slower starts)", module, message.get("why"))

    def _died(self) -> None:
        """The zygote's socket closed: reap it, and start another (or give up)."""
        code = self._reap()
        was, module = self.state, self.preloading
        if was == "off":
            return
        if self._unsafe:
            self.start()  # exited after its report; the next one leaves that module out
            return
        importing = was == "starting" and module is not None and module in self.preload
        if importing:
            log.error("the zygote %s while importing %s (code %s); its steps import it at their first attempt",
                      "hung" if code == -9 else "died", module[0], code)  # type: ignore[index]
            self.preload.remove(module)  # type: ignore[arg-type]  # (the pool's own list: spawned children too)
        # every death counts, in whatever phase: a zygote killed again and again (from outside,
        # or by memory) is given up however its deaths fell against its imports
        now = self.clock()
        self.deaths = [t for t in self.deaths if now - t < DEATHS_WINDOW] + [now]
        if len(self.deaths) >= DEATHS_MAX:
            self._give_up(f"it died {len(self.deaths)} times within {DEATHS_WINDOW:.0f} s (last code {code})")
            return
        if not importing:
            log.warning("the zygote died (code %s); starting another (children alive go on)", code)
        self.start()

    def _give_up(self, why: str) -> None:
        if self.gave_up is None:
            log.warning("children start as fresh interpreters (start_method='spawn') from now on: "
                        "no zygote, %s", why)
        self.gave_up = why
        self.state = "off"
        if self.sock is not None or self.popen is not None:
            self._kill()
            self._reap()

    def _kill(self) -> None:
        if self.popen is not None and self.popen.returncode is None:
            procs.kill_tree(self.popen.pid, None)  # our unreaped child: its pid cannot have been reused

    def _reap(self) -> int | None:
        if self.sock is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(self.sock)
            self.sock.close()
            self.sock = None
        code = None
        if self.popen is not None:
            try:
                code = self.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self._kill()
                code = self.popen.wait()
        return code

    def close(self) -> None:
        """Stop the zygote for good (the supervisor stops): it holds nothing worth a
        graceful exit, so it is killed and reaped."""
        self.state = "off"
        self._kill()
        self._reap()

    # -- forking ---------------------------------------------------------------------------------

    def fork(self, ctrl_fd: int, cancel_fd: int, leftover: list[list[Any]],
             cgroup_fd: int | None = None, enter: Sequence[tuple[str, int]] = (), *,
             userns: bool = False) -> tuple[int, bool]:
        """Ask the ready zygote for a child that serves ``ctrl_fd`` (its end of the control
        socket) and ``cancel_fd`` (the read end of its cancellation pipe); both are the
        caller's to close. Returns the child's pid: a child of this process (its parent is
        this thread, as a spawned child's). It says ready at once, unless it has
        ``leftover`` modules to import (those the zygote had not): then it waits for
        ``{"t": "start"}`` first, sent once it is in its slot. ``cgroup_fd``: its slot's
        cgroup v2 directory, to create it in (``CLONE_INTO_CGROUP``: no migration, which
        costs a kernel RCU grace period). ``enter``: ``(key, directory descriptor)`` of the
        slot's cgroups, which the child moves itself into before anything else (the v2 one
        unless born in it) and then says ``entered`` (with the keys it could not enter, ``failed``, and why); the caller
        keeps the descriptors. ``userns``: it then makes a user namespace of its own
        (:func:`cyclone_mp.proctree.own_user_namespace`). Returns ``(pid, born in that cgroup)``.

        Raises:
            ZygoteError: no ready zygote, or it died, hung (:data:`FORK_TIMEOUT`) or could
                not fork; the zygote is then started again (or given up on).
        """
        if self.state != "ready" or self.sock is None:
            raise ZygoteError("no zygote is ready")
        self._n += 1
        n = self._n
        try:
            socket.send_fds(self.sock, [json.dumps({"t": "fork", "n": n, "preload": leftover, "into": cgroup_fd is not None,
                                                    "enter": [key for key, _ in enter], "userns": userns}).encode()],
                            [ctrl_fd, cancel_fd] + ([cgroup_fd] if cgroup_fd is not None else []) + [fd for _, fd in enter])
        except OSError as exc:
            self._kill()
            self._died()
            raise ZygoteError(f"the zygote is gone ({exc})") from exc
        deadline = time.monotonic() + FORK_TIMEOUT
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                log.error("the zygote did not answer a fork within %.1f s; killing it", FORK_TIMEOUT)
                self._kill()
                self._died()
                raise ZygoteError("the zygote did not answer")
            try:
                ready = readable([self.sock], wait)
            except InterruptedError:
                continue
            if not ready:
                continue
            data = self._recv()
            if data is None:
                continue
            if not data:
                self._died()
                raise ZygoteError("the zygote died while forking")
            message = _decoded(data)
            if message.get("t") != "forked" or message.get("n") != n:
                self._on_message(message)
                continue
            pid = message.get("pid")
            if not isinstance(pid, int):
                error = str(message.get("error"))
                if message.get("unsafe"):
                    self._give_up(error)
                raise ZygoteError(f"the zygote could not fork: {error}")
            if _parent_of(pid) != os.getpid():  # never seen: it exits by itself (its parent is not us)
                self._give_up("a forked child's parent was not the supervisor")
                raise ZygoteError("the forked child is not the supervisor's")
            return pid, bool(message.get("in_cgroup"))
