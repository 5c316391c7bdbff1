"""Starting an attempt on a child: the child's slot made to hold the step's caps first
(joined to the slot's cgroups, its caps written, or the child replaced when it cannot
hold them: a lowered RLIMIT_NOFILE, memory charged outside the cgroup, no user namespace
for ``max_processes``), then the :class:`~cyclone_mp.attempts.Attempt` recorded and its
task message queued: at once on an idle child, queued behind the running one
(pipelined), or beside it (an async step's ``async_concurrency``).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from . import decisions, judging
from .attempts import Attempt, Held, hold_bound
from .config import PREFETCH_MAX_WAIT
from .limits.declared import format_size, row_limits
from .limits.mechanism import PROCESSES_USERNS, SAMPLING
from .messages import LeaseKey, Started

if TYPE_CHECKING:
    from .childproc import ChildProc
    from .control import ProcessControl

log = logging.getLogger("cyclone_mp.supervisor")

START_NOTED_AFTER = 0.01  # seconds from claim to start past which a running step's renewal records its start
SNAPSHOT_AFTER_START = 0.2  # seconds: a child that starts a step shows it in the registry snapshot this soon


class AttemptStarts:
    """Starts claimed steps on the children of ``control`` (a
    :class:`~cyclone_mp.control.ProcessControl`), on its thread."""

    def __init__(self, control: ProcessControl) -> None:
        self.control = control
        self._task_limits: dict[Any, dict[str, Any]] = {}  # (limits, rlimit flags) -> what a task message carries
        self._tokens = itertools.count(1)
        self._hooks = control.mux.hook_refs()
        self._refs: dict[str, dict[str, Any]] = {}  # step name -> its handler's reference, as a task carries it
        self.started: list[tuple[LeaseKey, float]] = []  # (lease, start delay) of this turn's starts, for the keeper

    def note(self, att: Attempt) -> None:
        """An attempt whose handler started well after its claim (it waited for a child):
        its lease's next renewal records when (``started_at`` of a running step). And
        ``cyclone-mp workers`` shows the child busy within SNAPSHOT_AFTER_START, not idle
        until the next ``registry_interval``."""
        control = self.control
        control.next_snapshot = min(control.next_snapshot, control.clock() + SNAPSHOT_AFTER_START)
        delay = att.start_delay()
        if delay is not None and delay > START_NOTED_AFTER:
            self.started.append((att.key, delay))  # sent at the end of the turn, with the others

    def tell_keeper(self) -> None:
        """The starts noted this turn, to the lease keeper in one message."""
        if self.started:
            self.control.keeper(Started(tuple(self.started)))
            self.started.clear()

    def start(self, item: Held, child: ChildProc) -> bool:
        """Start one claimed step on ``child``. Its timeout counts from the claim (its
        ``sent`` time), as it does in the database (SPEC 4). Its resource caps are set on
        the child's slot first; False (nothing started) when the child already
        holds more memory than the step's cap: the child is replaced, the step waits."""
        row = item.row
        limits = row_limits(row)
        slot = child.slot
        fits = True
        ceiling = child.open_files_ceiling
        if ceiling is not None and child.attempt is None and (limits.open_files is None or limits.open_files > ceiling):
            # its hard RLIMIT_NOFILE was lowered for a smaller max_open_files, and it cannot raise it back
            log.info("child %d cannot raise its RLIMIT_NOFILE back (lowered for max_open_files %d), which step %s "
                     "needs %s: replacing it", child.pid, ceiling, row["step_name"],
                     "without a cap" if limits.open_files is None else f"at {limits.open_files}")
            return self.replace(child)
        if slot is not None and (limits or slot.caps != (None, None)) and child.attempt is None:
            joining = slot.unjoined(limits) if limits else []
            if joining:  # its caps live in v1 cgroups the child is not in (a hybrid host)
                self.control.confinement.v1_at_birth = True  # from now on new children join those at birth
                # what a child holds stays charged where it was when it joins (v1): one that ran
                # steps, was spawned, or imported modules after its birth would take that past the cap
                if "memory" in joining and (child.steps_run or not child.forked or child.leftover):
                    log.info("child %d may hold memory charged outside its slot's memory cgroup, which would "
                             "escape memory_limit %s of step %s: replacing it", child.pid,
                             format_size(limits.memory), row["step_name"])
                    return self.replace(child)
                slot.join(joining)
            if limits.processes is not None and not child.userns and self.control.confinement.mechanism.userns_processes:
                # no pids cgroup: children hold max_processes with RLIMIT_NPROC in a user
                # namespace of their own, which only a child single-threaded at birth can make
                self.control.confinement.wants_userns()  # from now on new children are born in one
                log.info("child %d has no user namespace of its own to hold max_processes %d of step %s: "
                         "replacing it", child.pid, limits.processes, row["step_name"])
                return self.replace(child)
            fits = slot.configure(limits)
            if not fits and child.steps_run:
                log.info("child %d holds more than memory_limit %s of step %s: replacing it", child.pid,
                         format_size(limits.memory), row["step_name"])
                return self.replace(child)
        control = self.control
        name = row["step_name"]
        ref = self._refs.get(name)
        if ref is None:  # the same small dict in every task of the step (encoded, never changed)
            step = control.mux.steps[name]
            ref = self._refs[name] = {"module": step.ref.module, "qualname": step.ref.qualname,
                                      "path": step.ref.path}
        now = control.clock()
        timeout = row["timeout"]
        token = f"{child.pid}.{next(self._tokens)}"
        # by position, in the order of Attempt's fields (keywords cost more, on every step's path)
        att = Attempt(item.key, row["run_id"], row["node"], name, row["attempt"], timeout, token, child,
                      row["run_kind"] != "step",  # workflow: a workflow run, or a spawned one ("child")
                      now, (item.sent + timeout) if timeout is not None else None,  # started, deadline
                      item.lease_sent, row.get("backoff"), row.get("trace"), limits,
                      item.sent)  # claimed: see Attempt.claimed
        att.cpu_start = child.cpu_total
        control.attempts[att.key] = att
        if not fits:  # a fresh child alone is over the cap: no handler can run under it
            control.endings.end(att)
            entry = control.limit_watch.below_a_fresh_child(child.pid, limits)
            control.endings.outcome(att, judging.failed(att, decisions.MEMORY_LIMIT, entry))
            return True
        side_by_side = name in control.side_by_side
        if side_by_side:  # an async attempt beside the others of its step in this child
            child.concurrent[token] = att
            att.started_wall = control.wall_clock()
            self.note(att)
        elif child.attempt is None:
            child.attempt = att
            att.started_wall = control.wall_clock()
            control.limit_watch.arm(att)
            self.note(att)
        else:  # pipelined: it starts when the child's current attempt ends, if by start_by
            att.start_by = time.monotonic() + hold_bound(control.config.lease_ttl, timeout, PREFETCH_MAX_WAIT)
            child.queued.append(att)
        control.deadlines.push(att)
        task = {
            "t": "task", "task": token, "run_id": att.run_id, "step": name, "node": att.node,
            "attempt": att.attempt, "timeout": timeout, "start_by": att.start_by,
            "deadline": (control.wall_clock() + (att.deadline - now)) if att.deadline is not None else None,
            "input_json": row["input"], "upstream_json": row["upstream"],
            "ref": ref,
        }
        if row.get("spawned") is not None:  # it waited for the runs its upstream spawned: ctx.spawned
            task["spawned_json"] = row["spawned"]
        if row.get("maps"):  # upstream map nodes: their outputs in files (deleted when the attempt ends)
            task["maps"] = row["maps"]
            att.files = tuple(m["path"] for m in row["maps"].values())
        if control.config.max_child_rss is not None:  # the child says its RSS at the end of the task
            task["rss"] = True
        if self._hooks:  # mux.on_attempt_start / on_attempt_end, run by the child around the handler
            task["hooks"] = self._hooks
        if side_by_side:
            task["concurrent"] = True
        if limits:  # the child sets its rlimits for the task (inherited by what it starts)
            # where no cgroup holds the memory (or none counts the tree's CPU, or holds the
            # process cap), rlimits backstop and the child counts its tree as its handler ends
            pids_cgroup = slot is not None and slot.kernel_process_cap
            flags = (not (slot is not None and slot.kernel_memory_cap), not (slot is not None and slot.confined),
                     not pids_cgroup and child.userns, not pids_cgroup)
            if limits.processes is not None:
                att.processes_by = (control.confinement.mechanism.processes if pids_cgroup else
                                    PROCESSES_USERNS if child.userns else SAMPLING)
            cached = self._task_limits.get((limits, flags))
            if cached is None:
                if len(self._task_limits) > 256:
                    self._task_limits.clear()
                cached = self._task_limits[(limits, flags)] = {
                    **limits.as_json(), "rlimit_data": flags[0], "rlimit_cpu": flags[1], "rlimit_nproc": flags[2],
                    "count_tree": flags[3]}
            task["limits"] = cached
        child.queue(task)  # written by the caller, with the other tasks of this round
        control.kills.watch(child)
        return True

    def replace(self, child: ChildProc) -> bool:
        """Retire the idle ``child`` for a fresh one before a step with caps (which waits
        for it: False, nothing started)."""
        child.recycle_due = True
        self.control.pool.retire(child)
        self.control.pool.maintain(self.control.clock(), self.control.draining)
        return False
