"""Process-tree control for the supervisor: subreaping, killing a child's whole tree.

Killing (SPEC 4): :func:`kill_tree` is the one way a process is killed (a child, the
watchdog's kill of a child, the zygote, the watchdog). It sends SIGKILL to the child's
process group and to every descendant psutil finds (a grandchild that left the group
with ``setsid()`` included), tree stopped first; then reaping, so no zombie and no
grandchild survives. Where the child's slot has a cgroup, the cgroup is killed first
(:meth:`cyclone_mp.limits.slot.Slot.kill`). Every signal to a process the supervisor did
not just reap goes through a pidfd opened for the very process psutil saw
(:func:`signal_process`), so a recycled pid is never hit.

Adopted processes: the supervisor and each child are child subreapers, so an escapee
whose parent died is reparented to the child (and swept with its attempt's leftovers),
else to the supervisor, where :func:`strays` tells a handler's from an embedding
program's. Only processes this supervisor's children started are ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import json
import os
import re
import signal
import sys
import time
from typing import Any

import psutil

from .errors import SupervisorInChild
from .limits.procfs import has_children

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
MARKER_ENV = "CYCLONE_MP_SUPERVISOR"


def set_subreaper(on: bool) -> bool | None:
    """Turn this process's child-subreaper flag on or off (Linux).

    Returns the previous value (None where unsupported), so a supervisor running in a
    thread of a bigger program can restore it when it stops.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    previous = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0)
    return bool(previous.value)


def is_zygote(proc: psutil.Process) -> bool:
    """True for a supervisor's zygote: ``_boot.py cyclone_mp._child zygote ...``
    (a child forked from it shows ``forked`` there). Raises psutil.Error when it is gone."""
    cmdline = proc.cmdline()
    return "cyclone_mp._child" in cmdline and "zygote" in cmdline


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty when it is gone)."""
    if not has_children(pid):
        return []
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def open_pidfd(proc: psutil.Process) -> int | None:
    """A pidfd for the process ``proc`` names, or None when that process is gone (or its
    pid now belongs to another: its start time differs from the one psutil saw). The
    start time is checked after the pidfd is open, so the pidfd is the one process."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None
    except (AttributeError, OSError):  # no pidfds here (an old kernel): psutil's own check then
        return -1 if _is_running(proc) else None
    if _is_running(proc):
        return fd
    os.close(fd)
    return None


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


def send(proc: psutil.Process, fd: int | None, sig: int) -> bool:
    """Send ``sig`` through ``fd`` (from :func:`open_pidfd`; -1: psutil's checked send)."""
    if fd is None:
        return False
    try:
        if fd < 0:
            proc.send_signal(sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, psutil.Error, OSError):
        return False


def signal_process(proc: psutil.Process, sig: int) -> bool:
    """Send ``sig`` to the process ``proc`` names, through a pidfd (never to a recycled pid)."""
    fd = open_pidfd(proc)
    try:
        return send(proc, fd, sig)
    finally:
        if fd is not None and fd >= 0:
            os.close(fd)


def pidfd_kill(pid: int) -> bool:
    """SIGKILL ``pid`` through a pidfd; for a process just listed (a cgroup's)."""
    with contextlib.suppress(psutil.Error):
        return signal_process(psutil.Process(pid), signal.SIGKILL)
    return False


def kill_tree(pid: int, pgid: int | None, extra: list[psutil.Process] | None = None, *,
              pidfd: int | None = None) -> list[int]:
    """SIGKILL the process group ``pgid``, ``pid`` and every descendant; returns the pids hit.

    ``pid`` is signalled through ``pidfd`` when given (our child's, kept since it
    started), descendants through pidfds of their own (:func:`open_pidfd`), the group
    only while its leader is unreaped (the caller's promise). The tree is stopped
    (SIGSTOP) before it is killed, and descendants are listed again after the kill (a
    fork may race the first listing).
    """
    hit: list[int] = []
    seen: dict[int, psutil.Process] = {p.pid: p for p in (extra or [])}
    fds: dict[int, int | None] = {}
    try:
        for _ in range(3):
            for proc in descendants(pid):
                seen.setdefault(proc.pid, proc)
            for child_pid, proc in seen.items():
                if child_pid not in fds:
                    fds[child_pid] = open_pidfd(proc)
            # Freeze the tree first so nobody forks between our listing and our kill.
            for child_pid, proc in seen.items():
                send(proc, fds[child_pid], signal.SIGSTOP)
            if pgid is not None and pgid > 1:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
            try:
                if pidfd is not None:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)  # our unreaped child (its pid cannot be reused before we reap it)
                hit.append(pid)  # the root counts as hit too (a leftover of a finished task is one)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            for child_pid, proc in seen.items():
                if send(proc, fds[child_pid], signal.SIGKILL):
                    hit.append(child_pid)
            if not any(p.pid not in seen for p in descendants(pid)):
                break
    finally:
        for fd in fds.values():
            if fd is not None and fd >= 0:
                os.close(fd)
    return sorted(set(hit))


def reap(pids: list[int], timeout: float = 2.0) -> None:
    """Wait for killed processes that are (or became) our children, so none is a zombie.

    Processes that are not our children (ECHILD) are only waited for until they vanish.
    """
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    pending.discard(pid)
            except ChildProcessError:
                if not psutil.pid_exists(pid) or _is_zombie_of_other(pid):
                    pending.discard(pid)
        if pending:
            time.sleep(0.005)


def _is_zombie_of_other(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    return True


def strays(supervisor_id: str, known: set[int], descended: set[int], *, dedicated: bool = False,
           held: Any = None) -> list[psutil.Process]:
    """Our direct children that are not pool children (nor the watchdog, ``known``) but
    came from a handler: handler descendants reparented to us (subreaper) after their
    parent died.

    A process is one when ``dedicated`` (this process runs only the supervisor: it
    starts nothing else, so whatever it adopts is a handler's), when it is in one of our
    cgroups (``held(pid)``: exact, whatever it did to its environment, session or group),
    when its pid was seen as a handler's descendant (``descended``), or when it carries
    our marker in its environment (a handler can scrub that: the other rules are why it
    need not be relied on). In a program that embeds the supervisor (``client.start()``)
    the program's own children are none of these, and are left alone.
    """
    found = []
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process().children(recursive=False):
            if proc.pid in known:
                continue
            with contextlib.suppress(psutil.Error):
                if dedicated or proc.pid in descended or (held is not None and held(proc.pid)):
                    found.append(proc)
                elif proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER_ENV) == supervisor_id:
                    found.append(proc)
    return found


def reap_strays(supervisor_id: str, known: set[int], descended: set[int], *, dedicated: bool = False,
                held: Any = None) -> int:
    """Kill and reap handler descendants reparented to us (:func:`strays`); returns how many."""
    found = strays(supervisor_id, known, descended, dedicated=dedicated, held=held)
    pids = []
    for proc in found:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                pids.extend(kill_tree(proc.pid, None, [proc]))
            pids.append(proc.pid)
    if pids:
        reap(sorted(set(pids)), timeout=1.0)
    return len(found)


def kill_marked(supervisor_id: str, exclude: set[int] | None = None) -> int:
    """SIGKILL every process carrying ``supervisor_id`` as its marker; returns how many.

    Used by the watchdog once the supervisor is dead: the marker is set only in the
    environment of children this supervisor started, and inherited by their descendants.
    """
    hit = 0
    for proc in psutil.process_iter():
        if exclude and proc.pid in exclude:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARKER_ENV) == supervisor_id and signal_process(proc, signal.SIGKILL):
                hit += 1
    return hit


BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot.py")
SITE_ENV = "CYCLONE_MP_SITE"  # a helper's environment: what site gave the supervisor (JSON), see _boot.py


def helper_command(module: str, *args: str) -> list[str]:
    """The command line of a helper process (a child or the watchdog) running
    ``cyclone_mp.MODULE.main(args)``: started without site processing (``-S -P``),
    which :mod:`cyclone_mp._boot` rebuilds from :func:`child_site`, so no child loads
    an editable install's import hook (about 12 ms of every start)."""
    return [sys.executable, "-S", "-P", BOOT, f"cyclone_mp.{module}", *args]


@functools.lru_cache(maxsize=1)
def _pth_import_lines() -> tuple[str, ...]:
    """The import lines of every ``.pth`` file in the site directories, in site's order,
    but this project's editable finder (read once: site ran them at this process's start)."""
    import site  # lazy: children run without site (python -S); only the supervisor reads .pth files

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and hasattr(site, "getusersitepackages"):
        dirs.append(site.getusersitepackages())
    lines: list[str] = []
    for folder in dict.fromkeys(dirs):
        for pth in sorted(glob.glob(os.path.join(glob.escape(folder), "*.pth"))):
            if os.path.basename(pth).startswith("__editable__") and "cyclone_mp" in os.path.basename(pth):
                continue  # our own import hook: the reason helpers start without site
            with contextlib.suppress(OSError, UnicodeDecodeError):
                with open(pth, encoding="utf-8") as fh:
                    lines.extend(line.rstrip() for line in fh if line.startswith(("import ", "import\t")))
    return tuple(lines)


def child_site() -> str:
    """What ``site`` gave this process, as ``_boot.py`` rebuilds it in a helper (JSON):
    ``path`` (``sys.path`` now, ``""`` as the current directory), ``prefix`` and
    ``exec_prefix``, ``pth`` (see :func:`_pth_import_lines`) and ``custom``
    (``sitecustomize``/``usercustomize`` if imported here)."""
    return json.dumps({
        "path": [p or os.getcwd() for p in sys.path], "prefix": sys.prefix, "exec_prefix": sys.exec_prefix,
        "pth": list(_pth_import_lines()),
        "custom": [m for m in ("sitecustomize", "usercustomize") if m in sys.modules],
    })


#: Variables a helper (a child running handlers, the watchdog) never gets: the DSN and
#: libpq's password. Neither needs the database (SPEC 1: children never touch it).
SECRET_ENV = frozenset({"CYCLONE_DSN", "CYCLONE_TEST_DSN", "PGPASSWORD"})
KEEP_ENV = "CYCLONE_MP_CHILD_ENV_KEEP"  # comma-separated names a user passes on to children anyway
_PASSWORD_VALUE = re.compile(
    r"://[^/@\s:]*:[^@\s]+@"  # a URI with user:password@
    r"|[?&]password=[^&\s#]"  # ...or ?password=
    r"|\bpassword\s*=\s*\S",  # a libpq key=value string
    re.I,
)


def holds_password(value: str) -> bool:
    """True when an environment value carries a password (a connection URI with
    ``user:password@`` or ``password=``, or a libpq ``password=...`` string)."""
    return bool(_PASSWORD_VALUE.search(value))


def helper_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a helper process: this one's, with :func:`child_site` and
    ``extra``, without secrets: :data:`SECRET_ENV` and every variable whose value holds
    a password (:func:`holds_password`), so handler code cannot read the DSN from its
    environment. Names listed in ``CYCLONE_MP_CHILD_ENV_KEEP`` are kept
    (never those of :data:`SECRET_ENV`)."""
    keep = {name.strip() for name in os.environ.get(KEEP_ENV, "").split(",")} - SECRET_ENV
    env = {k: v for k, v in os.environ.items()
           if k not in SECRET_ENV and (k in keep or not holds_password(v))}
    env[SITE_ENV] = child_site()
    env.update(extra or {})
    return env


def exit_description(status: int | None) -> dict[str, object]:
    """``{"exit_code": n}`` or ``{"signal": n, "signal_name": "SIGKILL"}`` for a wait status/returncode."""
    if status is None:
        return {}
    if status < 0:
        with contextlib.suppress(ValueError):
            return {"signal": -status, "signal_name": signal.Signals(-status).name}
        return {"signal": -status}
    return {"exit_code": status}


def refuse_in_child() -> None:
    """Raise :class:`~cyclone_mp.errors.SupervisorInChild` in a handler's child process
    (or its descendant): a supervisor there would spawn children that import the same
    module and start supervisors again, without end. The child runner reports it as its
    step's ``not_importable`` error, naming the missing ``__main__`` guard.
    """
    if os.environ.get(MARKER_ENV):
        raise SupervisorInChild(
            "a supervisor cannot start inside a handler's child process: this usually means a "
            "script starts its Client at module level; put that code under "
            "`if __name__ == \"__main__\":` (children import the module to find its steps)"
        )
