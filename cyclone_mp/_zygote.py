"""The zygote: a process that imports the child runner and the handlers' modules once, and
forks the supervisor's children from that state, so a new child is ready in milliseconds.

Started by the supervisor (:class:`cyclone_mp.zygote.Zygote`) as ``_boot.py _child
zygote FD SUPERVISOR_PID LIMIT``: a fresh interpreter with a child's scrubbed environment
(no DSN, no password: :func:`cyclone_mp.procs.helper_env`), in its own process group,
that never opens a database connection. After each handler module named in
``CYCLONE_MP_PRELOAD`` it checks that the process is still safe to fork (one thread, no
socket the module opened: a connection opened at import would be shared by every
child); a module that is not is reported ``unsafe`` and the zygote exits, and the
supervisor starts another without it.

It forks with ``clone(CLONE_PARENT)``, so a child's parent is the supervisor's
process-control thread exactly as for a spawned child (``wait4`` forensics, pidfds and
``PR_SET_PDEATHSIG`` unchanged; SPEC 1). The zygote dies with the supervisor too.
docs/operating.md ("How children start") explains the rest.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import stat
import sys

from . import protocol
from ._child import serve
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


class CloneArgs(ctypes.Structure):
    """``struct clone_args`` of ``clone3`` (Linux 5.7 and later have ``cgroup``)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls", "set_tid",
        "set_tid_size", "cgroup")]


class CloneParent:
    """``clone(CLONE_PARENT | SIGCHLD)`` around the interpreter's own fork preparation,
    where this system has it (Linux on x86-64 or arm64). The interpreter is prepared and
    restored as ``os.fork`` does (``PyOS_BeforeFork``, ``PyOS_AfterFork_Child``/``_Parent``:
    the import lock, the threads' state, ``os.register_at_fork`` hooks); the C library's
    ``pthread_atfork`` handlers do not run, and the child's thread id is set where the C
    library keeps it (``CLONE_CHILD_SETTID``).
    Given a cgroup v2 directory, ``clone3`` with ``CLONE_INTO_CGROUP`` creates the child
    in it: no migration, which costs a kernel RCU grace period (about 10 ms) when the
    system did none just before."""

    SYSCALL = {"x86_64": 56, "aarch64": 220}  # __NR_clone
    CLONE3 = 435  # __NR_clone3, the same on every architecture
    CLONE_PARENT = 0x00008000
    CLONE_CHILD_SETTID = 0x01000000
    CLONE_INTO_CGROUP = 0x200000000

    def __init__(self) -> None:
        number = self.SYSCALL.get(os.uname().machine) if sys.platform.startswith("linux") else None
        if number is None:
            raise OSError(f"no clone(CLONE_PARENT) here ({sys.platform}, {os.uname().machine})")
        self.number = number
        libc = ctypes.PyDLL(None, use_errno=True)  # the GIL stays held across the call, as in os.fork
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        self.syscall.argtypes = [ctypes.c_long, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p]
        self.syscall3 = ctypes.PyDLL(None, use_errno=True).syscall
        self.syscall3.restype = ctypes.c_long
        self.syscall3.argtypes = [ctypes.c_long, ctypes.POINTER(CloneArgs), ctypes.c_size_t]
        self.clone3 = True  # until the kernel says it has no clone3 (or no CLONE_INTO_CGROUP)
        api = ctypes.pythonapi
        self.before, self.after_child, self.after_parent = (
            api.PyOS_BeforeFork, api.PyOS_AfterFork_Child, api.PyOS_AfterFork_Parent)
        for fn in (self.before, self.after_child, self.after_parent):
            fn.restype, fn.argtypes = None, []
        self.tid_at = thread_id_address()

    def __call__(self, cgroup_fd: int | None = None) -> tuple[int, bool]:
        """``(0, born_in_cgroup)`` in the child, ``(pid, born_in_cgroup)`` here: whether
        the child was created in the cgroup ``cgroup_fd`` names. Raises OSError."""
        if cgroup_fd is not None and self.clone3:
            try:
                return self._clone3(cgroup_fd), True
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.ENOMEM):
                    raise
                # an older kernel, a refusing filter, a cgroup it cannot create children in:
                # clone, and the supervisor moves the child
                self.clone3 = False
        flags = self.CLONE_PARENT | signal.SIGCHLD | (self.CLONE_CHILD_SETTID if self.tid_at else 0)
        self.before()
        # The child-tid pointer goes in both places the architectures use (x86-64: the
        # fourth argument, arm64: the fifth; the other is the TLS, unused without CLONE_SETTLS).
        pid = self.syscall(self.number, flags, None, None, self.tid_at, self.tid_at)
        if pid == 0:
            self.after_child()
            return 0, False
        error = ctypes.get_errno()
        self.after_parent()
        if pid < 0:
            raise OSError(error, os.strerror(error))
        return pid, False

    def _clone3(self, cgroup_fd: int) -> int:
        # exit_signal stays 0: with CLONE_PARENT the child's is the zygote's (SIGCHLD), and
        # clone3 refuses another
        args = CloneArgs(flags=self.CLONE_PARENT | self.CLONE_INTO_CGROUP | (self.CLONE_CHILD_SETTID if self.tid_at else 0),
                         child_tid=self.tid_at or 0, cgroup=cgroup_fd)
        self.before()
        pid = self.syscall3(self.CLONE3, ctypes.byref(args), ctypes.sizeof(args))
        if pid == 0:
            self.after_child()
            return 0
        error = ctypes.get_errno()
        self.after_parent()
        if pid < 0:
            raise OSError(error, os.strerror(error))
        return pid


def thread_id_address() -> int | None:
    """Where the C library keeps this (main) thread's id (glibc: a field of its ``struct
    pthread``, found as the one int equal to the thread id in its first 2 KiB), so a
    cloned child gets its own id there (``CLONE_CHILD_SETTID``), as ``fork()`` does; None
    when it is not found exactly once (the child then keeps the zygote's there, which
    only matters to native code comparing it)."""
    try:
        import struct  # lazy: the zygote's start-up stays light; only a clone needs them
        import threading  # lazy: as struct

        libc = ctypes.CDLL(None)
        libc.pthread_self.restype = ctypes.c_void_p
        base = libc.pthread_self()
        tid = threading.get_native_id()
        if not base or tid != os.getpid():
            return None
        raw = ctypes.string_at(base, 2048)
        hits = [at for at in range(0, len(raw), 4) if struct.unpack_from("=i", raw, at)[0] == tid]
        return base + hits[0] if len(hits) == 1 else None
    except (AttributeError, OSError, ValueError):
        return None


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
