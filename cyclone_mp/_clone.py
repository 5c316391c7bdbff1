"""``clone(CLONE_PARENT)`` for the zygote: a child forked from the zygote's warm state whose
parent is the supervisor, as a spawned child's is (``wait4`` forensics, pidfds and
``PR_SET_PDEATHSIG`` unchanged; SPEC 1), created in its slot's cgroup where ``clone3``
can (``CLONE_INTO_CGROUP``). Linux on x86-64 or arm64; elsewhere :class:`CloneParent`
raises OSError and the supervisor spawns its children.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys


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
