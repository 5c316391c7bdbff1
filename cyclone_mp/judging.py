"""The judge of an attempt's ending: evidence in, what the attempt became out (SPEC 1, 3, 4).

Pure: no clock, no I/O, no process-control state; it reads the :class:`Attempt` and
changes nothing. :mod:`cyclone_mp.endings` gathers the evidence (the child's result or
its exit status, who killed it and why, a cap's cause of death from
:class:`~cyclone_mp.limits.watch.LimitWatch`) and carries out the :class:`Ending` it gets
back: an :class:`~cyclone_mp.messages.Outcome` for the outcome writer, or nothing
written (the row already says what happened) and the lease let go.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from . import decisions
from .attempts import Attempt
from .enforcement import LEASE_FENCE, LINGERING
from .messages import COMPLETE, FAIL, RELEASE, SNOOZE, Outcome
from .procs import exit_description

RELEASED = "released"  # the cancel reason that takes back a step queued in a child (pipelining)
#: A cap's cause of death: ``(error kind, error entry)`` (the entry from ``LimitWatch.death_entry``).
Cap = tuple[str, dict[str, Any]]
NO_ENTRY: Mapping[str, Any] = types.MappingProxyType({})  #: the entry of an ending that has none


class Ending(NamedTuple):
    """What an attempt became.

    ``outcome``: what the outcome writer applies, or None when nothing is written (an
    operator's cancel, someone else's lease, a late completion: the row says what
    happened, the lease is let go); ``label``: how the observer hears of an ending with
    nothing written; ``entry``: the attempt's error entry as judged; ``counter``: the
    process-control stat the ending adds one to, if any. A named tuple (one per attempt,
    made cheaply); an ending without an entry shares one empty, read-only mapping.
    """

    outcome: Outcome | None
    label: str = ""
    entry: Mapping[str, Any] = NO_ENTRY
    counter: str | None = None


def failed(att: Attempt, kind: str, entry: dict[str, Any], *, require_timed_out: bool = False) -> Outcome:
    """A ``fail`` outcome of error kind ``kind`` (a :data:`~cyclone_mp.decisions.FAILURE_KINDS` value)."""
    return Outcome(att.key, FAIL, att.step_name, att.attempt, att.workflow, att.backoff_spec,
                   progress=att.progress, error_kind=kind, entry=entry, require_timed_out=require_timed_out)


def released(att: Attempt, *, held: bool = False) -> Outcome:
    """A ``release``: available at once, nothing counted (``held``: claimed ahead, for prefetch)."""
    return Outcome(att.key, RELEASE, att.step_name, att.attempt, att.workflow, held=held)


def result_entry(pid: int, result: dict[str, Any], elapsed: float) -> dict[str, Any]:
    """The error entry of an attempt whose result came: its child's pid, its CPU seconds,
    its peak RSS (KiB) and ``elapsed`` seconds, and a failure's type, message and traceback."""
    entry = {"pid": pid, "cpu_seconds": result.get("cpu"), "peak_rss_kb": result.get("maxrss_kb"),
             "elapsed": round(elapsed, 3)}
    if not result.get("ok"):
        entry.update({k: result.get(k) for k in ("type", "message", "traceback")})
    return entry


def of_result(att: Attempt, result: dict[str, Any], entry: dict[str, Any], cap: Cap | None = None) -> Ending:
    """The ending of an attempt whose child sent its ``result``. ``entry``: from
    :func:`result_entry`; ``cap``: a cap's cause of death found for it (a failure a cap
    caused, or a success whose tree was over its process cap as it ended), which decides
    unless a cancel came first. A success after an operator's cancel, or after the lease
    went elsewhere, is late: nothing is written."""
    reason = att.cancel_reason
    if cap is not None and reason is None:
        return Ending(failed(att, *cap), entry=entry)
    if result.get("ok"):
        if reason == "cancelled" or (reason == "lease_lost" and not att.fenced):
            return Ending(None, "late", entry, "late_completions_dropped")
        return Ending(Outcome(att.key, COMPLETE, att.step_name, att.attempt, att.workflow, att.backoff_spec,
                              output=result.get("output"), progress=att.progress, entry=entry,
                              start_delay=att.start_delay(), run_id=att.run_id, node=att.node,
                              spawns=tuple(result.get("spawns") or ())), entry=entry)
    if reason is None and result.get("kind") == SNOOZE:  # run again later, no attempt spent
        return Ending(Outcome(att.key, SNOOZE, att.step_name, att.attempt, att.workflow, progress=att.progress,
                              entry=entry, snooze=float(result.get("snooze") or 0.0)), entry=entry)
    if reason is not None:
        return of_cancel(att, {**entry, "cancel_reason": reason})
    return Ending(failed(att, decisions.reported_kind(result.get("kind")), entry), entry=entry)


def of_cancel(att: Attempt, entry: dict[str, Any]) -> Ending:
    """The ending of an attempt that ended after a cancel: its reason decides."""
    reason = att.cancel_reason
    if reason == "timeout":
        entry = {**entry}
        entry.setdefault("message", "timed out")
        return Ending(failed(att, decisions.TIMEOUT, entry, require_timed_out=True), entry=entry)
    if reason == "shutdown":  # given back: available at once, nothing counted (SPEC 5)
        return Ending(released(att), entry=entry)
    if reason == "cancelled" and entry.get("killed_by_supervisor"):
        # An operator's cancel, ended by our kill: the row is cancelled already (its CAS
        # cannot apply), but the kill's forensics join the attempt's cancel entry.
        return Ending(failed(att, decisions.ERROR, entry), entry=entry, counter="cancelled_attempts")
    if reason in ("cancelled", "lease_lost"):
        # An operator's cancel or someone else's lease: the row already says what happened.
        # Killed at the local fence: the lease is left to expire, and the sweep reclaims the
        # step as after a crash (reclaims + 1, bounded by max_reclaims).
        return Ending(None, reason, entry, "cancelled_attempts")
    return Ending(failed(att, decisions.ERROR, entry), entry=entry)  # killed for breaking the pipe protocol


def of_unstarted(att: Attempt, pid: int) -> Ending:
    """The ending of a step queued in child ``pid`` that never started it: released
    unless a cancel already decided it."""
    if att.cancel_reason in (None, "shutdown", RELEASED):
        return Ending(released(att, held=att.cancel_reason == RELEASED))
    return of_cancel(att, {"pid": pid, "message": "cancelled before it started", "cancel_reason": att.cancel_reason})


def of_exit(att: Attempt, entry: dict[str, Any], code: int | None, *, child_killed: bool,
            cap: Cap | None = None) -> Ending:
    """The ending of the attempt running in a child that died with wait status ``code``.
    ``entry``: its exit and usage; ``child_killed``: the supervisor killed the child (for
    the attempt in front of this one, if this one has no ``killed_by``); ``cap``: a
    cap's cause of death (the kernel's OOM killer counts as one)."""
    if cap is not None:
        return Ending(failed(att, *cap), entry=cap[1])
    entry = {**entry}
    if att.killed_by:
        entry.update(killed_by_supervisor=True, trigger=att.killed_by)
        if att.lingering:
            entry["lingering_threads"] = att.lingering
            failure = att.lingering_result
            if att.cancel_reason is None and failure is not None and not failure.get("ok"):
                # the handler had failed (or snoozed), and threads it started outlived it by
                # kill_grace: what it reported decides, as if they had ended; the kill is forensics
                entry.update({k: failure.get(k) for k in ("type", "message", "traceback")})
                return of_result(att, failure, entry)
            entry.setdefault("message", f"child killed by the supervisor after {att.killed_by}: threads the "
                                        f"handler started were still running ({', '.join(att.lingering[:3])})")
        entry.setdefault("message", f"child killed by the supervisor after {att.killed_by}")
        return of_cancel(att, entry)
    if child_killed and att.cancel_reason is None:  # started as the attempt in front, being killed, ended
        entry.update(killed_by_supervisor=True, trigger="previous_attempt", message=(
            "child killed by the supervisor to end the attempt before this one, "
            "which ended as this one started"))
        return Ending(failed(att, decisions.CHILD_EXITED, entry), entry=entry)
    entry["killed_by_supervisor"] = False
    desc = exit_description(code)
    what = f"signal {desc.get('signal_name', desc.get('signal'))}" if "signal" in desc else f"exit code {code}"
    entry["message"] = f"child process exited unexpectedly ({what})"
    if att.cancel_reason is not None:
        entry["cancel_reason"] = att.cancel_reason
        return of_cancel(att, entry)
    return Ending(failed(att, decisions.CHILD_EXITED, entry), entry=entry)


def watchdog_trigger(att: Attempt, lease_ttl: float) -> str:
    """What the watchdog's kill of ``att``'s child was for, when process control had not
    made it (it was frozen or late): the cancel whose ``kill_at`` passed; a failed
    attempt's lingering threads (its ``kill_at`` and no cancel, before its fence); else
    the lease fence."""
    if att.kill_at is not None and att.cancel_reason is not None:
        return att.cancel_reason
    if att.kill_at is not None and att.lingering is not None and att.kill_at <= att.fence(lease_ttl):
        return LINGERING
    return LEASE_FENCE


def of_side_by_side_exit(att: Attempt, entry: dict[str, Any], *, child_killed: bool) -> Ending:
    """The ending of an async attempt whose child died while it ran beside others. The
    one the supervisor killed the child for ends as that kill; the others are given back,
    no attempt spent; had nobody killed the child, each ends as ``child_exited``."""
    if att.killed_by:
        return of_cancel(att, {**entry, "killed_by_supervisor": True, "trigger": att.killed_by,
                               "message": f"child killed by the supervisor after {att.killed_by}"})
    if child_killed:
        return Ending(released(att), entry=entry)
    entry = {**entry, "killed_by_supervisor": False, "message": "child process exited unexpectedly"}
    return Ending(failed(att, decisions.CHILD_EXITED, entry), entry=entry)


def label(att: Attempt, outcome: Outcome) -> str:
    """How the observer hears an attempt that ran ended, from its outcome."""
    if outcome.kind == COMPLETE:
        return "completed"
    if outcome.kind in (RELEASE, SNOOZE):
        return "released" if outcome.kind == RELEASE else "snoozed"
    return (att.cancel_reason if att.cancel_reason in ("cancelled", "lease_lost") else outcome.error_kind) \
        or decisions.ERROR
