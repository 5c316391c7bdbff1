"""How an attempt ends: a child's messages and its exit, carried out (SPEC 1, 3, 4).

Part of process control (:mod:`cyclone_mp.control`), on its thread: its
:class:`AttemptEndings` reads a child's messages and its exit, gathers the evidence of
each ending (the result, the exit status, who killed the child and why, a cap's cause
of death from :class:`~cyclone_mp.limits.watch.LimitWatch`), asks the pure judge
(:mod:`cyclone_mp.judging`) what the attempt became and carries that out: the outcome
gathered for the writer, the step queued behind it started, the steps it held given
back, a child due for recycling retired.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from . import decisions, judging, mapped, procs
from .attempts import Attempt
from .judging import RELEASED, Cap, Ending
from .messages import FAIL, RELEASE, SNOOZE, LeaseDone, Outcome, Progress

if TYPE_CHECKING:
    from .childproc import ChildProc
    from .control import ProcessControl

log = logging.getLogger("cyclone_mp.supervisor")

#: Cancel reasons after which the step's row may have moved on while the attempt ran (the
#: sweep settled its timeout, an operator cancelled it, its lease went elsewhere): when such
#: an attempt is over, the writer records its processes dead (Reaped), so the step may run
#: again at once instead of at ``dead_by``.
REAPED_REPORTED = frozenset({"timeout", "cancelled", "lease_lost"})
#: Seconds between two log lines about one step's unhealable errors of one kind (a broken
#: deploy fails every queued run of the step at once: one line a minute says it, with a count).
UNHEALABLE_LOG_EVERY = 60.0


class AttemptEndings:
    """The ending of attempts for process control (see the module docstring): its
    methods read and change the state of ``control``, a
    :class:`~cyclone_mp.control.ProcessControl`, on its thread."""

    def __init__(self, control: ProcessControl) -> None:
        self.control = control
        self.rss_cap_warned = False  # max_child_rss found below what one step leaves (said once)
        self._unhealable_said: dict[tuple[str, str], tuple[float, int]] = {}  # (step, kind) -> (last line, count)

    # -- an attempt's result ------------------------------------------------------------------------

    def on_side_by_side(self, att: Attempt, message: dict[str, Any]) -> None:
        """A message of an async attempt running beside others in its child."""
        if message.get("t") == "progress":
            att.progress = {k: message.get(k) for k in ("done", "total", "message")}
            self.control.keeper(Progress(att.key, att.progress))
            return
        if message.get("t") != "result":
            return
        child = att.child
        del child.concurrent[att.token]
        self.end(att)
        self.note_ran(att, message, self.control.clock())
        try:
            self.settle_result(att, message)
        finally:
            self.control.kills.watch(child)
            self.control.take_held()

    def on_lingering(self, att: Attempt, result: dict[str, Any]) -> None:
        """A cancelled or failed attempt's handler is over but threads it started still
        run in the child (``asyncio.to_thread``, an executor, its own): the attempt is not
        over until they are. The child takes nothing more until they end (it then says
        ``threads_done`` and the attempt ends with the result it sent); at the cancel's
        ``kill_at`` (``kill_grace`` after the cancel, or after the failure) it is killed and
        the attempt ends with its death (a failure as the handler failed). Either way the
        step's next execution never runs beside them (SPEC 9)."""
        att.lingering = list(result.get("lingering") or ())
        att.lingering_result = result
        child = att.child
        for queued in child.queued:  # they would wait behind the kill: given back now
            self.control.kills.cancel(queued, RELEASED, self.control.clock())
        if att.kill_at is None:
            att.kill_at = self.control.clock() + self.control.config.kill_grace
            self.control.deadlines.push(att)
        log.warning("step %s (run %s) left %d thread(s) running after its %s (%s): its child %d is "
                    "killed at kill_grace unless they end first", att.step_name, att.run_id, len(att.lingering),
                    "cancel" if att.cancel_reason else "failure", ", ".join(att.lingering[:3]), child.pid)
        self.control.kills.watch(child)

    def on_result(self, att: Attempt, result: dict[str, Any]) -> None:
        """The ``result`` of ``att``, the attempt its child ran: the child is free (the step
        queued behind starts now), then the attempt is settled (:meth:`settle_result`)."""
        control = self.control
        child = att.child
        child.attempt = None
        dropped = bool(result.get("dropped"))  # a queued step the child never started
        if dropped:  # our cancel's reason, else the child's own (it is ended with it)
            att.cancel_reason = att.cancel_reason or result.get("cancel_reason")
        child.steps_run += not dropped
        child.cpu_total = float(result.get("cpu_total") or child.cpu_total)
        rss = result.get("rss")
        child.last_rss = rss if isinstance(rss, int) else None
        if result.get("nofile_pinned") and att.limits.open_files is not None:  # its hard RLIMIT_NOFILE stays lowered
            child.open_files_ceiling = min(child.open_files_ceiling or att.limits.open_files, att.limits.open_files)
        self.end(att)
        now = control.clock()
        if not dropped:
            self.note_ran(att, result, now)
        control.holding.hold_off = False
        if child.queued:  # the child starts its queued step now, in the order it was sent
            nxt = child.attempt = child.queued.popleft()
            nxt.started, nxt.start_by, nxt.started_wall = now, None, control.wall_clock()
            control.limit_watch.arm(nxt)
            control.starts.note(nxt)
            # uncancelled, its next look is the one it was queued with (Deadlines.start_keeps_entry)
            keeps_entry = nxt.cancel_reason is None and control.deadlines.start_keeps_entry
            if nxt.cancel_reason == RELEASED:  # too late to take back: it runs (if the child dropped it, its result says so)
                nxt.cancel_reason = None
            elif nxt.cancel_reason is not None:  # a cancel the child may have seen too late to drop it
                nxt.kill_at = nxt.started + control.config.kill_grace
            if not keeps_entry:
                control.deadlines.push(nxt)  # running now: its kill times apply
        try:
            self.settle_result(att, result)
        finally:
            control.kills.watch(child)
            control.take_held()  # the freed child starts its next step now, not after a round trip

    def settle_result(self, att: Attempt, result: dict[str, Any]) -> None:
        """Sweep what ``att`` left behind, gather the evidence, ask the judge
        (:func:`~cyclone_mp.judging.of_result`) and carry out its answer."""
        child = att.child
        if result.get("dropped"):
            self.settle_dropped(att, result)
            self.maybe_recycle(child)  # due for recycling, it takes nothing more (its next step was this one)
            return
        if result.get("progress"):
            att.progress = {k: result["progress"].get(k) for k in ("done", "total", "message")}
        if att.limits and not result.get("ok") and att.killed_for is None:
            self.control.limit_watch.final_sample(att)  # its tree as the handler left it: the sweep empties it
        if result.get("children", True) and child.returncode is None:  # it left processes behind (if dead: swept with it)
            self.control.pool.sweep_leftovers(child)
        self.maybe_recycle(child)
        entry = judging.result_entry(child.pid, result, self.control.clock() - att.started)
        ending = judging.of_result(att, result, entry, self._cap_of_result(att, result, entry))
        att.forensics = ending.entry
        outcome = ending.outcome
        if outcome is not None and outcome.kind == FAIL and outcome.error_kind in decisions.UNHEALABLE_KINDS:
            self.say_unhealable(att, outcome.error_kind, outcome.entry or {})
        self.settle(att, ending)

    def _cap_of_result(self, att: Attempt, result: dict[str, Any], entry: dict[str, Any]) -> Cap | None:
        """A cap's cause of death for an attempt whose result came, where a cap could be
        the cause: a failure (a cap killed part of its tree, or refused a fork) or a success
        whose tree was over its process cap as it ended (a burst no look saw, where no pids
        cgroup refused it). None after a cancel (the cancel decides) or for a snooze."""
        watch = self.control.limit_watch
        if att.cancel_reason is not None:
            return None
        tree_count = result.get("tree_count") if att.limits.processes is not None else None
        if result.get("ok"):
            found = watch.over_at_end(att, tree_count) if tree_count else None
        elif att.limits and result.get("kind") != SNOOZE:
            kids = result.get("children_maxrss_kb")
            memory_error = decisions.reported_kind(result.get("kind")) == decisions.MEMORY_ERROR
            peak = ((result.get("maxrss_kb") or 0) + kids) * 1024 if kids else None
            found = watch.death(att, exit_signal=None, memory_error=memory_error, reported_peak=peak,
                                tree_count=tree_count)
            if found is not None and memory_error and found[0] == decisions.MEMORY_LIMIT:
                # the runner itself reached the cap's backstop (RLIMIT_DATA, before the
                # sampling saw the tree cross it): it is retired, as a killed tree would be
                att.child.recycle_due = True
                self.maybe_recycle(att.child)
        else:
            return None
        if found is None:
            return None
        kind, usage = found
        entry = {**entry, "killed_by_supervisor": att.killed_for is not None}  # (a result read after our kill)
        return kind, watch.death_entry(att, kind, usage, entry)

    def say_unhealable(self, att: Attempt, kind: str, entry: dict[str, Any]) -> None:
        """One line in the worker's log for an error no retry can heal (its step is
        discarded without retry): what is wrong and how to fix it, as stored on the step.
        At most one line a minute per step and kind, counting the attempts in between."""
        now, key = self.control.clock(), (att.step_name, kind)
        said = self._unhealable_said.get(key)
        if said is not None and now - said[0] < UNHEALABLE_LOG_EVERY:
            self._unhealable_said[key] = (said[0], said[1] + 1)
            return
        self._unhealable_said[key] = (now, 0)
        more = f" ({said[1]} more of step {att.step_name!r} since the last such line)" if said and said[1] else ""
        log.error("step %r of run %s cannot succeed (%s, discarded without retry): %s%s",
                  att.step_name, att.run_id, kind, entry.get("message"), more)

    def settle_dropped(self, att: Attempt, result: dict[str, Any]) -> None:
        """The child gave back a queued step unstarted: our cancel reason, else its own."""
        att.cancel_reason = att.cancel_reason or result.get("cancel_reason")
        self.settle_unstarted(att)

    def settle_unstarted(self, att: Attempt) -> None:
        """A step queued in a child that never started it: nothing ran."""
        self.end(att)
        self.settle(att, judging.of_unstarted(att, att.child.pid))

    def release_queued(self, now: float) -> None:
        """Take back steps queued in children that waited too long behind a longer attempt,
        as a held step would be: released, no attempt used. A child never starts a queued
        task after its ``start_by`` (the same monotonic clock in both processes), and it
        sends the result of the attempt in front before it looks; so once ``start_by`` has
        passed, a step still queued after this reads the child's socket never runs there.
        When draining, queued steps are cancelled over the pipe at once."""
        mono = time.monotonic()

        def past_start_by(att: Attempt) -> bool:
            return att.start_by is not None and mono >= att.start_by

        for child in list(self.control.pool.children):
            if self.control.draining:
                for att in child.queued:
                    self.control.kills.cancel(att, RELEASED, now)
            if not any(map(past_start_by, child.queued)):
                continue
            self.control.io.read(child)  # a result sent before the child looked is handled first
            overdue = list(filter(past_start_by, child.queued))
            if not overdue:
                continue
            child.queued = collections.deque(att for att in child.queued if all(att is not o for o in overdue))
            self.control.holding.hold_off = True
            self.control.next_poll = min(self.control.next_poll, now)  # a free child takes it back at once
            for att in overdue:
                att.cancel_reason = att.cancel_reason or RELEASED
                self.settle_unstarted(att)

    # -- a child's exit -------------------------------------------------------------------------------

    def on_child_exit(self, child: ChildProc) -> None:
        """The child's socket closed (it died, or was killed): reap it, then decide what its
        attempt (and the steps queued behind it) became."""
        self.control.kills.read_watchdog()
        unread, child.unread = child.unread, []
        for message in unread:  # sent before it died: e.g. the result of the attempt we killed it for
            self.control.io.on_message(child, message)
        att = child.attempt  # then maybe the queued step it had started since
        by_watchdog = child.pid in self.control.watchdog_killed
        code = self.control.pool.reap(child, ended_alone=not child.killed and (att is None or not att.killed_by)
                              and not by_watchdog)
        self.control.watchdog_killed.discard(child.pid)
        child.attempt = None
        if att is not None and not att.ended:
            self.end(att)
            self.note_duration(self.control.clock() - att.started)
            entry = {"pid": child.pid, **procs.exit_description(code), **child.usage(since=att.cpu_start),
                     "elapsed": round(self.control.clock() - att.started, 3)}
            if child.peak_rss_kb is None and att.peak_rss_kb is not None:
                entry["peak_rss_kb"] = att.peak_rss_kb  # wait4's maxrss would include the pre-exec parent
            if by_watchdog and not att.killed_by:
                att.killed_by = judging.watchdog_trigger(att, self.control.config.lease_ttl)
                if att.killed_by == judging.LEASE_FENCE:
                    att.cancel_reason, att.fenced = "lease_lost", True
                entry["killed_by"] = "watchdog"
            cap = self._cap_of_exit(att, child, code, entry)
            self.settle(att, judging.of_exit(att, entry, code, child_killed=child.killed, cap=cap))
        queued, child.queued = list(child.queued), collections.deque()
        for unstarted in queued:
            self.settle_unstarted(unstarted)
        side, child.concurrent = list(child.concurrent.values()), {}
        for other in side:  # async attempts that ran beside others in the child
            self.end_side_by_side(other, child, code)
        self.control.pool.after_exit(child, code)
        self.control.pool.maintain(self.control.clock(), self.control.draining)

    def _cap_of_exit(self, att: Attempt, child: ChildProc, code: int | None, entry: dict[str, Any]) -> Cap | None:
        """A cause of death for the attempt of a dead child: our kill for a cap, or a death
        nobody here caused (a cap, or the kernel's OOM killer: the evidence decides). None
        after a cancel, or when the supervisor killed the child for something else."""
        signo = procs.exit_description(code).get("signal")
        judged = att.killed_for is not None or (not att.killed_by and not child.killed and (att.limits or signo))
        if att.cancel_reason is not None or not judged:
            return None
        found = self.control.limit_watch.death(att, exit_signal=signo)  # type: ignore[arg-type]
        if found is None:
            return None
        kind, usage = found
        entry = {**entry, "killed_by_supervisor": att.killed_for is not None}
        if att.killed_for is not None:
            entry["trigger"] = att.killed_for
        return kind, self.control.limit_watch.death_entry(att, kind, usage, entry)

    def end_side_by_side(self, att: Attempt, child: ChildProc, code: int | None) -> None:
        """An async attempt whose child died (:func:`~cyclone_mp.judging.of_side_by_side_exit`)."""
        if att.ended:
            return
        self.end(att)
        if not att.killed_by and child.killed:
            log.info("step %s (run %s) ran beside an attempt its child was killed for: it runs again, no attempt "
                     "spent", att.step_name, att.run_id)
        entry = {"pid": child.pid, **procs.exit_description(code), "elapsed": round(self.control.clock() - att.started, 3)}
        self.settle(att, judging.of_side_by_side_exit(att, entry, child_killed=child.killed))

    def maybe_recycle(self, child: ChildProc) -> None:
        cfg = self.control.config
        if child.returncode is not None:
            return  # dead already (a result read after its kill): its exit is being handled
        if not child.recycle_due:
            too_many = cfg.max_steps_per_child is not None and child.steps_run >= cfg.max_steps_per_child
            # the RSS the child reported as its last task ended: sampled now, with pipelining
            # it would include the next task's working memory
            rss = None
            if cfg.max_child_rss is not None:
                rss = child.last_rss if child.last_rss is not None else child.rss()
            too_big = rss is not None and cfg.max_child_rss is not None and rss > cfg.max_child_rss
            child.recycle_due = too_many or too_big  # then nothing more is queued in it
            if too_big and child.steps_run <= 1 and not self.rss_cap_warned:
                self.rss_cap_warned = True
                log.warning("max_child_rss (%.1f MiB) is below the RSS of a child after its first step (%.1f MiB): "
                            "every child is replaced after each step, and the steps queued in it are given back; "
                            "raise max_child_rss above it", cfg.max_child_rss / 2**20, rss / 2**20)
        if not child.recycle_due:
            return
        if child.concurrent:  # retired once its async attempts are over
            return
        if child.attempt is not None:  # it finishes the step it runs; the ones queued are taken back
            for att in child.queued:
                self.control.kills.cancel(att, RELEASED, self.control.clock())
            return
        self.control.pool.retire(child)
        self.control.pool.maintain(self.control.clock(), self.control.draining)

    def note_ran(self, att: Attempt, result: dict[str, Any], now: float) -> None:
        """An attempt's handler ended (``result`` came at ``now``): its start is the child's
        own (:meth:`~cyclone_mp.attempts.Attempt.began_in_child`), and how long it ran
        joins the moving average."""
        att.began_in_child(result.get("began"), now, time.monotonic())
        self.note_duration(now - att.started)

    def note_duration(self, seconds: float) -> None:
        prev = self.control.step_seconds
        self.control.step_seconds = seconds if prev is None else 0.9 * prev + 0.1 * seconds

    # -- the outcome ---------------------------------------------------------------------------------

    def end(self, att: Attempt) -> None:
        """The attempt is over in its child: forget it here (its outcome follows). Ended
        after a cancel, a timeout or a lost lease, it is reported dead, so its step's retry
        and its concurrency slot need not wait for ``dead_by``: nothing of it runs (its
        handler returned, its child is gone, or a step queued behind another never
        started). Once per attempt."""
        if att.ended:
            return
        att.ended = True
        for path in att.files:  # the outputs files of its upstream maps: read by now
            mapped.discard(path)
        if self.control.attempts.get(att.key) is att:
            del self.control.attempts[att.key]
        self.control.deadlines.forget()
        self.control.limit_watch.disarm(att)
        if att.cancel_reason in REAPED_REPORTED:
            self.control.writer.post_dead((att.key,), started=att.started_wall is not None)

    def settle(self, att: Attempt, ending: Ending) -> None:
        """Carry out what the judge said ``att`` became: its outcome for the writer, or
        nothing written and its lease let go."""
        if ending.counter is not None:
            self.control.stats[ending.counter] += 1
        if ending.outcome is not None:
            self.outcome(att, ending.outcome)
            return
        self.observe_end(att, ending.label, ending.entry)
        self.control.keeper(LeaseDone((att.key,)))

    def outcome(self, att: Attempt, outcome: Outcome) -> None:
        if getattr(att, "started_wall", None) is not None:  # it ran: say how it ended (tests pass a stand-in)
            self.observe_end(att, judging.label(att, outcome), outcome.entry or att.forensics or {})
            if outcome.kind != RELEASE and outcome.run_id != att.run_id:  # (a completion's judge set them)
                outcome = outcome._replace(start_delay=att.start_delay(),  # its handler's start
                                           run_id=att.run_id, node=att.node)
        self.control.outcomes.append((outcome, att.deadline))
        if self.control.outcomes_since is None:
            self.control.outcomes_since = self.control.clock()

    def observe_end(self, att: Attempt, outcome: str, entry: dict[str, Any]) -> None:
        """Tell the observer (metrics, traces) how an attempt that ran ended."""
        if att.started_wall is not None:
            self.control.observer.attempt_ended(att, outcome, entry)
