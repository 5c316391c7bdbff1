"""cgroup v1 for a slot: the ``memory`` hierarchy's files, and a kill process by process.

A slot's child joins its v1 cgroups once a step needs the caps they hold (the move waits
for a kernel RCU grace period). Its memory peak (``memory.max_usage_in_bytes``) restarts
when 0 is written; its memory cap is refused (``EBUSY``) below what it holds. A v1
cgroup cannot be killed at once: each listed process is killed through a pidfd until
none is left (``pids.max`` bounds the forks meanwhile). That kill also serves a v2
cgroup without ``cgroup.kill``.
"""

from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING

from ..procs import pidfd_kill
from .cgroup_version import CgroupVersion
from .cgroups import pid_alive, read_text, to_int, value_after, write_text

if TYPE_CHECKING:
    from .slot import Slot


class CgroupV1(CgroupVersion):
    """cgroup v1 (see the module docstring)."""

    memory_key, peak_file, peak_reset = "memory", "memory.max_usage_in_bytes", b"0"

    def holds_memory(self, slot: Slot) -> bool:
        return "memory" in slot.joined

    def memory_counters(self, slot: Slot) -> tuple[int, int]:
        """No cap hits here: they are judged from the peak instead (the sampling)."""
        # "oom_kill_disable 0\nunder_oom 0\noom_kill N\n"
        return value_after(slot.read_bytes("memory", "memory.oom_control"), b"oom_kill "), 0

    def memory_now(self, slot: Slot) -> int | None:
        return to_int(slot.read("memory", "memory.usage_in_bytes"))

    def charged(self, slot: Slot) -> int | None:
        return None  # pages the child touched before it joined stay charged elsewhere

    def set_memory_cap(self, slot: Slot, memory: int | None) -> bool:
        try:
            write_text(slot.path_of("memory", "memory.limit_in_bytes") or "", "-1" if memory is None else str(memory))
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False  # cannot reclaim below the cap: the child holds more already
            raise
        return True

    def members(self, slot: Slot, key: str) -> set[int] | None:
        """Opened each time (3 us): read again through the same descriptor, a v1 listing
        repeats its first one."""
        path = slot.path_of(key, "cgroup.procs")
        text = read_text(path) if path else None
        return None if text is None else {int(p) for p in text.split()}

    def kill(self, slot: Slot) -> list[int]:
        hit: set[int] = set()
        for _ in range(50):  # until nothing is left (pids.max bounds forks)
            listed = [p for p in (slot.procs() or []) if p not in hit or pid_alive(p)]
            if not listed:
                break
            for pid in listed:
                pidfd_kill(pid)
                hit.add(pid)
            time.sleep(0.001)
        return sorted(hit)


V1 = CgroupV1()
