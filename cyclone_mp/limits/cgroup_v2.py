"""cgroup v2 for a slot: ``memory.*`` files, ``cpu.stat``, and ``cgroup.kill`` on a frozen cgroup.

The slot's v2 directory is read through descriptors kept open (about 2 us a read); its
memory peak (``memory.peak``) restarts per open file where it can be written (Linux
6.12+). A tree is killed whole: the cgroup is frozen, listed, killed with ``cgroup.kill``
(no fork can race it) and thawed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from .cgroup_version import CgroupVersion
from .cgroups import fields, read_text, to_int, value_after, write_text

if TYPE_CHECKING:
    from .slot import Slot

FREEZE_WAIT = 0.05  #: seconds a tree kill waits for a cgroup to be frozen before it kills anyway


class CgroupV2(CgroupVersion):
    """cgroup v2 (see the module docstring)."""

    memory_key, peak_file, peak_reset = "v2", "memory.peak", b"reset"

    def holds_memory(self, slot: Slot) -> bool:
        return True  # the child is born in (or moved to) its v2 cgroup before anything else

    def memory_counters(self, slot: Slot) -> tuple[int, int]:
        events = fields(slot.read("v2", "memory.events"))
        return events.get("oom_kill", 0), events.get("oom", 0) + events.get("max", 0)

    def memory_now(self, slot: Slot) -> int | None:
        return to_int(slot.read("v2", "memory.current"))

    def charged(self, slot: Slot) -> int | None:
        return to_int(slot.read("v2", "memory.current"))

    def set_memory_cap(self, slot: Slot, memory: int | None) -> bool:
        write_text(slot.path_of("v2", "memory.max") or "", "max" if memory is None else str(memory))
        return True

    def members(self, slot: Slot, key: str) -> set[int] | None:
        """Read through a descriptor kept open (2 us); a listing cut short by the read
        leaves the rest to the slot's own look at each process."""
        data = slot.read_bytes(key, "cgroup.procs")
        if data is None:
            return None
        return {int(p) for p in data[:data.rfind(b"\n") + 1].split()}

    def kill(self, slot: Slot) -> list[int]:
        v2 = slot.dirs["v2"]
        frozen = False
        with contextlib.suppress(OSError):
            write_text(os.path.join(v2, "cgroup.freeze"), "1")
            frozen = True
        if frozen:
            deadline = time.monotonic() + FREEZE_WAIT
            while "frozen 1" not in (read_text(os.path.join(v2, "cgroup.events")) or "frozen 1"):
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
        pids = slot.procs() or []
        with contextlib.suppress(OSError):
            write_text(os.path.join(v2, "cgroup.kill"), "1")
        if frozen:
            with contextlib.suppress(OSError):
                write_text(os.path.join(v2, "cgroup.freeze"), "0")
        return pids


def cpu_seconds(slot: Slot) -> float | None:
    """CPU seconds the slot's v2 cgroup used so far (``cpu.stat``; None: no v2 cgroup)."""
    if slot.confined and "v2" in slot.dirs:
        usec = value_after(slot.read_bytes("v2", "cpu.stat"), b"usage_usec ", None)
        if usec is not None:
            return usec / 1e6
    return None


V2 = CgroupV2()
