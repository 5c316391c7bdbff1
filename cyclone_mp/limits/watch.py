"""The running attempts with resource limits, and the cause of an attempt's death.

Process control keeps one :class:`LimitWatch`. An attempt with limits is armed when it
starts (its slot's counters are noted) and sampled every
:data:`~cyclone_mp.limits.sampling.SAMPLE_INTERVAL` while it runs; :meth:`LimitWatch.over` says
which are over a cap, or hold more descriptors than their ``RLIMIT_NOFILE`` allowed
(they raised it), or have a process out of their slot's cgroups (said in the log too),
and process control kills their trees. When an attempt ends badly
(or its tree ended over its process cap), :meth:`LimitWatch.death` reads the evidence
about that attempt's own processes (its slot's cgroup counters, the sampled tree, the
child's count of its tree as its handler ended, the kernel log's record of an OOM kill
of that child's pid) and :meth:`LimitWatch.death_entry` writes it into the error entry.
Never a machine-wide counter: another process's OOM kill is not this child's death. An
attempt without limits costs nothing here. No I/O but the slots' files, ``/proc`` and
the kernel log; process control's thread only.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import decisions
from ..attempts import Attempt
from ..messages import LeaseKey
from .confinement import Confinement
from .declared import LEFT_CGROUPS, NO_LIMITS, OPEN_FILES, TRIGGER_KINDS, Limits, format_size
from .mechanism import MEMORY_FALLBACK, SAMPLING
from .sampling import SAMPLE_INTERVAL
from .verdicts import (Usage, cause_of_death, death_message, death_summary, note_tree_count, over_limit,
                       over_process_cap, what_happened)

log = logging.getLogger("cyclone_mp.supervisor")


class LimitWatch:
    """The attempts with limits that run now, and their forensics.

    Args:
        confinement: the supervisor's :class:`~cyclone_mp.limits.confinement.Confinement` (its
            mechanism says who enforces each cap).
    """

    def __init__(self, confinement: Confinement) -> None:
        self.confinement = confinement
        self.limited: dict[LeaseKey, Attempt] = {}  # running attempts with resource limits: sampled
        self.next_check = 0.0  # process control's clock: when to sample them next

    def arm(self, att: Attempt) -> None:
        """An attempt with limits starts running: note where its slot's counters stand and
        sample it from now on (an attempt without limits is not kept)."""
        if att.limits and att.child.slot is not None:
            att.base = att.child.slot.begin(att.limits, runner_cpu=att.child.cpu_total)
            self.limited[att.key] = att

    def disarm(self, att: Attempt) -> None:
        """The attempt is over: no more samples."""
        if self.limited.get(att.key) is att:
            del self.limited[att.key]

    def due(self, now: float) -> list[tuple[Attempt, str]]:
        """Every :data:`~cyclone_mp.limits.sampling.SAMPLE_INTERVAL` seconds of process control's
        clock (``now``) while attempts with limits run: :meth:`over`; else nothing."""
        if not self.limited or now < self.next_check:
            return []
        self.next_check = now + SAMPLE_INTERVAL
        return self.over()

    def wake_at(self) -> float | None:
        """When :meth:`due` samples next (process control's clock), or None: nothing to sample."""
        return self.next_check if self.limited else None

    def over(self) -> list[tuple[Attempt, str]]:
        """Sample every running attempt with limits; ``(attempt, limit kind)`` of each over
        a cap and not being cancelled (its tree is the caller's to kill)."""
        found = []
        for key, att in list(self.limited.items()):
            if att.ended or att.child.returncode is not None:
                self.limited.pop(key, None)
                continue
            slot = att.child.slot
            if att.child.attempt is not att or slot is None or att.base is None:
                continue
            usage = slot.sample(att.limits, att.base)
            att.usage = usage
            kind = over_limit(att.limits, usage, kernel_memory_cap=slot.kernel_memory_cap,
                              kernel_process_cap=slot.kernel_process_cap)
            if kind is not None and att.cancel_reason is None:
                if kind in TRIGGER_KINDS:
                    log.warning("step %s of run %s: %s; killing its tree", att.step_name, att.run_id,
                                what_happened(kind, att.limits, usage))
                found.append((att, kind))
        return found

    def final_sample(self, att: Attempt) -> None:
        """The tree as it is now, before a kill or a sweep of its leftovers empties it
        (the attempt's last usage)."""
        if att.child.slot is not None and att.base is not None:
            att.usage = att.child.slot.sample(att.limits, att.base, final=True, walk=att.child.returncode is None)

    def death(self, att: Attempt, *, exit_signal: int | None, memory_error: bool = False,
              reported_peak: int | None = None, tree_count: dict[str, Any] | None = None) -> tuple[str, Usage] | None:
        """The cause of death of an attempt, from the evidence about its own processes, or
        None. ``reported_peak``: bytes, the child's own peak plus its largest waited-for
        descendant's (what a result says where no cgroup counts the tree);
        ``tree_count``: the child's count of its tree as its handler ended (where no pids
        cgroup holds ``max_processes``: :meth:`cyclone_mp._child.Runner.tree_count`)."""
        slot = att.child.slot
        usage = att.usage or Usage()
        if slot is not None and att.base is not None:
            final = slot.sample(att.limits, att.base, final=True, walk=att.child.returncode is None)
            final.peak_memory = max(final.peak_memory or 0, usage.peak_memory or 0, usage.memory or 0) or None
            if final.processes in (None, 0) and usage.processes:
                final.processes = usage.processes
            if usage.cpu is not None:  # a dead tree's CPU is gone from /proc: the last sample's counts
                final.cpu = max(final.cpu or 0.0, usage.cpu)
            final.left = final.left or usage.left  # (the escapee is dead by now: what the look before the kill saw)
            final.at_process_cap = final.at_process_cap or usage.at_process_cap  # (before the sweep of leftovers)
            usage = final
        elif slot is not None and slot.confined and exit_signal is not None:  # no limits: the OOM killer's evidence
            usage = slot.sample(NO_LIMITS, slot.last, final=True, walk=att.child.returncode is None)
            # read after the death, and the cgroup's peak (not restarted for it) may be an earlier attempt's
            usage.memory = usage.peak_memory = None
        counted = slot is not None and slot.kernel_memory_cap  # a cgroup counts the tree's memory
        if reported_peak and not counted:
            usage.peak_memory = max(usage.peak_memory or 0, reported_peak)
        if tree_count:
            note_tree_count(usage, tree_count)
        oom_logged = False
        if exit_signal == 9 and att.killed_for is None and not usage.oom_kills:
            # a SIGKILL nobody here sent, no cgroup counter saw an OOM kill: the kernel log's word on this pid
            oom_logged = self.confinement.kernel_log.oom_killed(att.child.pid, since=att.child.spawned)
        kind = cause_of_death(att.limits, usage, exit_signal=exit_signal, killed_for=att.killed_for,
                              memory_error=memory_error, memory_by_rlimit=not counted, oom_logged=oom_logged,
                              kernel_process_cap=slot is not None and slot.kernel_process_cap)
        return (kind, usage) if kind is not None else None

    def over_at_end(self, att: Attempt, tree_count: dict[str, Any] | None) -> tuple[str, Usage] | None:
        """A handler that returned, judged on its process cap where no pids cgroup holds it:
        ``(process_limit, usage)`` when the child's count of its tree as the handler ended
        (``tree_count``) or a sample shows the tree over its cap, else None."""
        if att.limits.processes is None or not tree_count:
            return None
        usage = att.usage or Usage()
        note_tree_count(usage, tree_count)
        return (decisions.PROCESS_LIMIT, usage) if over_process_cap(att.limits, usage) else None

    def below_a_fresh_child(self, pid: int, limits: Limits) -> dict[str, Any]:
        """The error entry of an attempt that never ran: its ``memory_limit`` is below what
        child ``pid`` holds before any handler runs."""
        return {
            "pid": pid, "limits": limits.as_json(), "cause": death_summary(decisions.MEMORY_LIMIT, limits, Usage()),
            "enforced_by": self.confinement.mechanism.memory, "killed_by_supervisor": False,
            "message": f"memory_limit {format_size(limits.memory)} is below what a fresh child uses before any "
                       "handler runs (raise the cap)"}

    def death_entry(self, att: Attempt, kind: str, usage: Usage, entry: dict[str, Any]) -> dict[str, Any]:
        """An error entry with the cause of death: the tree's numbers, the caps, who acted.
        A tree killed for a trigger that is no cap's death (:data:`~cyclone_mp.limits.TRIGGER_KINDS`:
        kind ``error``) is described by its trigger."""
        mech = self.confinement.mechanism
        slot = att.child.slot
        confined = slot is not None and slot.confined
        if att.killed_for in TRIGGER_KINDS:
            kind = att.killed_for
        by = {decisions.MEMORY_LIMIT: mech.memory if slot is not None and slot.kernel_memory_cap
              else MEMORY_FALLBACK,
              decisions.PROCESS_LIMIT: att.processes_by or SAMPLING,
              decisions.CPU_LIMIT: mech.cpu if confined else SAMPLING,
              OPEN_FILES: mech.open_files, LEFT_CGROUPS: SAMPLING}.get(kind, "the kernel")
        failed = (f"the handler then failed ({str(entry.get('type')).rsplit('.', 1)[-1]}: {entry.get('message') or ''})"
                  if entry.get("type") and att.killed_for is None else None)
        if kind == decisions.PROCESS_LIMIT and usage.at_process_rlimit and att.killed_for is None:
            who = (f"it reached RLIMIT_NPROC, one over the cap ({by}), past which the kernel refuses "
                   "every fork" + (f"; {failed}" if failed else ""))
        elif failed:
            who = failed
        elif kind == decisions.CPU_LIMIT and att.killed_for is None:
            who = "the kernel sent SIGXCPU (RLIMIT_CPU)"
        elif kind == decisions.MEMORY_LIMIT and usage.oom_kills:
            who = f"the kernel's OOM killer acted at the cap ({by}), then the supervisor killed the whole tree"
        elif kind == decisions.PROCESS_LIMIT and usage.fork_failures:
            who = f"the kernel refused a fork at the cap ({by}), then the supervisor killed the whole tree"
        elif kind == decisions.PROCESS_LIMIT and att.killed_for is None:
            who = f"its tree was over the cap as its handler ended, between two looks ({by})"
        elif kind == decisions.OOM_KILLED:
            who = ("its cgroup counted the kill" if usage.oom_kills else "the kernel log names this process")
            who += ", and the supervisor killed the rest of the tree"
        elif kind == LEFT_CGROUPS:
            who = "the supervisor killed it and the tree (the step's processes are checked at every look)"
        else:
            who = f"the supervisor killed the tree ({by})"
        entry.update({
            "tree": usage.forensics(), "limits": att.limits.as_json(), "cause": death_summary(kind, att.limits, usage),
            "enforced_by": by, "message": death_message(kind, att.limits, usage, by=who),
        })
        return entry
