"""Confining each child slot's process tree: the mechanism a supervisor chose, and its slots.

A supervisor detects once, when it starts (:meth:`Confinement.detect`), the best
mechanism the host offers for each job (:class:`~cyclone_mp.limits.mechanism.Mechanism`,
said in one line at start), and keeps one :class:`~cyclone_mp.limits.slot.Slot` per
child slot. cgroups hold the kill, the caps and the evidence where the supervisor can
create them (root, or a delegated subtree: ``cyclone-mp-<pid>-<tag>`` per hierarchy,
``slot-N`` per slot); elsewhere rlimits (:mod:`cyclone_mp.limits.rlimits`), a user
namespace per child (:mod:`cyclone_mp.limits.userns`) and sampling do.
``CYCLONE_MP_CGROUPS=off``, ``v1`` or ``v2`` narrows the choice. The table of
mechanisms and their fallbacks is in docs/resource-limits.md ("How they are
enforced"); why children are created in their cgroup, in docs/operating.md ("How
children start").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

from .cgroups import PREFIX, Hierarchies, find_hierarchies, read_text, remove_tree, setup_v1, setup_v2
from .kmsg import KMSG, KernelLog
from .mechanism import (CGROUP_COUNTERS, CGROUP_V1, CGROUP_V2, KERNEL_LOG, MEMORY_FALLBACK, PROCESSES_USERNS,
                        SAMPLING, SIGNALS, Mechanism)
from .slot import Slot
from .userns import user_namespaces_refused

log = logging.getLogger("cyclone_mp.supervisor")

#: "off" (or 0, no, false): never use cgroups; "v1" or "v2": only that hierarchy (to run a
#: v1-only or v2-only host's mechanisms on a hybrid one); unset: every one that can be used
CGROUPS_ENV = "CYCLONE_MP_CGROUPS"


class Confinement:
    """A supervisor's confinement: the mechanism, and its slots (see the module docstring).

    Attributes:
        mechanism: the :class:`Mechanism` chosen.
        v2, memory_v1, pids_v1: this supervisor's directory in each hierarchy used, or None.
        v2_controllers: the v2 controllers enabled for the slots (``memory``, ``pids``).
        kernel_log: the kernel's record of OOM kills (:class:`~cyclone_mp.limits.kmsg.KernelLog`).
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
        info, own = read_text(mountinfo), read_text(proc_cgroup)
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

    def slot(self, index: int) -> Slot:
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
        text = read_text(f"/proc/{pid}/cgroup") or ""
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
