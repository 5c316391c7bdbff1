"""The host's cgroups as a supervisor finds and prepares them: where this process's
cgroups are in each hierarchy, the supervisor's own directory in each
(``cyclone-mp-<pid>-<tag>``), the v2 controllers its slots need, what dead supervisors
left behind, and where a given process is (:func:`cgroups_of`, :func:`within`);
the counter files' parsers; the watchdog's kill of what a dead supervisor left in its
cgroups (:func:`kill_dirs`). :mod:`cyclone_mp.limits.confinement` builds the slots on
top of it. No process is moved here but the supervisor itself, when cgroup v2 needs it
to enable controllers (:func:`enable_controllers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from typing import Any

from ..procs import pidfd_kill
from .procfs import read_text

log = logging.getLogger("cyclone_mp.supervisor")

PREFIX = "cyclone-mp-"
HIERARCHY_NAMES = {"v2": "cgroup v2", "memory": "memory cgroup", "pids": "pids cgroup"}  #: a slot's cgroups, in words


@dataclasses.dataclass(frozen=True)
class Hierarchies:
    """This process's own cgroup directory in each hierarchy found (None: not mounted or
    not reachable)."""

    v2: str | None = None
    memory_v1: str | None = None
    pids_v1: str | None = None


def find_hierarchies(mountinfo: str, proc_cgroup: str) -> Hierarchies:
    """Where this process's cgroups are, from ``/proc/self/mountinfo`` and
    ``/proc/self/cgroup`` (their texts: pure, for tests)."""
    own: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            own["v2"] = path
        for name in controllers.split(","):
            if name:
                own[name] = path
    found: dict[str, str] = {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            key = "v2"
        elif fstype == "cgroup" and ("memory" in options or "pids" in options):
            key = "memory" if "memory" in options else "pids"
        else:
            continue
        path = own.get(key)
        if path is None or key in found:
            continue
        if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue  # our cgroup is outside what this mount shows
        rel = path[len(root):] if root != "/" else path
        found[key] = os.path.join(point, rel.lstrip("/")).rstrip("/") or point
    return Hierarchies(v2=found.get("v2"), memory_v1=found.get("memory"), pids_v1=found.get("pids"))


def write_text(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def to_int(text: str | None) -> int | None:
    with contextlib.suppress(TypeError, ValueError):
        return int((text or "").strip())
    return None


def fields(text: str | None) -> dict[str, int]:
    """``key value`` lines (memory.events, cpu.stat, memory.oom_control, pids.events)."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def value_after(data: bytes | None, key: bytes, default: Any = 0) -> Any:
    """The integer after ``key`` in a counter file's bytes (``default`` if absent)."""
    if not data:
        return default
    at = data.find(key)
    if at < 0 or (at and data[at - 1:at] != b"\n"):
        return default
    at += len(key)
    end = data.find(b"\n", at)
    try:
        return int(data[at:end if end >= 0 else None])
    except ValueError:
        return default


def cgroups_of(pid: int) -> dict[str, str] | None:
    """Where process ``pid`` is in each hierarchy a slot uses (``"v2"``, ``"memory"``,
    ``"pids"``): its ``/proc/PID/cgroup`` paths, from the root of our cgroup namespace
    (None: it is gone)."""
    text = read_text(f"/proc/{pid}/cgroup")
    if text is None:
        return None
    out: dict[str, str] = {}
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            out["v2"] = path
        for name in ("memory", "pids"):
            if name in controllers.split(","):
                out[name] = path
    return out


def within(path: str | None, directory: str) -> bool:
    """True when the cgroup ``path`` (as :func:`cgroups_of` gives it) is ``directory`` (a
    slot's: ``.../cyclone-mp-<pid>-<tag>/slot-N``, a name no other cgroup of the host
    has) or one below it. The directory's part from ``cyclone-mp-`` on is looked for in
    ``path``, whatever our mount point or cgroup namespace."""
    if path is None:
        return False
    at = directory.find("/" + PREFIX)
    tail = directory[at:] if at >= 0 else directory
    found = path.find(tail)
    while found >= 0:
        rest = path[found + len(tail):]
        if (rest == "" or rest.startswith("/")) and directory.endswith(path[:found + len(tail)]):
            return True
        found = path.find(tail, found + 1)
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # existence only: no signal is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: str) -> None:
    """Remove what dead supervisors left under ``parent``: empty ``cyclone-mp-<pid>-*``
    directories whose supervisor pid is gone (a supervisor and its watchdog both
    SIGKILLed). Never touches a directory with a process in it."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith(PREFIX) or name.startswith(PREFIX + "supervisor-"):
                continue
            pid = to_int(name[len(PREFIX):].split("-", 1)[0])
            if pid is None or pid_alive(pid):
                continue
            remove_tree(os.path.join(parent, name))


def rmdir_cgroup(path: str) -> bool:
    """Remove an empty cgroup directory; True when it is gone."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def remove_tree(base: str) -> bool:
    """rmdir a supervisor's directory and its slot directories (only empty cgroups can go)."""
    ok = True
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            sub = os.path.join(base, name)
            if os.path.isdir(sub):
                try:
                    os.rmdir(sub)
                except OSError:
                    ok = False
    try:
        os.rmdir(base)
    except FileNotFoundError:
        pass
    except OSError:
        ok = False
    return ok


def setup_v2(own: str, name: str, why: list[str]) -> tuple[str | None, frozenset[str] | None]:
    """Make this supervisor's v2 directory under ``own`` (our cgroup), with the memory
    and pids controllers enabled for its slots where this cgroup offers them. What cannot
    be used is added to ``why``."""
    base = _own_directory(own, name, "cgroup v2", why)
    if base is None:
        return None, None
    offered = set((read_text(os.path.join(own, "cgroup.controllers")) or "").split())
    want = {"memory", "pids"} & offered
    enabled = set((read_text(os.path.join(own, "cgroup.subtree_control")) or "").split())
    if want - enabled and not enable_controllers(own, want - enabled):
        want &= enabled
    if want:
        try:
            write_text(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(want)))
        except OSError as exc:
            log.info("cannot enable %s in %s (%s)", ", ".join(sorted(want)), base, exc.strerror or exc)
            want = set()
    missing = {"memory", "pids"} - want
    if missing:
        why.append(f"cgroup v2 at {own} without the {' and '.join(sorted(missing))} controller"
                   f"{'s' if len(missing) > 1 else ''}")
    return base, frozenset(want)


def enable_controllers(own: str, controllers: set[str]) -> bool:
    """Enable ``controllers`` for the children of our cgroup ``own``. A non-root cgroup with
    processes cannot (EBUSY): if we are its only process we move into a leaf of our own
    first (the "no internal processes" rule), else we leave it."""
    control = os.path.join(own, "cgroup.subtree_control")
    text = " ".join(f"+{c}" for c in sorted(controllers))
    try:
        write_text(control, text)
        return True
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            log.info("cannot enable %s in %s (%s)", ", ".join(sorted(controllers)), own, exc.strerror or exc)
            return False
    procs = (read_text(os.path.join(own, "cgroup.procs")) or "").split()
    if procs != [str(os.getpid())]:
        log.info("cgroup v2 controllers %s not enabled: %s holds other processes than the supervisor",
                 ", ".join(sorted(controllers)), own)
        return False
    leaf = os.path.join(own, f"{PREFIX}supervisor-{os.getpid()}")
    try:
        os.makedirs(leaf, exist_ok=True)
        write_text(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
        write_text(control, text)
        log.info("moved the supervisor into %s to enable %s for its slots", leaf, ", ".join(sorted(controllers)))
        return True
    except OSError as exc:
        log.info("cannot enable %s in %s (%s)", ", ".join(sorted(controllers)), own, exc.strerror or exc)
        with contextlib.suppress(OSError):
            write_text(os.path.join(own, "cgroup.procs"), str(os.getpid()))
            os.rmdir(leaf)
        return False


def setup_v1(own: str | None, name: str, probe: str, why: list[str]) -> str | None:
    """This supervisor's directory in a v1 hierarchy (memory or pids), or None (then
    ``why`` says so)."""
    what = f"cgroup v1 {probe.split('.')[0]}"
    base = _own_directory(own, name, what, why) if own else None
    if base is None:
        return None
    if not os.path.exists(os.path.join(base, probe)):
        why.append(f"{what} at {own} has no {probe}")
        with contextlib.suppress(OSError):
            os.rmdir(base)
        return None
    return base


def _own_directory(own: str, name: str, what: str, why: list[str]) -> str | None:
    """Make this supervisor's directory ``name`` under our cgroup ``own`` (after removing
    what dead supervisors left there); None when it cannot (``why`` then says so, about
    ``what``: "cgroup v2", "cgroup v1 memory")."""
    remove_stale(own)
    base = os.path.join(own, name)
    try:
        os.mkdir(base)
    except OSError as exc:
        why.append(f"{what} at {own}: {exc.strerror or exc}")
        return None
    return base


# -- used by the watchdog once the supervisor is gone ---------------------------------------------


def kill_dirs(dirs: list[tuple[str, str]], timeout: float = 2.0) -> int:
    """Kill every process in a supervisor's cgroups (``(hierarchy, directory)``), then
    remove them; returns how many processes were listed. v2: ``cgroup.kill`` of the
    supervisor's directory kills every slot at once."""
    listed = 0
    deadline = time.monotonic() + timeout
    while True:
        left = False
        for hierarchy, base in dirs:
            if hierarchy == "v2" and os.path.exists(os.path.join(base, "cgroup.kill")):
                with contextlib.suppress(OSError):
                    write_text(os.path.join(base, "cgroup.kill"), "1")
            for sub in _subdirs(base) + [base]:
                pids = (read_text(os.path.join(sub, "cgroup.procs")) or "").split()
                for pid in pids:
                    listed += 1
                    left = True
                    pidfd_kill(int(pid))
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    while time.monotonic() < deadline and not all(remove_tree(base) for _, base in dirs):
        time.sleep(0.01)
    return listed


def _subdirs(base: str) -> list[str]:
    with contextlib.suppress(OSError):
        return [os.path.join(base, n) for n in os.listdir(base) if os.path.isdir(os.path.join(base, n))]
    return []
