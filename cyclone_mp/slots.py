"""Confining each child slot's process tree: its caps, its evidence, its kill.

A supervisor detects once, when it starts (:meth:`Confinement.detect`), the best
mechanism the host offers for each job (:class:`~cyclone_mp.mechanism.Mechanism`, said
in one line at start), and keeps one :class:`Slot` per child slot (a new child takes the
slot of the one it replaces). cgroups hold the kill, the caps and the evidence where the
supervisor can create them (root, or a delegated subtree: ``cyclone-mp-<pid>-<tag>``
per hierarchy, ``slot-N`` per slot); elsewhere rlimits, a user namespace per child and
sampling do. ``CYCLONE_MP_CGROUPS=off``, ``v1`` or ``v2`` narrows the choice.

A child is created in its slot's cgroup (``CLONE_INTO_CGROUP``) rather than moved, since
a move waits for a kernel RCU grace period; it joins v1 caps only once a step needs them.
Sampling happens only while an attempt with a limit runs (every :data:`SAMPLE_INTERVAL`),
so steps without limits pay nothing. The table of mechanisms and their fallbacks is in
docs/resource-limits.md ("How they are enforced"); why children are created in their
cgroup, in docs/operating.md ("How children start").
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from typing import Any, Callable

from . import protocol
from .cgroups import PREFIX, Hierarchies, cgroups_of, find_hierarchies, remove_tree, setup_v1, setup_v2, within
from .cgroups import pid_alive as _pid_alive
from .cgroups import read_text as _read
from .cgroups import rmdir_cgroup as _rmdir
from .cgroups import to_int as _int
from .cgroups import write_text as _write
from .kmsg import KMSG, KernelLog
from .limits import Limits, Usage
from .mechanism import (CGROUP_COUNTERS, CGROUP_V1, CGROUP_V2, KERNEL_LOG, MEMORY_FALLBACK, PROCESSES_USERNS,
                        SAMPLING, SIGNALS, Mechanism)
from .procs import pidfd_kill
from .proctree import exiting as _exiting
from .proctree import open_files as _open_files
from .proctree import stat as _stat
from .proctree import survey as _survey
from .proctree import user_namespaces_refused

log = logging.getLogger("cyclone_mp.supervisor")

#: "off" (or 0, no, false): never use cgroups; "v1" or "v2": only that hierarchy (to run a
#: v1-only or v2-only host's mechanisms on a hybrid one); unset: every one that can be used
CGROUPS_ENV = "CYCLONE_MP_CGROUPS"
SAMPLE_INTERVAL = 0.05  #: seconds between two looks at a running attempt with limits
HIERARCHY_NAMES = {"v2": "cgroup v2", "memory": "memory cgroup", "pids": "pids cgroup"}  #: a slot's cgroups, in words
FREEZE_WAIT = 0.05  #: seconds a tree kill waits for a cgroup to be frozen before it kills anyway
#: the share of process control's time one attempt's walks of its tree may take where
#: cgroups count its memory and CPU (a big tree is then walked less often than it is looked at)
WALK_SHARE = 0.02

# -- counter files ---------------------------------------------------------------------------------


def _fields(text: str | None) -> dict[str, int]:
    """``key value`` lines (memory.events, cpu.stat, memory.oom_control, pids.events)."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _value_after(data: bytes | None, key: bytes, default: Any = 0) -> Any:
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



# -- the supervisor's cgroups -----------------------------------------------------------------------


class Confinement:
    """A supervisor's confinement: the mechanism, and its slots (see the module docstring).

    Attributes:
        mechanism: the :class:`Mechanism` chosen.
        v2, memory_v1, pids_v1: this supervisor's directory in each hierarchy used, or None.
        v2_controllers: the v2 controllers enabled for the slots (``memory``, ``pids``).
        kernel_log: the kernel's record of OOM kills (:class:`~cyclone_mp.kmsg.KernelLog`).
        userns_at_birth: new children are born in user namespaces of their own.
    """

    def __init__(self, *, v2: str | None = None, v2_controllers: frozenset[str] = frozenset(),
                 memory_v1: str | None = None, pids_v1: str | None = None, kill: bool = False,
                 unusable: tuple[str, ...] = (), userns: Callable[[], str | None] = user_namespaces_refused,
                 kmsg: str = KMSG) -> None:
        """``unusable``: why cgroups are not used (for the start line); ``userns``: says why
        children cannot hold ``max_processes`` in user namespaces of their own (None: they
        can), asked only where no pids cgroup holds it; ``kmsg``: the kernel log."""
        self.v2, self.v2_controllers = v2, v2_controllers
        self.memory_v1, self.pids_v1 = memory_v1, pids_v1
        self.v2_kill = kill
        memory = (CGROUP_V2 if "memory" in v2_controllers else CGROUP_V1 if memory_v1 else MEMORY_FALLBACK)
        processes = CGROUP_V2 if "pids" in v2_controllers else CGROUP_V1 if pids_v1 else None
        no_userns = None
        if processes is None:
            no_userns = userns()
            processes = SAMPLING if no_userns else PROCESSES_USERNS
        self.kernel_log = KernelLog(kmsg)  # the kernel's word on an OOM kill (where it can be read)
        oom = " + ".join(([CGROUP_COUNTERS] if memory != MEMORY_FALLBACK else [])
                         + ([KERNEL_LOG] if self.kernel_log.readable else [])) or "none"
        self.mechanism = Mechanism(
            kill=CGROUP_V2 if v2 and kill else SIGNALS, memory=memory, processes=processes,
            cpu=CGROUP_V2 if v2 else SAMPLING, oom=oom, where=tuple(d for d in (v2, memory_v1, pids_v1) if d),
            unusable=unusable, no_userns=no_userns)
        self._slots: dict[int, Slot] = {}
        # Children join the slots' v1 cgroups at birth, not only before an attempt with caps
        # held there: always where v1 must hold the tree (no v2 kill), else once caps are used.
        self.v1_at_birth = not (v2 and kill)
        # Children are born in user namespaces of their own (to hold max_processes there) once
        # a step with max_processes is seen or declared (:meth:`wants_userns`).
        self.userns_at_birth = False

    @classmethod
    def none(cls, why: str = "", **options: Any) -> "Confinement":
        """No cgroups: rlimits in the child, sampling here, signals to kill (``why``: the
        reason, for the start line)."""
        return cls(unusable=(why,) if why else (), **options)

    @classmethod
    def detect(cls, tag: str, *, environ: Any = None, mountinfo: str = "/proc/self/mountinfo",
               proc_cgroup: str = "/proc/self/cgroup", **options: Any) -> "Confinement":
        """Find and set up the best mechanism here (see the module docstring); never raises:
        what cannot be used is left to the fallbacks, and said in the start line
        (:meth:`Mechanism.start_line`). ``environ``'s :data:`CGROUPS_ENV` may turn cgroups
        off or keep one hierarchy only; ``options``: the constructor's."""
        environ = os.environ if environ is None else environ
        wanted = str(environ.get(CGROUPS_ENV, "")).strip().lower()
        if wanted in ("0", "off", "no", "false"):
            return cls.none(f"{CGROUPS_ENV}={environ.get(CGROUPS_ENV)}", **options)
        info, own = _read(mountinfo), _read(proc_cgroup)
        if not info or not own:
            return cls.none(f"cannot read {mountinfo if not info else proc_cgroup}", **options)
        found = find_hierarchies(info, own)
        if wanted in ("v1", "v2"):  # one hierarchy only: as on a host that has no other
            found = Hierarchies(v2=found.v2) if wanted == "v2" else Hierarchies(memory_v1=found.memory_v1,
                                                                                pids_v1=found.pids_v1)
        if not (found.v2 or found.memory_v1 or found.pids_v1):
            return cls.none("no cgroup v2, v1 memory or v1 pids hierarchy of ours is mounted"
                            + (f" ({CGROUPS_ENV}={wanted})" if wanted in ("v1", "v2") else ""), **options)
        name = f"{PREFIX}{os.getpid()}-{tag}"
        why: list[str] = []
        v2 = controllers = None
        kill = False
        if found.v2:
            v2, controllers = setup_v2(found.v2, name, why)
            kill = bool(v2) and os.path.exists(os.path.join(v2, "cgroup.kill"))
        controllers = controllers or frozenset()
        memory_v1 = None if "memory" in controllers else setup_v1(found.memory_v1, name, "memory.limit_in_bytes", why)
        pids_v1 = None if "pids" in controllers else setup_v1(found.pids_v1, name, "pids.max", why)
        return cls(v2=v2, v2_controllers=controllers, memory_v1=memory_v1, pids_v1=pids_v1, kill=kill,
                   unusable=tuple(why), **options)

    def wants_userns(self) -> None:
        """A step with ``max_processes`` is seen (or declared): where children hold it in user
        namespaces of their own, every new child is born in one from now on."""
        if self.mechanism.userns_processes:
            self.userns_at_birth = True

    def userns_failed(self, why: str) -> None:
        """A child could not make its user namespace: ``max_processes`` falls back to
        sampling alone from now on (said once)."""
        if self.mechanism.userns_processes:
            log.warning("a child could not make a user namespace of its own (%s): max_processes falls back to "
                        "sampling alone (a fork burst between two looks is not bounded)", why)
            self.mechanism = dataclasses.replace(self.mechanism, processes=SAMPLING, no_userns=why)
            self.userns_at_birth = False

    @property
    def dirs(self) -> list[tuple[str, str]]:
        """``(hierarchy, directory)`` of this supervisor's cgroups (for the watchdog)."""
        return [(h, d) for h, d in (("v2", self.v2), ("v1", self.memory_v1), ("v1", self.pids_v1)) if d]

    def slot(self, index: int) -> "Slot":
        """Slot ``index`` (created on first use)."""
        slot = self._slots.get(index)
        if slot is None:
            slot = self._slots[index] = Slot(self, index)
        return slot

    def holds(self, pid: int) -> bool:
        """True when process ``pid`` is in one of this supervisor's cgroups (a handler's,
        whatever it did to its environment, session or process group)."""
        if not self.mechanism.where:
            return False
        text = _read(f"/proc/{pid}/cgroup") or ""
        names = {os.path.basename(d) for d in self.mechanism.where}
        return any(f"/{name}/" in line or line.endswith(f"/{name}") for line in text.splitlines() for name in names)

    def close(self, timeout: float = 2.0) -> None:
        """Kill whatever is left in this supervisor's cgroups and remove them."""
        for slot in self._slots.values():
            slot.kill()
            slot.close_fds()
        self.kernel_log.close()
        deadline = time.monotonic() + timeout
        for _, base in self.dirs:
            while not remove_tree(base) and time.monotonic() < deadline:
                for slot in self._slots.values():
                    slot.kill()
                time.sleep(0.01)


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


class Slot:
    """One child slot: its cgroups (if any) and the child now in it (see the module
    docstring). Process control's thread only."""

    def __init__(self, confinement: Confinement, index: int) -> None:
        self.confinement = confinement
        self.index = index
        self.pid: int | None = None
        self.dirs: dict[str, str] = {}  # "v2", "memory", "pids" -> this slot's directory
        self.confined = False  # the child now in the slot is in every cgroup it should be in (wanted)
        self.entering = False  # the child now in the slot moves itself in (it may be in some already)
        self.joined: set[str] = set()  # the keys of the directories the child now in the slot is in
        self.generation = 0  # of the v2 directory: a fresh one per child (prepare)
        self._retired: list[str] = []  # earlier v2 directories not removed yet (a dying process in them)
        self._given: list[str] = []  # the keys of the last entry(): the directories a forked child enters itself
        self._fds: dict[str, int] = {}
        self.caps: tuple[int | None, int | None] = (None, None)  # (memory, pids.max) written now
        self.last = Baseline()  # the counters when last looked at (an attempt without limits is judged against it)
        self.runner_tasks: int | None = None  # the child runner's threads (its tasks under a pids cap)
        mech = confinement.mechanism
        for key, base in zip(protocol.SLOT_CGROUPS, (confinement.v2, confinement.memory_v1, confinement.pids_v1)):
            if base:
                path = os.path.join(base, f"slot-{index}")
                try:
                    os.makedirs(path, exist_ok=True)
                    self.dirs[key] = path
                except OSError as exc:
                    log.error("cannot create the cgroup %s (%s); this slot's child is not confined", path, exc)
        self._memory_v2 = mech.memory == CGROUP_V2
        self._pids_v2 = mech.processes == CGROUP_V2

    @property
    def v2_dir(self) -> str | None:
        """This slot's v2 cgroup (the watchdog kills through it)."""
        return self.dirs.get("v2") if self.confined else None

    @property
    def memory_file(self) -> str | None:
        """Where the child's memory is capped and counted: ``"memory"`` (v1, once it joined
        it), ``"v2"``, or None (the tree is sampled)."""
        if "memory" in self.dirs:
            return "memory" if "memory" in self.joined else None
        return "v2" if self._memory_v2 else None

    @property
    def pids_file(self) -> str | None:
        """Where the child's processes are capped and counted: ``"pids"`` (v1, once it
        joined it), ``"v2"``, or None (sampled)."""
        if "pids" in self.dirs:
            return "pids" if "pids" in self.joined else None
        return "v2" if self._pids_v2 else None

    @property
    def kernel_memory_cap(self) -> bool:
        """The kernel holds the memory cap of the child now in the slot (it is in the cgroup)."""
        return self.confined and self.memory_file is not None

    @property
    def kernel_process_cap(self) -> bool:
        """The kernel holds the process cap of the child now in the slot."""
        return self.confined and self.pids_file is not None

    @property
    def wanted(self) -> list[str]:
        """The keys of the directories a new child enters at once: the v2 one, and the v1
        ones too when :attr:`Confinement.v1_at_birth` (else :meth:`join` adds them)."""
        at_birth = self.confinement.v1_at_birth or "v2" not in self.dirs  # (no v2 cgroup of its own: v1 holds it)
        return [key for key in self.dirs if key == "v2" or at_birth]

    # -- a child in the slot ---------------------------------------------------------------------

    def prepare(self) -> int | None:
        """Before a new child is created in the slot: lift the last attempt's caps (a
        fresh child starts uncapped: it imports its handlers first). Returns a descriptor
        of a cgroup v2 directory of the slot that no process was ever in, to create the
        child in (``CLONE_INTO_CGROUP``: no move, so no grace period), or None (it is
        moved in). Only a new cgroup: on Linux 6.18 a process created in a cgroup that
        ``cgroup.kill`` once emptied is killed at birth (seen here), and a kill may also
        come from the watchdog. So every child after the first gets a fresh directory,
        ``slot-N.G``; the last one is removed once empty."""
        self._lift_caps()
        if "v2" not in self.dirs or (self.pid is not None and not self._renew_v2()):
            return None
        return self._dir_fd("v2")

    def _renew_v2(self) -> bool:
        """Make the next v2 directory of the slot (False: the last one still holds a
        process, or none can be made: the child is moved into the last one)."""
        last = self.dirs["v2"]
        if _read(os.path.join(last, "cgroup.procs")):
            return False
        fresh = os.path.join(os.path.dirname(last), f"slot-{self.index}.{self.generation + 1}")
        try:
            os.mkdir(fresh)
        except OSError as exc:
            log.warning("cannot create the cgroup %s (%s); the next child of slot %d is moved in", fresh, exc,
                        self.index)
            return False
        self.generation += 1
        self.dirs["v2"] = fresh
        for name in [name for name in self._fds if name.startswith("v2")]:
            with contextlib.suppress(OSError):
                os.close(self._fds.pop(name))
        self._retired.append(last)
        self._retired = [path for path in self._retired if not _rmdir(path)]
        return True

    def _lift_caps(self) -> None:
        """Lift the last attempt's caps: a fresh child starts uncapped (it imports its
        handlers first)."""
        if self.caps != (None, None):
            self.confined = True  # (the files are written only while confined)
            self.configure(Limits())

    def entry(self) -> list[tuple[str, int]]:
        """``(key, descriptor)`` of each of the slot's cgroup directories a new child enters
        (:attr:`wanted`), for a forked child to move itself into (``cgroup.procs`` there,
        ``0``: :meth:`enter` with ``by_child``; it skips the v2 one it was created in).
        The descriptors stay the slot's; empty without cgroups or when one cannot be opened
        (the child is then moved from here)."""
        out: list[tuple[str, int]] = []
        for key in self.wanted:
            fd = self._dir_fd(key)
            if fd is None:
                return []
            out.append((key, fd))
        self._given = [key for key, _ in out]  # what it enters (what is wanted may grow meanwhile)
        return out

    def _dir_fd(self, key: str) -> int | None:
        """A descriptor of the slot's directory in hierarchy ``key``, opened once and kept."""
        fd = self._fds.get(f"{key}-dir")
        if fd is None:
            try:
                fd = self._fds[f"{key}-dir"] = os.open(self.dirs[key], os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return None
        return fd

    def enter(self, pid: int, *, born_in_v2: bool = False, by_child: bool = False) -> bool:
        """Move a new child into the slot's cgroups (before it can start anything), but the
        v2 one if it was created there (``born_in_v2``: a move would cost a kernel RCU
        grace period for nothing). ``by_child``: it moves itself (it was given
        :meth:`entry`); only the slot's books are set here, and it counts as confined once
        :meth:`entered` says it is in (meanwhile :attr:`entering`: a kill goes through the
        slot's cgroups too). False when it is not confined (yet): without cgroups it is
        killed with signals and sampled."""
        self.pid = pid
        self.confined = self.entering = False
        if not self.dirs:
            return False
        try:
            self._lift_caps()
            self.confined = False
            self.joined = {"v2"} if born_in_v2 and "v2" in self.dirs else set()
            if by_child:
                self.entering = True
                return False
            self._move(pid, [key for key in self.wanted if key not in self.joined])
        except OSError as exc:
            log.error("cannot move child %d into its cgroup (%s); it is killed with signals", pid, exc)
            self.confined = False
        return self.confined

    def entered(self, pid: int, failed: list[str], error: str | None = None) -> bool:
        """Child ``pid``, which was to move itself (:meth:`enter` with ``by_child``), says
        it is in every cgroup of the slot (``failed`` empty) or which ones it could not
        enter and why (``error``): it is moved into those from here. Returns
        :attr:`confined`."""
        if pid != self.pid or not self.entering:
            return self.confined
        self.joined.update(key for key in self._given if key not in failed)
        try:
            if failed:
                log.warning("child %d could not move itself into its cgroups (%s); moving it", pid, error)
            self._move(pid, [key for key in failed if key in self.dirs])
        except OSError as exc:
            log.error("cannot move child %d into its cgroup (%s); it is killed with signals", pid, exc)
            self.confined = self.entering = False
        return self.confined

    def _move(self, pid: int, keys: list[str]) -> None:
        """Write ``pid`` into the ``cgroup.procs`` of the slot's directories ``keys``; then
        it is confined, and the slot's counters are its baseline. Raises OSError."""
        for key in keys:
            _write(os.path.join(self.dirs[key], "cgroup.procs"), str(pid))
            self.joined.add(key)
        self.confined, self.entering = True, False
        self._rebase()

    def _rebase(self) -> None:
        """The slot's counters as they stand are its child's baseline (an OOM kill or a
        refused fork of an earlier child is not its doing)."""
        self.last = Baseline()
        self.last.oom_kills, self.last.cap_hits = self._memory_counters()
        self.last.fork_failures = self._forks_refused()
        self.runner_tasks = None

    def unjoined(self, limits: Limits) -> list[str]:
        """The keys of the slot's v1 cgroups that hold caps of ``limits`` (``memory`` for
        ``memory_limit``, ``pids`` for ``max_processes``) and that its child is not in."""
        if not self.confined or self.pid is None:
            return []
        return [key for key, cap in (("memory", limits.memory), ("pids", limits.processes))
                if cap is not None and key in self.dirs and key not in self.joined]

    def join(self, keys: list[str]) -> None:
        """Move the slot's idle child into its v1 cgroups ``keys`` (:meth:`unjoined`) before
        an attempt with those caps starts. This thread waits for the move (a kernel RCU
        grace period, once per child). When the move fails those caps are sampled."""
        try:
            self._move(self.pid, keys)  # type: ignore[arg-type]
        except OSError as exc:
            log.error("cannot move child %d into its %s cgroup (%s); its caps are sampled", self.pid,
                      " and ".join(keys), exc)
            self._rebase()  # for the cgroup it did join

    def _file(self, key: str, name: str) -> str | None:
        path = self.dirs.get(key)
        return os.path.join(path, name) if path and (self.confined or self.entering) else None

    def _fd(self, key: str, name: str, flags: int = os.O_RDONLY) -> int | None:
        """A descriptor of a file of this slot, opened once and kept (None: no such file)."""
        cache = f"{key}/{name}/{flags}"
        fd = self._fds.get(cache)
        if fd is None:
            path = self._file(key, name)
            if path is None:
                return None
            try:
                fd = self._fds[cache] = os.open(path, flags)
            except OSError:
                return None
        return fd

    def _pread_bytes(self, key: str, name: str) -> bytes | None:
        """Read a file of this slot through a descriptor kept open (about 2 us)."""
        fd = self._fd(key, name)
        if fd is None:
            return None
        try:
            return os.pread(fd, 4096, 0)
        except OSError:
            return None

    def _pread(self, key: str, name: str) -> str | None:
        data = self._pread_bytes(key, name)
        return None if data is None else data.decode()

    def configure(self, limits: Limits) -> bool:
        """Set the kernel's caps for the next attempt (written only when they change).
        False when the memory cap is below what the (reused) child uses already: it must
        be replaced by a fresh one first."""
        if not self.confined:
            return True
        memory = limits.memory if self.memory_file else None
        tasks = None
        if limits.processes is not None and self.pids_file:
            if self.runner_tasks is None:  # its threads, once (read each time, it cost more than the rest)
                stat = _stat(self.pid) if self.pid else None
                self.runner_tasks = stat[1] if stat else 2
            tasks = limits.processes + max(0, self.runner_tasks - 1)  # the runner counts as one process, whatever its threads
        if (memory, tasks) == self.caps:
            return True
        try:
            if memory != self.caps[0] and self.memory_file:
                if memory is not None and self._runner_memory() > memory:
                    return False  # the kernel would reclaim, then OOM-kill the idle child: replace it instead
                if self.memory_file == "v2":
                    _write(self._file("v2", "memory.max") or "", "max" if memory is None else str(memory))
                else:
                    try:
                        _write(self._file("memory", "memory.limit_in_bytes") or "", "-1" if memory is None else str(memory))
                    except OSError as exc:
                        if exc.errno == errno.EBUSY:
                            return False  # cannot reclaim below the cap: the child holds more already
                        raise
            if tasks != self.caps[1] and self.pids_file:
                _write(self._file(self.pids_file, "pids.max") or "", "max" if tasks is None else str(tasks))
        except OSError as exc:
            log.error("cannot set the caps of slot %d (%s); its attempt runs with sampling only", self.index, exc)
            self.caps = (None, None)
            return True
        self.caps = (memory, tasks)
        return True

    def _runner_memory(self) -> int:
        """What the slot's child holds now, in bytes: the larger of its cgroup's charge and
        its own RSS (on v1, pages it touched before it joined the slot stay charged
        elsewhere: the charge alone let a 1 MiB cap pass)."""
        charged = _int(self._pread("v2", "memory.current")) if self.memory_file == "v2" else None
        stat = _stat(self.pid) if self.pid else None
        return max(charged or 0, stat[2] if stat else 0)

    def _memory_counters(self) -> tuple[int, int]:
        """(OOM kills, memory cap hits) in this slot so far (v1: the hits are judged from
        the peak instead, see :meth:`sample`)."""
        if self.memory_file == "v2":
            events = _fields(self._pread("v2", "memory.events"))
            return events.get("oom_kill", 0), events.get("oom", 0) + events.get("max", 0)
        if self.memory_file == "memory":  # "oom_kill_disable 0\nunder_oom 0\noom_kill N\n"
            return _value_after(self._pread_bytes("memory", "memory.oom_control"), b"oom_kill "), 0
        return 0, 0

    def _forks_refused(self) -> int:
        return _value_after(self._pread_bytes(self.pids_file, "pids.events"), b"max ") if self.pids_file else 0

    def _cpu(self) -> float | None:
        if self.confined and "v2" in self.dirs:
            usec = _value_after(self._pread_bytes("v2", "cpu.stat"), b"usage_usec ", None)
            if usec is not None:
                return usec / 1e6
        return None

    def _peak_fd(self) -> int | None:
        """One descriptor for the memory peak: v2's ``memory.peak`` resets per open file,
        so it is written and read through the same one (read-only where it cannot be
        written: a v2 kernel before 6.12)."""
        key, name = ("v2", "memory.peak") if self.memory_file == "v2" else ("memory", "memory.max_usage_in_bytes")
        fd = self._fd(key, name, os.O_RDWR)
        return fd if fd is not None else self._fd(key, name)

    def _restart_peak(self, base: Baseline) -> None:
        """The memory cgroup's peak restarts from now for the attempt of ``base``: v1's
        ``memory.max_usage_in_bytes`` by writing 0, v2's ``memory.peak`` by writing to it
        (Linux 6.12+). Where it cannot be written it counts since the cgroup was made: its
        value now is noted, and a later peak is the attempt's only once it is higher."""
        fd = self._peak_fd()
        if fd is None:
            return
        try:
            os.pwrite(fd, b"reset" if self.memory_file == "v2" else b"0", 0)
            base.peak_reset = True
        except OSError:
            base.peak_floor = self._peak()

    def _peak_since(self, base: Baseline) -> int | None:
        """The memory cgroup's peak, when it is the attempt's of ``base`` (None: not known)."""
        peak = self._peak()
        if peak is None or base.peak_reset or (base.peak_floor is not None and peak > base.peak_floor):
            return peak
        return None

    def _peak(self) -> int | None:
        fd = self._peak_fd()
        if fd is None:
            return None
        try:
            return _int(os.pread(fd, 64, 0).decode())
        except OSError:
            return None

    def begin(self, limits: Limits, runner_cpu: float | None = None) -> Baseline:
        """An attempt with ``limits`` starts now in this slot: where its counters start.

        Little is read here (this is every limited attempt's cost: a few microseconds):
        the counters start from the slot's last look; the memory cgroup's peak restarts
        (whatever the caps: every attempt's forensics read it, and the last attempt's
        peak is not this one's); with ``max_open_files``, the child's descriptors are
        counted (what its ``RLIMIT_NOFILE`` is set from, so what each process of the
        tree may hold). So an OOM kill or a refused fork is blamed on this attempt only
        with its own evidence beside it: its peak reached its memory cap, its tree is at
        its process cap (:meth:`sample`). The CPU counter is read at the first look (most
        attempts end before it), less what the child itself used since it started the
        attempt (``runner_cpu``: its CPU seconds then)."""
        last = self.last
        base = Baseline(oom_kills=last.oom_kills, cap_hits=last.cap_hits, fork_failures=last.fork_failures,
                        runner_cpu=runner_cpu)
        if self.memory_file and self.confined:
            self._restart_peak(base)
        if limits.open_files is not None and self.pid:
            base.fds = _open_files(self.pid)
        return base

    def sample(self, limits: Limits, base: Baseline, *, final: bool = False, walk: bool = True) -> Usage:
        """What the attempt's tree used since ``base``. ``final``: it is over (or being
        killed): every counter is read. ``walk``: False once the child is reaped (its pid
        may be another process's by then). The counters read are the slot's last look
        from then on.

        The tree is walked at every look (:func:`~cyclone_mp.proctree.survey`, about
        10 us a process): its processes are counted (with those the slot's cgroups
        list: the most seen is the attempt's count), each one is checked to be in every
        cgroup of the slot the child is in (:meth:`membership`), and with
        ``max_open_files`` its descriptors are counted. Where no cgroup counts them, its
        CPU, memory and tasks are read too. Where cgroups count those, a tree so big that
        its walks would take more than :data:`WALK_SHARE` of the time is walked less
        often (a look every 50 ms at a tree of 100 processes: every 0.05 s; of 1,000:
        every 0.5 s), and the cgroups' counters are read at every look."""
        usage = Usage()
        memory = limits.memory is not None or final
        oom, hits = self._memory_counters() if memory else (self.last.oom_kills, self.last.cap_hits)
        forks = self._forks_refused() if limits.processes is not None or final else self.last.fork_failures
        self.last = Baseline(oom_kills=oom, cap_hits=hits, fork_failures=forks)
        usage.oom_kills, usage.memory_cap_hits = oom - base.oom_kills, hits - base.cap_hits
        usage.fork_failures = forks - base.fork_failures
        cpu_now = self._cpu() if limits.cpu is not None or final else None
        stats = not self.confined or (limits.memory is not None and not self.memory_file) or (
            limits.processes is not None and not self.pids_file) or (cpu_now is None and limits.cpu is not None)
        found = None
        started = time.monotonic()
        if self.pid and walk and (stats or final or started >= base.next_walk):
            found = _survey(self.pid, stats=stats, fds=limits.open_files is not None)
            if not stats:
                base.next_walk = started + (time.monotonic() - started) / WALK_SHARE
        tree = found if stats else None  # its CPU, memory and tasks were read
        if base.cpu is None and limits.cpu is not None and not final:  # the first look: where the CPU count starts
            now = cpu_now if cpu_now is not None else (tree.cpu if tree is not None else None)
            runner = _stat(self.pid) if self.pid and base.runner_cpu is not None else None
            spent = max(0.0, runner[0] - base.runner_cpu) if runner and base.runner_cpu is not None else 0.0
            base.cpu = None if now is None else now - spent
        if self.memory_file and memory:
            usage.memory = _int(self._pread("v2", "memory.current") if self.memory_file == "v2"
                                else self._pread("memory", "memory.usage_in_bytes"))
            base.peak = max(base.peak, usage.memory or 0)
            counted = self._peak_since(base)
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
            if self.confined:
                listed, usage.left = self.membership(found.pids)
                processes |= listed
            usage.processes = len(processes)
            if tree is not None:
                usage.tasks = tree.tasks
        if limits.processes is not None and usage.fork_failures and self.caps[1] is not None and self.pids_file:
            usage.tasks = _int(self._pread(self.pids_file, "pids.current"))  # at its process cap now?
            usage.at_process_cap = usage.tasks is not None and usage.tasks >= self.caps[1]
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

    def membership(self, pids: list[int]) -> tuple[set[int], list[tuple[int, str]]]:
        """The processes the slot's cgroups list now, and those of ``pids`` (the attempt's
        tree) that are not in every cgroup of the slot the child is in: ``(pid, where it
        is)``. Each cgroup's listing is one read of a descriptor kept open; a process
        missing from one is looked up in its own ``/proc/PID/cgroup`` (it may have been
        born after the listing, or be a zombie, which a listing leaves out)."""
        keys = [key for key in self.joined if key in self.dirs]
        listed: set[int] = set()
        suspects: set[int] = set()
        for key in keys:
            members = self._members(key)
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
            out = [key for key in keys if not within(where.get(key), self.dirs[key])]
            if out and not _exiting(pid):  # (an exiting process reads as in the root cgroup)
                left.append((pid, " and ".join(f"{HIERARCHY_NAMES[key]} {where.get(key, '?')}" for key in out)))
        return listed, left

    def _members(self, key: str) -> set[int] | None:
        """The processes in the slot's cgroup ``key`` now. v2's listing is read through a
        descriptor kept open (2 us; one cut short by the read leaves the rest to
        :meth:`membership`'s own look); a v1 one is opened each time (3 us): read again
        through the same descriptor, it repeats its first listing."""
        if key != "v2":
            path = self._file(key, "cgroup.procs")
            text = _read(path) if path else None
            return None if text is None else {int(p) for p in text.split()}
        data = self._pread_bytes(key, "cgroup.procs")
        if data is None:
            return None
        return {int(p) for p in data[:data.rfind(b"\n") + 1].split()}

    def procs(self) -> list[int] | None:
        """The processes in this slot's cgroup now (None: no cgroup)."""
        for key in ("v2", "pids", "memory"):
            path = self._file(key, "cgroup.procs")
            if path:
                text = _read(path)
                if text is not None:
                    return [int(p) for p in text.split()]
        return None

    def populated(self) -> bool:
        """Something still runs in this slot's cgroups (False without cgroups)."""
        listed = self.procs()
        return bool(listed)

    def kill(self) -> list[int]:
        """Kill every process in the slot's cgroups; returns their pids (to reap). With
        cgroup v2 the cgroup is frozen, listed and killed with ``cgroup.kill`` (no fork
        can race it); with v1 only, each listed process is killed through a pidfd until
        none is left. Empty without cgroups (the caller kills with signals)."""
        if not (self.confined or self.entering):
            return []
        v2 = self.dirs.get("v2")
        if v2 and self.confinement.v2_kill:
            frozen = False
            with contextlib.suppress(OSError):
                _write(os.path.join(v2, "cgroup.freeze"), "1")
                frozen = True
            if frozen:
                deadline = time.monotonic() + FREEZE_WAIT
                while "frozen 1" not in (_read(os.path.join(v2, "cgroup.events")) or "frozen 1"):
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.001)
            pids = self.procs() or []
            with contextlib.suppress(OSError):
                _write(os.path.join(v2, "cgroup.kill"), "1")
            if frozen:
                with contextlib.suppress(OSError):
                    _write(os.path.join(v2, "cgroup.freeze"), "0")
            return pids

        hit: set[int] = set()
        for _ in range(50):  # a v1 cgroup cannot be killed at once: until nothing is left (pids.max bounds forks)
            listed = [p for p in (self.procs() or []) if p not in hit or _pid_alive(p)]
            if not listed:
                break
            for pid in listed:
                pidfd_kill(pid)
                hit.add(pid)
            time.sleep(0.001)
        return sorted(hit)

    def close_fds(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


# -- used by the watchdog once the supervisor is gone -------------------------------------------------


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
                    _write(os.path.join(base, "cgroup.kill"), "1")
            for sub in _subdirs(base) + [base]:
                pids = (_read(os.path.join(sub, "cgroup.procs")) or "").split()
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
