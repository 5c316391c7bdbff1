"""Which mechanism holds each resource cap on this host, in the words operators read.

:class:`Mechanism` is what :meth:`cyclone_mp.limits.confinement.Confinement.detect` chose: by cgroup
where the supervisor can write one, else by a fallback (an rlimit in the child and the
tree sampled by the supervisor). It is shown by ``cyclone-mp workers`` (the registry's
``limits``), written into every error entry it judged (``enforced_by``) and said once at
start (:meth:`Mechanism.start_line`): one line naming, for each cap that a cgroup does
not hold, what holds it instead. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

CGROUP_V2, CGROUP_V1 = "cgroup v2", "cgroup v1"
SAMPLING, RLIMIT, SIGNALS = "sampling", "rlimit", "signals"
MEMORY_FALLBACK = f"{RLIMIT} + {SAMPLING}"  #: RLIMIT_DATA in each process, the tree's RSS sampled
#: RLIMIT_NPROC in a user namespace of each child's own (the kernel counts the tree's tasks
#: there only), one above the cap, and the tree sampled
PROCESSES_USERNS = f"{RLIMIT} in a user namespace + {SAMPLING}"
#: RLIMIT_NOFILE, soft and hard, in each process, and the tree's descriptors sampled (root
#: may raise a hard limit: no cgroup counts descriptors)
OPEN_FILES_MECHANISM = f"{RLIMIT} + {SAMPLING}"
KERNEL_LOG, CGROUP_COUNTERS = "kernel log", "cgroup counters"
CGROUPS = (CGROUP_V2, CGROUP_V1)


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """How each job is done on this host (see :mod:`cyclone_mp.limits.confinement`).

    Attributes:
        kill: ``"cgroup v2"`` (freeze, list, ``cgroup.kill``) or ``"signals"``.
        memory: ``"cgroup v2"``, ``"cgroup v1"`` or ``"rlimit + sampling"``.
        processes: ``"cgroup v2"``, ``"cgroup v1"``, ``"rlimit in a user namespace +
            sampling"`` or ``"sampling"`` (alone: a fork burst between two looks is not
            bounded).
        cpu: ``"cgroup v2"`` (``cpu.stat``, sampled) or ``"sampling"`` (``/proc``, with
            ``RLIMIT_CPU`` as a backstop).
        open_files: ``"rlimit + sampling"`` everywhere: ``RLIMIT_NOFILE``, soft and hard
            (an ordinary user's handler cannot raise a hard limit; root's can), and the
            descriptors of the tree's processes counted at every look.
        oom: the evidence an OOM kill is named from: ``"cgroup counters"`` (a slot's
            memory cgroup), ``"kernel log"`` (``/dev/kmsg``), both, or ``"none"``.
        where: the supervisor's cgroup directories.
        unusable: why cgroups are not used, one phrase per hierarchy (for the start line).
        no_userns: why a child cannot hold ``max_processes`` with RLIMIT_NPROC in a user
            namespace of its own (None: it can, or a cgroup holds the cap).
    """

    kill: str = SIGNALS
    memory: str = MEMORY_FALLBACK
    processes: str = SAMPLING
    cpu: str = SAMPLING
    open_files: str = OPEN_FILES_MECHANISM
    oom: str = "none"
    where: tuple[str, ...] = ()
    unusable: tuple[str, ...] = ()
    no_userns: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kill": self.kill, "memory": self.memory, "processes": self.processes, "cpu": self.cpu,
                "open_files": self.open_files, "oom": self.oom, "cgroups": list(self.where)}

    def describe(self) -> str:
        """Every job's mechanism, in one line."""
        return (f"tree kill by {self.kill}; memory_limit by {self.memory}; max_processes by {self.processes}; "
                f"cpu_limit by {self.cpu} (sampled); max_open_files by {self.open_files}; {self.oom_words()}"
                + (f"; cgroups {', '.join(self.where)}" if self.where else ""))

    def oom_words(self) -> str:
        """Where an OOM kill of a child is read from, in words."""
        if self.oom == "none":
            return "OOM evidence: none readable here (a SIGKILL nobody here sent is child_exited)"
        return f"OOM evidence: {self.oom}"

    @property
    def kernel_memory_cap(self) -> bool:
        return self.memory in CGROUPS

    @property
    def kernel_process_cap(self) -> bool:
        return self.processes in CGROUPS

    @property
    def userns_processes(self) -> bool:
        """Children hold ``max_processes`` with RLIMIT_NPROC in a user namespace of their own."""
        return self.processes == PROCESSES_USERNS

    def fallbacks(self) -> list[tuple[str, str]]:
        """``(cap, what holds it instead)`` for each cap no cgroup holds, in words."""
        out = []
        if not self.kernel_memory_cap:
            out.append(("memory_limit", "RLIMIT_DATA + sampling"))
        if self.userns_processes:
            out.append(("max_processes", "RLIMIT_NPROC in a user namespace per child + sampling"))
        elif not self.kernel_process_cap:
            out.append(("max_processes", "sampling alone (a fork burst between two looks, 50 ms apart, is not "
                                         f"bounded: {self.no_userns or 'no pids cgroup'})"))
        if self.cpu not in CGROUPS:
            out.append(("cpu_limit", "RLIMIT_CPU + sampling"))
        return out

    def start_line(self) -> tuple[int, str]:
        """``(log level, line)`` said once when the supervisor starts: every cap's mechanism,
        and for each that no cgroup holds, what holds it instead (then a warning)."""
        fallen = self.fallbacks()
        if not fallen:
            return logging.INFO, f"resource limits: {self.describe()}"
        why = f" ({'; '.join(self.unusable)})" if self.unusable else ""
        parts = [f"{cap} {'falls back ' if n == 0 else ''}to {what}" for n, (cap, what) in enumerate(fallen)]
        if not self.where:
            head = f"no writable cgroup{why}"
        else:
            held = [cap for cap, ok in (("memory_limit", self.kernel_memory_cap),
                                        ("max_processes", self.kernel_process_cap),
                                        ("cpu_limit", self.cpu in CGROUPS)) if ok]
            head = f"cgroups hold {', '.join(held) or 'no cap'}{why}"
        return logging.WARNING, (f"resource limits: {head}: {', '.join(parts)}; max_open_files by RLIMIT_NOFILE + "
                                 f"sampling; tree kills by {self.kill}; {self.oom_words()}")
