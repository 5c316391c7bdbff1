"""One child slot: its cgroups, the child now in it, its caps and its kill.

A :class:`Slot` per child slot of a :class:`~cyclone_mp.limits.confinement.Confinement`
(a new child takes the slot of the one it replaces). A child is created in its slot's
v2 cgroup (``CLONE_INTO_CGROUP``) rather than moved, since a move waits for a kernel RCU
grace period; it joins v1 caps only once a step needs them (:meth:`Slot.join`). Before
each attempt the kernel's caps are written (:meth:`Slot.configure`); its tree is
sampled (:mod:`cyclone_mp.limits.sampling`) and killed (:meth:`Slot.kill`) through the
cgroup version chosen for each job when the slot is made
(:mod:`cyclone_mp.limits.cgroup_version`). Process control's thread only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

from ..protocol import SLOT_CGROUPS
from . import sampling
from .cgroup_v1 import V1
from .cgroup_v2 import V2
from .cgroup_version import CgroupVersion
from .cgroups import read_text, rmdir_cgroup, value_after, write_text
from .declared import Limits
from .mechanism import CGROUP_V2
from .procfs import stat
from .sampling import Baseline
from .verdicts import Usage

if TYPE_CHECKING:
    from .confinement import Confinement

log = logging.getLogger("cyclone_mp.supervisor")


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
        for key, base in zip(SLOT_CGROUPS, (confinement.v2, confinement.memory_v1, confinement.pids_v1)):
            if base:
                path = os.path.join(base, f"slot-{index}")
                try:
                    os.makedirs(path, exist_ok=True)
                    self.dirs[key] = path
                except OSError as exc:
                    log.error("cannot create the cgroup %s (%s); this slot's child is not confined", path, exc)
        # The cgroup version of each directory, the one holding the memory cap and the one
        # killing the tree: chosen here, once (cgroup_version.py).
        self.cgroup: dict[str, CgroupVersion] = {key: V2 if key == "v2" else V1 for key in self.dirs}
        self._memory: CgroupVersion | None = (V1 if "memory" in self.dirs else V2 if mech.memory == CGROUP_V2 else None)
        self._killer: CgroupVersion = V2 if "v2" in self.dirs and confinement.v2_kill else V1
        self._pids_v2 = mech.processes == CGROUP_V2

    @property
    def v2_dir(self) -> str | None:
        """This slot's v2 cgroup (the watchdog kills through it)."""
        return self.dirs.get("v2") if self.confined else None

    @property
    def memory_file(self) -> str | None:
        """Where the child's memory is capped and counted: ``"memory"`` (v1, once it joined
        it), ``"v2"``, or None (the tree is sampled)."""
        version = self.memory_cgroup
        return version.memory_key if version is not None else None

    @property
    def memory_cgroup(self) -> CgroupVersion | None:
        """The cgroup version holding the child's memory cap now (None: it is sampled)."""
        version = self._memory
        return version if version is not None and version.holds_memory(self) else None

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
        if read_text(os.path.join(last, "cgroup.procs")):
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
        self._retired = [path for path in self._retired if not rmdir_cgroup(path)]
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
            write_text(os.path.join(self.dirs[key], "cgroup.procs"), str(pid))
            self.joined.add(key)
        self.confined, self.entering = True, False
        self._rebase()

    def _rebase(self) -> None:
        """The slot's counters as they stand are its child's baseline (an OOM kill or a
        refused fork of an earlier child is not its doing)."""
        self.last = Baseline()
        self.last.oom_kills, self.last.cap_hits = self.memory_counters()
        self.last.fork_failures = self.forks_refused()
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

    def path_of(self, key: str, name: str) -> str | None:
        path = self.dirs.get(key)
        return os.path.join(path, name) if path and (self.confined or self.entering) else None

    def fd_of(self, key: str, name: str, flags: int = os.O_RDONLY) -> int | None:
        """A descriptor of a file of this slot, opened once and kept (None: no such file)."""
        cache = f"{key}/{name}/{flags}"
        fd = self._fds.get(cache)
        if fd is None:
            path = self.path_of(key, name)
            if path is None:
                return None
            try:
                fd = self._fds[cache] = os.open(path, flags)
            except OSError:
                return None
        return fd

    def read_bytes(self, key: str, name: str) -> bytes | None:
        """Read a file of this slot through a descriptor kept open (about 2 us)."""
        fd = self.fd_of(key, name)
        if fd is None:
            return None
        try:
            return os.pread(fd, 4096, 0)
        except OSError:
            return None

    def read(self, key: str, name: str) -> str | None:
        data = self.read_bytes(key, name)
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
                info = stat(self.pid) if self.pid else None
                self.runner_tasks = info[1] if info else 2
            tasks = limits.processes + max(0, self.runner_tasks - 1)  # the runner counts as one process, whatever its threads
        if (memory, tasks) == self.caps:
            return True
        try:
            if memory != self.caps[0] and self.memory_file:
                if memory is not None and self._runner_memory() > memory:
                    return False  # the kernel would reclaim, then OOM-kill the idle child: replace it instead
                if not self.memory_cgroup.set_memory_cap(self, memory):  # type: ignore[union-attr]
                    return False  # cannot reclaim below the cap: the child holds more already
            if tasks != self.caps[1] and self.pids_file:
                write_text(self.path_of(self.pids_file, "pids.max") or "", "max" if tasks is None else str(tasks))
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
        version = self.memory_cgroup
        charged = version.charged(self) if version is not None else None
        info = stat(self.pid) if self.pid else None
        return max(charged or 0, info[2] if info else 0)

    def memory_counters(self) -> tuple[int, int]:
        """(OOM kills, memory cap hits) in this slot so far (v1: the hits are judged from
        the peak instead, see :func:`~cyclone_mp.limits.sampling.sample`)."""
        version = self.memory_cgroup
        return version.memory_counters(self) if version is not None else (0, 0)

    def forks_refused(self) -> int:
        """Forks the slot's pids cgroup refused so far (0: none holds its processes)."""
        return value_after(self.read_bytes(self.pids_file, "pids.events"), b"max ") if self.pids_file else 0

    # -- sampling (sampling.py) ------------------------------------------------------------------

    def begin(self, limits: Limits, runner_cpu: float | None = None) -> Baseline:
        """An attempt with ``limits`` starts now in this slot: where its counters start
        (:func:`~cyclone_mp.limits.sampling.begin`)."""
        return sampling.begin(self, limits, runner_cpu)

    def sample(self, limits: Limits, base: Baseline, *, final: bool = False, walk: bool = True) -> Usage:
        """What the attempt's tree used since ``base`` (:func:`~cyclone_mp.limits.sampling.sample`)."""
        return sampling.sample(self, limits, base, final=final, walk=walk)

    def membership(self, pids: list[int]) -> tuple[set[int], list[tuple[int, str]]]:
        """The processes the slot's cgroups list now, and those of ``pids`` out of them
        (:func:`~cyclone_mp.limits.sampling.membership`)."""
        return sampling.membership(self, pids)

    def procs(self) -> list[int] | None:
        """The processes in this slot's cgroup now (None: no cgroup)."""
        for key in ("v2", "pids", "memory"):
            path = self.path_of(key, "cgroup.procs")
            if path:
                text = read_text(path)
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
        return self._killer.kill(self)

    def close_fds(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
