"""Per-step resource limits and the cause of a death: values and decisions, no I/O.

A step may cap what its attempt's whole process tree (the child and everything it
starts) uses while it runs: ``memory_limit`` (bytes, or a size such as ``"512MiB"``),
``cpu_limit`` (CPU seconds, summed over the tree), ``max_processes`` (the child included;
threads count too) and ``max_open_files`` (descriptors per process, ``RLIMIT_NOFILE``).
They are set on ``cy.step``, per enqueue or client-wide (SPEC 2's precedence), stored on
the step row, and come back with its claim. How they are enforced is
:mod:`cyclone_mp.slots`; what a death was is decided here, from the evidence it gathers
(:class:`Usage`), by :func:`over_limit` (while the attempt runs) and
:func:`cause_of_death` (once its child is dead or its handler failed).

Two more reasons to kill a tree keep the kind ``error``, the trigger named in the error
entry: a process holding more descriptors than ``max_open_files`` allows
(:data:`OPEN_FILES`: it raised its own hard limit, as root may) and a process outside the
slot's cgroups (:data:`LEFT_CGROUPS`: out of every cap a cgroup holds). See
docs/resource-limits.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
from typing import Any

from .decisions import CPU_LIMIT, ERROR, MEMORY_LIMIT, OOM_KILLED, PROCESS_LIMIT
from .errors import ConfigurationError

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
#: Size suffixes (case-insensitive): ``K``/``M``/``G``/``T`` and ``KiB``... are powers of
#: 1024 (as Docker, systemd and ``ulimit`` read them), ``kB``/``MB``/``GB``/``TB`` of 1000.
_UNITS = {"": 1, "b": 1, "k": KIB, "kib": KIB, "kb": 1000, "m": MIB, "mib": MIB, "mb": 1000**2,
          "g": GIB, "gib": GIB, "gb": 1000**3, "t": TIB, "tib": TIB, "tb": 1000**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MEMORY_LIMIT_MIN = MIB  #: the smallest memory_limit (a child alone uses 10-40 MiB: see docs/resource-limits.md)
MEMORY_LIMIT_MAX = 1 << 53  #: bytes (8 PiB): exact as a JSON number and in a bigint
MAX_COUNT = 1 << 22  #: the largest max_processes / max_open_files (the kernel's own pid and fd ceilings are lower)

#: Triggers of a tree kill that are no cap's death: a process past its descriptors (it
#: raised its RLIMIT_NOFILE), a process out of the slot's cgroups. Their kind is ``error``.
OPEN_FILES = "max_open_files"
LEFT_CGROUPS = "left_cgroups"
TRIGGER_KINDS = {OPEN_FILES: ERROR, LEFT_CGROUPS: ERROR}


def kind_of(trigger: str) -> str:
    """The error kind of an attempt whose tree was killed for ``trigger`` (a cap's kind is
    its own trigger)."""
    return TRIGGER_KINDS.get(trigger, trigger)


def parse_size(value: object, what: str = "memory_limit") -> int | None:
    """``value`` in bytes: an int, or a string such as ``"512MiB"``, ``"1.5G"``, ``"300MB"``.

    Raises:
        ConfigurationError: not a size, or outside [1 MiB, 8 PiB].
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be bytes (an int) or a size such as '512MiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigurationError(f"{what} must be bytes (an int) or a size such as '512MiB' or '2G', got {value!r}")
        size = math.floor(float(match.group(1)) * _UNITS[unit])
    else:
        raise ConfigurationError(f"{what} must be bytes (an int) or a size such as '512MiB', not {type(value).__name__}")
    if not MEMORY_LIMIT_MIN <= size <= MEMORY_LIMIT_MAX:
        raise ConfigurationError(f"{what} must be from 1 MiB to 8 PiB, got {value!r}")
    return size


def format_size(nbytes: float | None) -> str:
    """``512 MiB``, ``2.1 GiB``, ``900 KiB`` (binary units, at most one decimal)."""
    if nbytes is None:
        return "-"
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size:
            value = nbytes / size
            text = f"{value:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    return f"{int(nbytes)} B"


def check_count(value: object, what: str) -> int | None:
    """``value`` if None or an int from 1 to :data:`MAX_COUNT`.

    Raises:
        ConfigurationError: naming ``what`` and the range.
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNT:
        raise ConfigurationError(f"{what} must be an int from 1 to {MAX_COUNT}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Limits:
    """One attempt's caps (None: no cap). ``memory`` in bytes, ``cpu`` in CPU seconds."""

    memory: int | None = None
    cpu: float | None = None
    processes: int | None = None
    open_files: int | None = None

    def __bool__(self) -> bool:  # (on the hot path: no generator)
        return (self.memory is not None or self.cpu is not None or self.processes is not None
                or self.open_files is not None)

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> "Limits":
        """A claimed row's limits (its ``memory_limit``, ``cpu_limit``, ``max_processes`` and
        ``max_open_files`` columns); one shared object per distinct set."""
        key = (row.get("memory_limit"), row.get("cpu_limit"), row.get("max_processes"), row.get("max_open_files"))
        limits = _SHARED.get(key)
        if limits is None:
            if len(_SHARED) > 1024:
                _SHARED.clear()
            limits = _SHARED[key] = cls(*key) if any(v is not None for v in key) else NO_LIMITS
        return limits

    def as_json(self) -> dict[str, Any]:
        """The set caps under their option names (what a task message and an error entry carry)."""
        return {k: v for k, v in (("memory_limit", self.memory), ("cpu_limit", self.cpu),
                                  ("max_processes", self.processes), ("max_open_files", self.open_files))
                if v is not None}

    def describe(self, kind: str) -> str:
        """``memory_limit 256 MiB``, ``cpu_limit 2 CPU s``, ``max_processes 20``: the cap of a kind."""
        if kind == MEMORY_LIMIT and self.memory is not None:
            return f"memory_limit {format_size(self.memory)}"
        if kind == CPU_LIMIT and self.cpu is not None:
            return f"cpu_limit {self.cpu:g} CPU s"
        if kind == PROCESS_LIMIT and self.processes is not None:
            return f"max_processes {self.processes}"
        if kind == OPEN_FILES and self.open_files is not None:
            return f"max_open_files {self.open_files}"
        return kind


NO_LIMITS = Limits()
_SHARED: dict[tuple[Any, ...], Limits] = {(None, None, None, None): NO_LIMITS}


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
