"""What a cgroup version does for a slot, as one interface: :class:`CgroupVersion`.

cgroup v2 (:mod:`cyclone_mp.limits.cgroup_v2`) and v1 (:mod:`cyclone_mp.limits.cgroup_v1`)
name their memory files differently, count OOM kills differently and kill differently.
A :class:`~cyclone_mp.limits.slot.Slot` picks, once when it is made, the version that
holds its memory cap and the one that kills its tree, and asks them; no method of the
slot asks which version it has. (Both count processes in the same ``pids.*`` files.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .slot import Slot


class CgroupVersion:
    """One cgroup version's files and kill, for a slot (stateless: one instance serves all).

    Attributes:
        memory_key: the slot's directory (``Slot.dirs`` key) holding memory under it.
        peak_file: the memory peak's file there; ``peak_reset``: the bytes that restart it.
    """

    memory_key: str = ""
    peak_file: str = ""
    peak_reset: bytes = b""

    def holds_memory(self, slot: Slot) -> bool:
        """The slot's child is in the cgroup holding its memory now."""
        raise NotImplementedError

    def memory_counters(self, slot: Slot) -> tuple[int, int]:
        """``(OOM kills, memory cap hits)`` in the slot's memory cgroup so far."""
        raise NotImplementedError

    def memory_now(self, slot: Slot) -> int | None:
        """Bytes the slot's memory cgroup is charged now (None: not readable)."""
        raise NotImplementedError

    def charged(self, slot: Slot) -> int | None:
        """What the cgroup charges the idle child, to weigh against a new cap (None: not
        trusted: v1 leaves pages touched before the child joined charged elsewhere)."""
        raise NotImplementedError

    def set_memory_cap(self, slot: Slot, memory: int | None) -> bool:
        """Write the memory cap (None: none). False: the child holds more already.

        Raises:
            OSError: the cgroup refused the cap.
        """
        raise NotImplementedError

    def members(self, slot: Slot, key: str) -> set[int] | None:
        """The processes in the slot's cgroup ``key`` now (None: not readable)."""
        raise NotImplementedError

    def kill(self, slot: Slot) -> list[int]:
        """Kill every process in the slot's cgroups; their pids (to reap)."""
        raise NotImplementedError
