"""The cause of a death, from the evidence about an attempt's own tree: decisions, no I/O.

:class:`Usage` is what the sampling (:mod:`cyclone_mp.limits.sampling`) found;
:func:`over_limit` decides while the attempt runs (its tree is then killed) and
:func:`cause_of_death` once its child is dead or its handler failed;
:func:`death_summary` and :func:`death_message` say it in the error entry. See
docs/resource-limits.md.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

from ..decisions import CPU_LIMIT, MEMORY_LIMIT, OOM_KILLED, PROCESS_LIMIT
from .declared import LEFT_CGROUPS, OPEN_FILES, Limits, format_size, kind_of


@dataclasses.dataclass
class Usage:
    """What an attempt's tree used, as far as the mechanism tells (None: unknown).

    ``memory``/``peak_memory``: bytes now / the most since the attempt began;
    ``cpu``: CPU seconds of the tree since the attempt began; ``processes``: processes of
    the tree now (``tasks``: with their threads); ``oom_kills``: kills by the kernel's OOM
    killer inside the tree since the attempt began, ``memory_cap_hits``: the tree reached
    its own memory cap (not the machine's or a parent's); ``fork_failures``: forks refused
    at the process cap, ``at_process_cap``: the tree is at that cap now (a pids cgroup);
    ``at_process_rlimit``: the tree reached its ``RLIMIT_NPROC`` (set one over its cap, in
    the child's user namespace: it was over its cap, and a fork past it was refused);
    ``open_files``: the most descriptors one process of the tree held (``open_files_pid``),
    ``open_files_allowed``: the most its ``RLIMIT_NOFILE`` lets one hold (the child's own
    descriptors when the attempt began, plus ``max_open_files``); ``left``: processes of
    the tree outside the slot's cgroups, ``(pid, where it is now)``.
    """

    memory: int | None = None
    peak_memory: int | None = None
    cpu: float | None = None
    processes: int | None = None
    tasks: int | None = None
    oom_kills: int = 0
    memory_cap_hits: int = 0
    fork_failures: int = 0
    at_process_cap: bool = False
    at_process_rlimit: bool = False
    open_files: int | None = None
    open_files_pid: int | None = None
    open_files_allowed: int | None = None
    left: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def over_open_files(self) -> bool:
        """A process of the tree holds more descriptors than its ``RLIMIT_NOFILE`` allowed:
        it raised the limit (the kernel refuses every descriptor past it otherwise)."""
        return (self.open_files is not None and self.open_files_allowed is not None
                and self.open_files > self.open_files_allowed)

    def forensics(self) -> dict[str, Any]:
        """The ``tree`` of an error entry: ``peak_memory_kb``, ``cpu_seconds``, ``processes``."""
        out: dict[str, Any] = {}
        if self.peak_memory is not None or self.memory is not None:
            out["peak_memory_kb"] = int(max(self.peak_memory or 0, self.memory or 0) // 1024)
        if self.cpu is not None:
            out["cpu_seconds"] = round(self.cpu, 3)
        if self.processes is not None:
            out["processes"] = self.processes
        if self.open_files is not None:
            out["open_files"] = self.open_files
        return out


def note_tree_count(usage: Usage, count: dict[str, Any]) -> None:
    """Add a child's count of its tree as its handler ended (``processes``, ``tasks``, and
    ``nproc``: the ``RLIMIT_NPROC`` it ran under, or None) to ``usage``: the most processes
    seen, and whether the tree was at that rlimit."""
    processes, tasks, nproc = count.get("processes"), count.get("tasks"), count.get("nproc")
    if isinstance(processes, int):
        usage.processes = max(usage.processes or 0, processes)
    if isinstance(tasks, int):
        usage.tasks = max(usage.tasks or 0, tasks)
        usage.at_process_rlimit = usage.at_process_rlimit or (isinstance(nproc, int) and tasks >= nproc)


def over_process_cap(limits: Limits, usage: Usage) -> bool:
    """Where no pids cgroup holds ``max_processes``: the tree was seen with more processes
    than its cap, or at its ``RLIMIT_NPROC`` (one over the cap)."""
    return limits.processes is not None and (
        usage.at_process_rlimit or (usage.processes is not None and usage.processes > limits.processes))


def over_limit(limits: Limits, usage: Usage, *, kernel_memory_cap: bool, kernel_process_cap: bool) -> str | None:
    """The cap a running attempt broke, or the trigger it set off (its tree is then
    killed), or None.

    A process of the tree out of the slot's cgroups comes first (:data:`LEFT_CGROUPS`:
    what the cgroups count no longer covers the tree). With a kernel memory cap (a cgroup) the memory cannot cross it: an OOM kill inside
    the tree, with the tree's peak at its cap, is the evidence (the tree is killed whole,
    as the kernel would not). With a kernel process cap, a refused fork with the tree at
    its cap is. Otherwise the sampled values decide (a tree at its ``RLIMIT_NPROC``, one
    over its cap, is over it). (An OOM kill without the tree at its own cap is the
    machine's doing: the tree is left to live on, and judged if it dies.) A process holding
    more descriptors than its ``RLIMIT_NOFILE`` allowed raised it: :data:`OPEN_FILES`.
    """
    if usage.left:
        return LEFT_CGROUPS
    if limits.memory is not None and usage.oom_kills and usage.memory_cap_hits:
        return MEMORY_LIMIT
    if limits.memory is not None and not kernel_memory_cap and usage.memory is not None and usage.memory > limits.memory:
        return MEMORY_LIMIT
    if limits.processes is not None:
        if usage.fork_failures and (usage.at_process_cap or not kernel_process_cap):
            return PROCESS_LIMIT
        if not kernel_process_cap and over_process_cap(limits, usage):
            return PROCESS_LIMIT
    if limits.open_files is not None and usage.over_open_files:
        return OPEN_FILES
    if limits.cpu is not None and usage.cpu is not None and usage.cpu >= limits.cpu:
        return CPU_LIMIT
    return None


def cause_of_death(limits: Limits, usage: Usage, *, exit_signal: int | None, killed_for: str | None,
                   memory_error: bool = False, memory_by_rlimit: bool = False, oom_logged: bool = False,
                   kernel_process_cap: bool = False) -> str | None:
    """What ended an attempt, or None (then it is ``child_exited`` or what the handler reported).

    ``killed_for``: the cap (or trigger) the supervisor killed the tree for wins: its
    kind (:func:`kind_of`). Otherwise the
    evidence about the attempt's own processes: an OOM kill inside the tree, counted by
    its cgroup (at its own memory cap: ``memory_limit``, else ``oom_killed``); a peak past
    the memory cap (sampled, or a descendant's peak plus the child's); a refused fork with
    the tree at its ``max_processes`` (a pids cgroup), or, without one, the tree seen over
    that cap or at its ``RLIMIT_NPROC``; the child killed by ``SIGXCPU`` (``RLIMIT_CPU``)
    under a ``cpu_limit``; a ``MemoryError`` under a memory cap kept by ``RLIMIT_DATA``; a
    ``SIGKILL`` of a child the kernel log says the OOM killer killed (``oom_logged``). A
    ``SIGKILL`` without such evidence is nobody's known doing: None.
    """
    if killed_for is not None:
        return kind_of(killed_for)
    if usage.oom_kills:
        return MEMORY_LIMIT if limits.memory is not None and usage.memory_cap_hits else OOM_KILLED
    if limits.memory is not None and usage.peak_memory is not None and usage.peak_memory > limits.memory:
        return MEMORY_LIMIT  # past the cap (a kernel cap never lets it: sampled, or a descendant's peak)
    if limits.processes is not None and usage.fork_failures and usage.at_process_cap:
        return PROCESS_LIMIT
    if not kernel_process_cap and over_process_cap(limits, usage):
        return PROCESS_LIMIT
    if limits.cpu is not None and exit_signal == signal.SIGXCPU:
        return CPU_LIMIT
    if memory_error and memory_by_rlimit and limits.memory is not None:
        return MEMORY_LIMIT
    if oom_logged and exit_signal == signal.SIGKILL:
        return OOM_KILLED
    return None


def death_summary(kind: str, limits: Limits, usage: Usage) -> str:
    """The short cause stored with the attempt (``cause``) and repeated by the poison
    quarantine: ``memory_limit 512 MiB, peak 2.1 GiB``; ``cpu_limit 2 CPU s, used 2.04
    CPU s``; ``max_processes 20, 20 processes``; ``oom_killed, peak 1.9 GiB``; for the
    triggers, ``max_open_files 50, 503 open in process 4242`` and ``process 4242 left the
    step's cgroups``."""
    peak = max(usage.peak_memory or 0, usage.memory or 0) or None
    if kind == OPEN_FILES:
        return f"{limits.describe(kind)}, {usage.open_files} open in process {usage.open_files_pid}"
    if kind == LEFT_CGROUPS:
        return ", ".join(f"process {pid} left the step's cgroups" for pid, _ in usage.left[:3]) or kind
    if kind == MEMORY_LIMIT:
        return f"{limits.describe(kind)}" + (f", peak {format_size(peak)}" if peak else "")
    if kind == CPU_LIMIT:
        return f"{limits.describe(kind)}" + (f", used {usage.cpu:.2f} CPU s" if usage.cpu is not None else "")
    if kind == PROCESS_LIMIT:
        return f"{limits.describe(kind)}" + (f", {usage.processes} processes" if usage.processes is not None else "")
    return kind + (f", peak {format_size(peak)}" if peak else "")


def what_happened(kind: str, limits: Limits, usage: Usage) -> str:
    """What the tree did, for an attempt that died of (or was killed for) ``kind``."""
    return {
        MEMORY_LIMIT: f"the tree reached its {limits.describe(kind)}",
        CPU_LIMIT: f"the tree used its {limits.describe(kind)}",
        PROCESS_LIMIT: f"the tree reached its {limits.describe(kind)}",
        OOM_KILLED: "the kernel's OOM killer killed a process of the tree (the machine, or a cgroup above the "
                    "step's, ran out of memory)",
        OPEN_FILES: (f"process {usage.open_files_pid} of the tree held {usage.open_files} descriptors, past its "
                     f"{limits.describe(kind)} (it raised its own RLIMIT_NOFILE)"),
        LEFT_CGROUPS: "; ".join(f"process {pid} left the step's cgroups (now in {where}), out of reach of the caps "
                                "they hold" for pid, where in usage.left[:3]),
    }.get(kind, kind)


def death_message(kind: str, limits: Limits, usage: Usage, *, by: str) -> str:
    """The error message of an attempt that died of ``kind``; ``by`` says who acted
    ("the supervisor killed the tree", "the kernel's OOM killer"...)."""
    what = what_happened(kind, limits, usage)
    numbers = []
    peak = max(usage.peak_memory or 0, usage.memory or 0) or None
    if peak:
        numbers.append(f"peak {format_size(peak)}")
    if usage.cpu is not None:
        numbers.append(f"{usage.cpu:.2f} CPU s")
    if usage.processes is not None:
        numbers.append(f"{usage.processes} process{'' if usage.processes == 1 else 'es'}")
    return f"{what}; {by}" + (f" ({', '.join(numbers)})" if numbers else "")
