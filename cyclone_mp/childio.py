"""A child's socket for process control: what is queued for it written, what it sent read
and handed to the part that owns it (SPEC 1).

A child says it is preloading, ready or entered (:class:`~cyclone_mp.pool.ChildPool`),
reports a task's progress (passed to the lease keeper) and sends each task's result
(:class:`~cyclone_mp.endings.AttemptEndings`); its socket's end is its exit. A frame
that cannot be decoded fails the result it was, or kills the child that broke the
protocol. On process control's thread, with its state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import decisions, protocol, unhealable
from .messages import Progress

if TYPE_CHECKING:
    from .childproc import ChildProc
    from .control import ProcessControl

log = logging.getLogger("cyclone_mp.supervisor")

IO_SWEEP_INTERVAL = 1.0  # seconds between reads of every child socket, readiness or not (a safety net)


class ChildIO:
    """The children's sockets of ``control`` (a :class:`~cyclone_mp.control.ProcessControl`)."""

    def __init__(self, control: ProcessControl, start: float) -> None:
        self.control = control
        self.ready: set[ChildProc] = set()  # children whose sockets the last wait reported
        self._next_sweep = start

    def flush_queued(self) -> None:
        """Write every child's queued tasks now; the watchdog learns their due times first,
        so it knows a task's due time before the child has the task."""
        self.control.kills.tell_watchdog()
        pool = self.control.pool
        for child in pool.children:
            if child.outbox:
                child.flush()
                pool.update_write_interest(child)

    def check(self) -> None:
        """Read the children whose sockets the last wait reported (and, every
        ``IO_SWEEP_INTERVAL`` seconds, all of them), and write what is queued. The
        children freed meanwhile take held steps once, after the last message."""
        pool = self.control.pool
        now = self.control.clock()
        if now >= self._next_sweep:
            self._next_sweep = now + IO_SWEEP_INTERVAL
            ready = list(pool.children)
        else:
            ready = [c for c in pool.children if c in self.ready or c.outbox]
        self.ready.clear()
        control = self.control
        control.taking_deferred = True  # freed children take held steps once, after every message is handled
        try:
            for child in ready:
                if child in pool.children:
                    self.read(child)
        finally:
            control.taking_deferred = False
            if control.take_due:
                control.take_due = False
                control.take_held()

    def read(self, child: ChildProc) -> None:
        """Write what is queued for ``child``, then read and handle all it has sent."""
        child.flush()
        try:
            messages, eof = child.receive()
        except protocol.ProtocolError as exc:
            log.error("child %d sent a bad message (%s); killing it", child.pid, exc)
            self.control.kills.kill_for(child, "protocol_error")
            messages, eof = [], True
        for message in messages:
            self.on_message(child, message)
        if eof:
            self.control.endings.on_child_exit(child)
        self.control.pool.update_write_interest(child)

    def on_message(self, child: ChildProc, message: dict[str, Any]) -> None:
        """Handle one message ``child`` sent (decoded: :mod:`cyclone_mp.protocol`)."""
        kind = message.get("t")
        if kind == "preloading":
            child.preloading, child.preloading_since = (message.get("module"), message.get("path")), self.control.clock()
            return
        if kind == "ready":
            self.control.pool.on_ready(child, message)
            self.control.take_held()
            return
        if kind == "entered":
            self.control.pool.on_entered(child, message)
            return
        if kind == protocol.UNDECODABLE:
            self.on_undecodable(child, message)
            return
        if child.concurrent and message.get("task") in child.concurrent:  # an async attempt beside others
            self.control.endings.on_side_by_side(child.concurrent[message["task"]], message)
            return
        att = child.attempt
        if att is None or message.get("task") != att.token:
            if kind == "result" and message.get("dropped"):  # a step queued behind ``att``, taken back
                for queued in child.queued:
                    if queued.token == message.get("task"):
                        child.queued.remove(queued)
                        self.control.endings.settle_dropped(queued, message)
                        break
            return
        if kind == "progress":
            att.progress = {k: message.get(k) for k in ("done", "total", "message")}
            self.control.keeper(Progress(att.key, att.progress))
        elif kind == "result" and message.get("lingering") and att.lingering is None:
            self.control.endings.on_lingering(att, message)
        elif kind == "threads_done" and att.lingering is not None:  # they ended before its kill
            att.lingering = None
            self.control.endings.on_result(att, att.lingering_result or {"t": "result", "task": att.token, "ok": False})
        elif kind == "result":
            self.control.endings.on_result(att, message)

    def on_undecodable(self, child: ChildProc, marker: dict[str, Any]) -> None:
        """A frame the child sent that cannot be read (decoding is per frame, so nothing
        around it is lost). A result of the running attempt fails that attempt
        (``output_invalid``) and the child is recycled; a progress value is dropped;
        anything else means the child broke the protocol: it is killed."""
        att = child.attempt
        if marker.get("of") == "progress":
            return
        if marker.get("of") == "result" and att is not None and marker.get("task") == att.token:
            child.recycle_due = True
            self.control.endings.on_result(att, {
                "t": "result", "task": att.token, "ok": False, "kind": decisions.OUTPUT_INVALID,
                "type": "cyclone_mp.errors.PayloadError", "children": True,
                "message": unhealable.undecodable(marker.get("error")),
            })
            return
        if child.returncode is None:
            log.error("child %d sent an undecodable message (%s); killing it", child.pid, marker.get("error"))
            self.control.kills.kill_for(child, "protocol_error")
