"""Sampling an attempt's tree in its slot: where its counters start, and what it used since.

Process control looks at a running attempt with limits every :data:`SAMPLE_INTERVAL`
(:class:`~cyclone_mp.limits.watch.LimitWatch`): :func:`begin` notes where its slot's
counters stand (:class:`Baseline`), :func:`sample` reads what its tree used since
(:class:`~cyclone_mp.limits.verdicts.Usage`): the cgroup counters where cgroups count,
else the tree read from ``/proc`` (:func:`~cyclone_mp.limits.proctree.survey`), and
:func:`membership` finds its processes that left the slot's cgroups. Steps without
limits pay nothing. No I/O but the slot's files and ``/proc``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

from .cgroup_v2 import cpu_seconds
from .cgroups import HIERARCHY_NAMES, cgroups_of, to_int, within
from .declared import Limits
from .procfs import exiting, open_files, stat
from .proctree import survey
from .verdicts import Usage

if TYPE_CHECKING:
    from .slot import Slot

SAMPLE_INTERVAL = 0.05  #: seconds between two looks at a running attempt with limits
#: the share of process control's time one attempt's walks of its tree may take where
#: cgroups count its memory and CPU (a big tree is then walked less often than it is looked at)
WALK_SHARE = 0.02


@dataclasses.dataclass
class Baseline:
    """A limited attempt's starting point in its slot: CPU seconds used so far, the
    counters of OOM kills, memory cap hits and refused forks, where the memory cgroup's
    peak restarted, the child's descriptors; and the most the attempt's samples saw."""

    cpu: float | None = None
    oom_kills: int = 0
    cap_hits: int = 0
    fork_failures: int = 0
    runner_cpu: float | None = None  # the child's own CPU seconds when the attempt started
    peak: int = 0  # the most memory sampled (the fallback's peak; with a cgroup, its current usage)
    processes: int = 0  # the most processes seen in the tree
    open_files: int = 0  # the most descriptors seen in one process of the tree
    open_files_pid: int | None = None  # ... which
    #: the memory cgroup's peak restarted when the attempt began (True); else what it read
    #: then, past which a peak is this attempt's (None: not known: the sampled usage stands)
    peak_reset: bool = False
    peak_floor: int | None = None
    fds: int | None = None  # descriptors the child held when the attempt began (max_open_files)
    next_walk: float = 0.0  # time.monotonic() before which a look leaves the tree unwalked (WALK_SHARE)


def begin(slot: Slot, limits: Limits, runner_cpu: float | None = None) -> Baseline:
    """An attempt with ``limits`` starts now in ``slot``: where its counters start.

    Little is read here (this is every limited attempt's cost: a few microseconds):
    the counters start from the slot's last look; the memory cgroup's peak restarts
    (whatever the caps: every attempt's forensics read it, and the last attempt's
    peak is not this one's); with ``max_open_files``, the child's descriptors are
    counted (what its ``RLIMIT_NOFILE`` is set from, so what each process of the
    tree may hold). So an OOM kill or a refused fork is blamed on this attempt only
    with its own evidence beside it: its peak reached its memory cap, its tree is at
    its process cap (:func:`sample`). The CPU counter is read at the first look (most
    attempts end before it), less what the child itself used since it started the
    attempt (``runner_cpu``: its CPU seconds then)."""
    last = slot.last
    base = Baseline(oom_kills=last.oom_kills, cap_hits=last.cap_hits, fork_failures=last.fork_failures,
                    runner_cpu=runner_cpu)
    if slot.memory_file and slot.confined:
        _restart_peak(slot, base)
    if limits.open_files is not None and slot.pid:
        base.fds = open_files(slot.pid)
    return base


def sample(slot: Slot, limits: Limits, base: Baseline, *, final: bool = False, walk: bool = True) -> Usage:
    """What the attempt's tree used since ``base``. ``final``: it is over (or being
    killed): every counter is read. ``walk``: False once the child is reaped (its pid
    may be another process's by then). The counters read are the slot's last look
    from then on.

    The tree is walked at every look (:func:`~cyclone_mp.limits.proctree.survey`, about
    10 us a process): its processes are counted (with those the slot's cgroups
    list: the most seen is the attempt's count), each one is checked to be in every
    cgroup of the slot the child is in (:func:`membership`), and with
    ``max_open_files`` its descriptors are counted. Where no cgroup counts them, its
    CPU, memory and tasks are read too. Where cgroups count those, a tree so big that
    its walks would take more than :data:`WALK_SHARE` of the time is walked less
    often (a look every 50 ms at a tree of 100 processes: every 0.05 s; of 1,000:
    every 0.5 s), and the cgroups' counters are read at every look."""
    usage = Usage()
    memory = limits.memory is not None or final
    oom, hits = slot.memory_counters() if memory else (slot.last.oom_kills, slot.last.cap_hits)
    forks = slot.forks_refused() if limits.processes is not None or final else slot.last.fork_failures
    slot.last = Baseline(oom_kills=oom, cap_hits=hits, fork_failures=forks)
    usage.oom_kills, usage.memory_cap_hits = oom - base.oom_kills, hits - base.cap_hits
    usage.fork_failures = forks - base.fork_failures
    cpu_now = cpu_seconds(slot) if limits.cpu is not None or final else None
    stats = not slot.confined or (limits.memory is not None and not slot.memory_file) or (
        limits.processes is not None and not slot.pids_file) or (cpu_now is None and limits.cpu is not None)
    found = None
    started = time.monotonic()
    if slot.pid and walk and (stats or final or started >= base.next_walk):
        found = survey(slot.pid, stats=stats, fds=limits.open_files is not None)
        if not stats:
            base.next_walk = started + (time.monotonic() - started) / WALK_SHARE
    tree = found if stats else None  # its CPU, memory and tasks were read
    if base.cpu is None and limits.cpu is not None and not final:  # the first look: where the CPU count starts
        now = cpu_now if cpu_now is not None else (tree.cpu if tree is not None else None)
        runner = stat(slot.pid) if slot.pid and base.runner_cpu is not None else None
        spent = max(0.0, runner[0] - base.runner_cpu) if runner and base.runner_cpu is not None else 0.0
        base.cpu = None if now is None else now - spent
    if slot.memory_cgroup is not None and memory:
        usage.memory = slot.memory_cgroup.memory_now(slot)
        base.peak = max(base.peak, usage.memory or 0)
        counted = _peak_since(slot, base)
        usage.peak_memory = counted if counted is not None else (base.peak or None)
        if limits.memory is not None and counted is not None:
            # the attempt's own evidence: its peak (restarted when it began) reached its cap
            usage.memory_cap_hits = 1 if counted >= limits.memory else 0
    elif tree is not None:
        usage.memory = tree.rss
        base.peak = max(base.peak, tree.rss)
        usage.peak_memory = base.peak
    if cpu_now is None and tree is not None:
        cpu_now = tree.cpu
    if cpu_now is not None and base.cpu is not None:
        usage.cpu = max(0.0, cpu_now - base.cpu)
    if found is not None:
        processes = set(found.pids)
        if slot.confined:
            listed, usage.left = membership(slot, found.pids)
            processes |= listed
        usage.processes = len(processes)
        if tree is not None:
            usage.tasks = tree.tasks
    if limits.processes is not None and usage.fork_failures and slot.caps[1] is not None and slot.pids_file:
        usage.tasks = to_int(slot.read(slot.pids_file, "pids.current"))  # at its process cap now?
        usage.at_process_cap = usage.tasks is not None and usage.tasks >= slot.caps[1]
    if usage.processes is not None:
        base.processes = max(base.processes, usage.processes)
    if final and base.processes:  # the forensics say the most the tree had
        usage.processes = base.processes
    if limits.open_files is not None:
        if found is not None and found.fds is not None and found.fds > base.open_files:
            base.open_files, base.open_files_pid = found.fds, found.fds_pid
        usage.open_files, usage.open_files_pid = base.open_files or None, base.open_files_pid
        usage.open_files_allowed = None if base.fds is None else base.fds + limits.open_files
    return usage


def membership(slot: Slot, pids: list[int]) -> tuple[set[int], list[tuple[int, str]]]:
    """The processes the slot's cgroups list now, and those of ``pids`` (the attempt's
    tree) that are not in every cgroup of the slot the child is in: ``(pid, where it
    is)``. Each cgroup's listing is one read of a descriptor kept open; a process
    missing from one is looked up in its own ``/proc/PID/cgroup`` (it may have been
    born after the listing, or be a zombie, which a listing leaves out)."""
    keys = [key for key in slot.joined if key in slot.dirs]
    listed: set[int] = set()
    suspects: set[int] = set()
    for key in keys:
        members = slot.cgroup[key].members(slot, key)
        if members is None:
            suspects.update(pids)
            continue
        listed |= members
        suspects.update(pid for pid in pids if pid not in members)
    left = []
    for pid in sorted(suspects):
        where = cgroups_of(pid)
        if where is None:  # gone
            continue
        out = [key for key in keys if not within(where.get(key), slot.dirs[key])]
        if out and not exiting(pid):  # (an exiting process reads as in the root cgroup)
            left.append((pid, " and ".join(f"{HIERARCHY_NAMES[key]} {where.get(key, '?')}" for key in out)))
    return listed, left


def _peak_fd(slot: Slot) -> int | None:
    """One descriptor for the memory peak: v2's ``memory.peak`` resets per open file,
    so it is written and read through the same one (read-only where it cannot be
    written: a v2 kernel before 6.12)."""
    version = slot.memory_cgroup
    if version is None:
        return None
    key, name = version.memory_key, version.peak_file
    fd = slot.fd_of(key, name, os.O_RDWR)
    return fd if fd is not None else slot.fd_of(key, name)


def _restart_peak(slot: Slot, base: Baseline) -> None:
    """The memory cgroup's peak restarts from now for the attempt of ``base``: v1's
    ``memory.max_usage_in_bytes`` by writing 0, v2's ``memory.peak`` by writing to it
    (Linux 6.12+). Where it cannot be written it counts since the cgroup was made: its
    value now is noted, and a later peak is the attempt's only once it is higher."""
    fd = _peak_fd(slot)
    if fd is None:
        return
    try:
        os.pwrite(fd, slot.memory_cgroup.peak_reset, 0)  # type: ignore[union-attr]
        base.peak_reset = True
    except OSError:
        base.peak_floor = _peak(slot)


def _peak_since(slot: Slot, base: Baseline) -> int | None:
    """The memory cgroup's peak, when it is the attempt's of ``base`` (None: not known)."""
    peak = _peak(slot)
    if peak is None or base.peak_reset or (base.peak_floor is not None and peak > base.peak_floor):
        return peak
    return None


def _peak(slot: Slot) -> int | None:
    fd = _peak_fd(slot)
    if fd is None:
        return None
    try:
        return to_int(os.pread(fd, 64, 0).decode())
    except OSError:
        return None
