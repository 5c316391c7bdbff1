"""A user namespace per child, so that ``RLIMIT_NPROC`` counts one tree.

``RLIMIT_NPROC`` counts the tasks of a *user* in a *user namespace*: in the user's own
namespace it would count the supervisor and every other program of that user. A child
that makes a user namespace of its own at birth (:func:`own_user_namespace`, asked for by
:data:`USERNS_ENV` in its environment) is the only process of its user there, so
``RLIMIT_NPROC`` counts exactly its tree and the kernel holds the cap even against a fork
bomb. That needs an ordinary user (root is never bound) and unprivileged user namespaces
(:func:`user_namespaces_refused` says why not). Imported by the child runner too.
"""

from __future__ import annotations

import os

from .procfs import read_text

CLONE_NEWUSER = 0x10000000
USERNS_ENV = "CYCLONE_MP_USERNS"  # a child's environment: "1": make a user namespace of its own at birth


def _unshare() -> object:
    import ctypes  # lazy: on the child's start-up path; only a capped child needs ctypes

    return ctypes.CDLL(None, use_errno=True).unshare


def own_user_namespace() -> str | None:
    """Make this process the first of a user namespace of its own, its user and group ids
    mapped to themselves (so they read the same inside); None, or why it could not. The
    process must be single-threaded (the kernel's rule): a child calls it at birth. Inside,
    the ids of other users read as the overflow id (65534) and set-user-ID programs gain
    nothing; what a handler may access is unchanged (the kernel checks the real ids)."""
    import ctypes  # lazy: as above

    uid, gid = os.getuid(), os.getgid()
    if _unshare()(CLONE_NEWUSER) != 0:  # type: ignore[operator]
        return f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}"
    for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
        except OSError:
            break  # unmapped ids read as 65534; the count, all this is for, holds anyway
    return None


def user_namespaces_refused(tries: int = 3) -> str | None:
    """Why this process's children cannot each hold ``max_processes`` with RLIMIT_NPROC in a
    user namespace of their own, or None when they can (a short-lived child of this process
    tries: a few milliseconds, once per supervisor). A refusal is tried again, up to
    ``tries`` times in all (a child killed or refused once is not the host's verdict), and
    the reason names the kernel's error or the signal."""
    if os.geteuid() == 0:
        return "root is never bound by RLIMIT_NPROC"
    if (read_text("/proc/sys/user/max_user_namespaces") or "").strip() == "0":
        return "user namespaces are disabled (user.max_user_namespaces = 0)"
    if (read_text("/proc/sys/kernel/unprivileged_userns_clone") or "").strip() == "0":
        return "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0)"
    import ctypes  # lazy: as above
    import warnings  # lazy: as above

    unshare, get_errno = _unshare(), ctypes.get_errno
    detail = ""
    for _ in range(max(1, tries)):
        with warnings.catch_warnings():  # (3.12+ warns of fork in a threaded process: the child below is safe)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # only the bound C functions and _exit: other threads may hold locks
            os._exit(0 if unshare(CLONE_NEWUSER) == 0 else min(255, get_errno() or 255))  # type: ignore[operator]
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped by someone else: the children find out at birth
            return None
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            return None
        if code < 0:
            detail = f" (the probe was killed by signal {-code})"
        elif code < 255:
            detail = f" ({os.strerror(code)})"
    return "the kernel refused an unprivileged user namespace" + detail
