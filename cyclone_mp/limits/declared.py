"""Per-step resource limits as declared: the caps, their sizes and counts, no I/O.

A step may cap what its attempt's whole process tree (the child and everything it
starts) uses while it runs: ``memory_limit`` (bytes, or a size such as ``"512MiB"``),
``cpu_limit`` (CPU seconds, summed over the tree), ``max_processes`` (the child included;
threads count too) and ``max_open_files`` (descriptors per process, ``RLIMIT_NOFILE``).
They are set on ``cy.step``, per enqueue or client-wide (SPEC 2's precedence), stored on
the step row, and come back with its claim (:func:`row_limits`). How they are held is
:mod:`cyclone_mp.limits.confinement`; what a death was, :mod:`cyclone_mp.limits.verdicts`.

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
from typing import Any

from ..decisions import CPU_LIMIT, ERROR, MEMORY_LIMIT, PROCESS_LIMIT
from ..errors import ConfigurationError

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


def row_limits(row: dict[str, Any]) -> Limits:
    """A claimed row's resource limits (read once, kept in the row under ``limits``)."""
    limits = row.get("limits")
    if limits is None:
        limits = row["limits"] = Limits.of_row(row)
    return limits
