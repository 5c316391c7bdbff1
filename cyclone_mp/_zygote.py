"""The zygote: a process that imports the child runner and the handlers' modules once, and
forks the supervisor's children from that state, so a new child is ready in milliseconds.

Started by the supervisor (:class:`cyclone_mp.zygote.Zygote`) as ``_boot.py _child
zygote FD SUPERVISOR_PID LIMIT``: a fresh interpreter with a child's scrubbed environment
(:func:`cyclone_mp.procs.helper_env`), in its own process group, that never opens a
database connection. After each handler module named in ``CYCLONE_MP_PRELOAD`` it
checks that the process is still safe to fork (one thread, no socket the module opened:
it would be shared by every child); a module that is not is reported ``unsafe``, the
zygote exits and the supervisor starts another without it. It forks with
``clone(CLONE_PARENT)`` (:mod:`cyclone_mp._clone`), so a child's parent is the
supervisor's process-control thread exactly as for a spawned child (SPEC 1). It dies
with the supervisor too; docs/operating.md ("How children start") explains the rest.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import stat
import sys

from . import protocol
from ._child import serve
from ._clone import CloneParent
from ._process import die_with_parent
from ._tasks import load_module
from .limits.userns import own_user_namespace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Standard modules every child imports at its first attempt (the deadline, the input's
# annotation, a script's loader): imported here once, so no child pays for them. Not
# asyncio or traceback (only some children need them): a forked child's RSS counts the
# zygote's pages it maps (6.6 MB more with those two), and a memory_limit below a fresh
# child's RSS refuses the attempt.
WARM = ("datetime", "inspect", "importlib.util")
MESSAGE_MAX = protocol.ZYGOTE_MESSAGE_MAX
UNSAFE = "the zygote cannot fork safely"  # how a fork refused for a hazard starts its error (sent as "unsafe")


def fork_hazard(baseline: set[int]) -> str | None:
    """Why this process can no longer fork safely, or None: it runs another thread (its
    locks could be held at the fork), or it holds a socket that is not one of
    ``baseline`` (a connection a module opened at import, which every child would share)."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 1
    if threads > 1:
        return f"it started {threads - 1} thread(s) at import"
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    for fd in fds:
        if fd in baseline:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                return "it opened a socket at import (a connection every forked child would share)"
        except OSError:
            continue
    return None


def enter_cgroups(dirs: list[tuple[str, int]]) -> tuple[list[str], str | None]:
    """Move this process into each cgroup directory of ``dirs`` (``(key, descriptor)``:
    ``0`` written to its ``cgroup.procs``, which moves the writer). Returns the keys it
    could not enter (the supervisor then moves it into those) and why, or ``([], None)``.
    Run in a forked child first thing (after only the interpreter's own fork hooks): the
    kernel's wait for a grace period is the child's, not the supervisor's."""
    failed, errors = [], []
    for key, fd in dirs:
        try:
            procs_fd = os.open("cgroup.procs", os.O_WRONLY, dir_fd=fd)
            try:
                os.write(procs_fd, b"0")
            finally:
                os.close(procs_fd)
        except OSError as exc:
            failed.append(key)
            errors.append(f"{key}: {exc.strerror or exc}")
    return failed, "; ".join(errors) or None


def open_fds() -> set[int]:
    try:
        return {int(fd) for fd in os.listdir("/proc/self/fd")}
    except OSError:
        return set()


class Title:
    """The word ``zygote`` in this process's command line (what ``ps`` and /proc show),
    which can be overwritten in place with another of the same length (Linux; elsewhere,
    or when /proc does not say where the arguments are, a no-op)."""

    def __init__(self, word: bytes = b"zygote") -> None:
        self.word = word
        self.at: int | None = None
        try:
            with open("/proc/self/stat", "rb") as fh:
                text = fh.read()
            fields = text[text.rindex(b")") + 2:].split()
            start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
            if 0 < end - start < 1 << 20:
                found = ctypes.string_at(start, end - start).find(b"\0" + word + b"\0")
                if found >= 0:
                    self.at = start + found + 1
        except (OSError, ValueError, IndexError):
            pass

    def set(self, word: bytes) -> None:
        if self.at is not None and len(word) == len(self.word):
            ctypes.memmove(self.at, word, len(word))


class Zygote:
    """The zygote's loop. ``sock`` (``FD``) is a ``SOCK_SEQPACKET`` socket to the
    supervisor, one JSON message per packet:

    - from the zygote: ``preloading`` (module, path), ``unsafe`` (module, path, why),
      ``ready`` (the modules it imported), ``forked`` (``n``, ``pid`` or an ``error``);
    - from the supervisor: ``fork`` (``n``, ``preload``: the handler modules the child
      imports itself; ``into``: a directory to create it in follows; ``enter``: the keys
      of the directories it moves itself into) with descriptors attached
      (``SCM_RIGHTS``): the child's control socket, the read end of its cancellation
      pipe, maybe its slot's cgroup v2 directory (the child is created in it:
      ``forked`` then says ``in_cgroup``), then its slot's cgroup directories."""

    def __init__(self, sock: socket.socket, supervisor: int, limit: int) -> None:
        self.sock = sock
        self.supervisor = supervisor
        self.limit = limit
        self.modules: dict[tuple[str, str | None], Any] = {}  # handed to every child's runner
        self.baseline: set[int] = set()  # the descriptors it holds once ready (no socket but its own)
        self.clone = CloneParent()
        self.title = Title()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send(json.dumps(message, separators=(",", ":")).encode())

    def preload(self, modules: list[list[Any]]) -> list[list[Any]]:
        """Import the handlers' modules (each announced first, as a child does); returns
        those imported. Exits after an ``unsafe`` report when one leaves the process
        unsafe to fork."""
        for name in WARM:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - a speed-up only
                pass
        baseline = open_fds()
        why = fork_hazard(baseline)
        if why:  # the runner itself must never do this
            self.send({"t": "unsafe", "module": None, "path": None, "why": why})
            os._exit(0)
        done = []
        for name, path in modules:
            self.send({"t": "preloading", "module": name, "path": path})
            try:
                load_module(name, path, self.modules)
            except BaseException:  # noqa: BLE001 - its steps' attempts report it (in the children)
                pass
            else:
                done.append([name, path])
            why = fork_hazard(baseline)
            if why:
                self.send({"t": "unsafe", "module": name, "path": path, "why": why})
                flush_std()
                os._exit(0)
        flush_std()
        return done

    def loop(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MESSAGE_MAX, 3 + len(protocol.SLOT_CGROUPS))
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return  # the supervisor closed its end (stopping) or is gone
            try:
                message = json.loads(data)
                into = bool(message.get("into"))
                keys = list(message.get("enter") or [])
                well_formed = (message.get("t") == "fork" and set(keys) <= set(protocol.SLOT_CGROUPS)
                               and len(fds) == 2 + into + len(keys))
            except (ValueError, AttributeError, TypeError):
                message, well_formed = {}, False
            if not well_formed:
                for fd in fds:
                    os.close(fd)
                if isinstance(message, dict) and message.get("t") == "fork":  # answered: nobody waits a second for it
                    self.send({"t": "forked", "n": message.get("n"), "pid": None, "in_cgroup": False,
                               "error": "a malformed fork request", "unsafe": False})
                continue
            n = message.get("n")
            try:
                pid, placed, error = self.fork(fds[0], fds[1], fds[2] if into else None,
                                               message.get("preload") or [], list(zip(keys, fds[2 + into:])),
                                               userns=message.get("userns") is True)
            finally:
                for fd in fds:
                    os.close(fd)
            self.send({"t": "forked", "n": n, "pid": pid, "in_cgroup": placed, "error": error,
                       "unsafe": error is not None and error.startswith(UNSAFE)})

    def fork(self, ctrl_fd: int, cancel_fd: int, cgroup_fd: int | None,
             leftover: list[list[Any]], enter: list[tuple[str, int]], *,
             userns: bool = False) -> tuple[int | None, bool, str | None]:
        """Fork a child that is the supervisor's (``clone(CLONE_PARENT)``), in the cgroup
        ``cgroup_fd`` names if given and the kernel can; returns ``(pid, born_in_cgroup,
        None)`` or ``(None, False, why)``. ``leftover``: the modules it imports itself;
        ``enter``: its slot's cgroup directories (key, descriptor), which it moves itself
        into first (:func:`enter_cgroups`); ``userns``: then it makes a user namespace of
        its own, while it is single-threaded (:func:`cyclone_mp.proctree.own_user_namespace`)."""
        given = {ctrl_fd, cancel_fd} | ({cgroup_fd} if cgroup_fd is not None else set()) | {fd for _, fd in enter}
        why = fork_hazard(self.baseline | given)
        if why:
            return None, False, f"{UNSAFE}: {why}"
        flush_std()
        # The child shows "forked" from its first instant (a test or an operator looking
        # at it never takes it for the zygote); the zygote shows it for the clone only.
        self.title.set(b"forked")
        try:
            pid, placed = self.clone(cgroup_fd)
        except OSError as exc:
            self.title.set(b"zygote")
            return None, False, f"clone: {exc}"
        if pid != 0:
            self.title.set(b"zygote")
        if pid == 0:
            entered = None  # nothing to enter: the supervisor moves it (or it was born in its only cgroup)
            if enter:
                failed, error = enter_cgroups([(k, fd) for k, fd in enter if not (placed and k == "v2")])
                entered = {"t": "entered", "failed": failed, "error": error}
            own_userns = (own_user_namespace() or True) if userns else None
            for fd in given - {ctrl_fd, cancel_fd}:
                os.close(fd)
            self.child(ctrl_fd, cancel_fd, leftover, entered, own_userns)
        return pid, placed, None

    def child(self, ctrl_fd: int, cancel_fd: int, leftover: list[list[Any]], entered: dict[str, Any] | None,
              userns: bool | str | None = None) -> None:
        """In the forked child: run tasks until told to exit (``userns``: True, it is in a
        user namespace of its own, or why it could not be). Never returns.

        Before this, :meth:`fork` moved it into its slot's cgroups (:func:`enter_cgroups`:
        the kernel's grace period is waited for here, not by the supervisor) and, asked
        to, made a user namespace (:mod:`cyclone_mp.proctree`). Here: its own process
        group, the death signal (then its parent is checked: the supervisor, or it
        exits), the zygote's socket closed; :func:`~cyclone_mp._child.serve` then makes
        it a child subreaper, says ``entered`` (or why it could not: it then waits for
        the supervisor's ``start``), imports the handler modules the zygote had not (in
        its slot's cgroups by then, so their memory is charged there) and says ready.
        Rlimits are set per task (:class:`cyclone_mp.limits.rlimits.TaskLimits`)."""
        code = 0
        try:
            os.setpgid(0, 0)  # its own group, as a spawned child (the supervisor sets it too)
            self.sock.close()
            die_with_parent(self.supervisor)  # exits unless the supervisor is its parent
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # what a spawned child's sys.argv holds (``_boot.py CTRL_FD CANCEL_FD PARENT_PID LIMIT``)
            sys.argv[1:] = [str(ctrl_fd), str(cancel_fd), str(self.supervisor), str(self.limit)]
            serve(ctrl_fd, cancel_fd, self.limit, modules=self.modules, preload=leftover, entered=entered,
                  userns=userns)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)


def flush_std() -> None:
    """Flush what a module printed, so no child writes it again."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass


def main(argv: list[str]) -> None:
    fd, supervisor, limit = int(argv[0]), int(argv[1]), int(argv[2])
    die_with_parent(supervisor)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    sock = socket.socket(fileno=fd)
    try:
        try:
            zygote = Zygote(sock, supervisor, limit)
        except OSError as exc:  # no clone(CLONE_PARENT) here: the supervisor spawns its children
            sock.send(json.dumps({"t": "unsafe", "module": None, "path": None, "why": str(exc)}).encode())
            os._exit(0)
        modules = zygote.preload(json.loads(os.environ.pop(protocol.PRELOAD_ENV, None) or "[]"))
        zygote.baseline = open_fds()
        zygote.send({"t": "ready", "pid": os.getpid(), "modules": modules})
        zygote.loop()
    except (BrokenPipeError, ConnectionResetError):
        pass
    os._exit(0)
