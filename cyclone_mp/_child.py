"""The child runner: runs handlers, one at a time, for the supervisor that started it.

Started as ``_boot.py _child CTRL_FD CANCEL_FD PARENT_PID LIMIT`` in its own process
group, or forked from the zygote (:mod:`cyclone_mp._zygote`). It owns only the handler
call and the pipe (STYLE pattern 9): it never touches the database. It dies with its
parent, reads tasks from the control socket and cancels from the cancellation pipe (on a
watcher thread), and sends back progress and one result per task, as JSON. Tasks run in
arrival order; one queued behind the running one is dropped unstarted when cancelled or
past its ``start_by`` (``time.monotonic()`` seconds), and after an attempt that left
processes behind the next waits for the supervisor's "go" (it sweeps them first).
Handlers are found and called by :class:`~cyclone_mp._handler.Handlers` (an ``async def``
one on the child's own event loop; side by side under ``async_concurrency``:
:mod:`cyclone_mp._concurrent`). A task with resource limits runs under soft rlimits
(:class:`~cyclone_mp.limits.rlimits.TaskLimits`).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sys
import threading
import time

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

from . import protocol
from ._handler import Handlers
from ._process import adopt_orphans, batch_scheduling, die_with_parent, ignore_interrupt, lingering_threads
from ._progress import Progress
from ._tasks import dropped_frame, failure, load_module, reap_killed, result_frame, spawned_of, task_inputs
from .context import Cancellation, Context
from .errors import PayloadError
from .limits.procfs import PeakRss, current_rss, has_own_children, peak_rss_kb
from .limits.proctree import tree_size
from .limits.rlimits import TaskLimits
from .limits.userns import USERNS_ENV, own_user_namespace

DROPPED_KEPT = 1024  # cancelled tokens remembered (a cancel may arrive after its task ended: never read back)
RELEASED = "released"  # the cancel reason that takes back a queued task (never a started one)
PEAK_READ_AFTER = 0.01  # seconds: a successful attempt shorter than this reports no peak RSS


class Runner:
    """The child's main loop; see the module docstring."""

    def __init__(self, ctrl: socket.socket, cancel_fd: int, limit: int,
                 modules: dict[tuple[str, str | None], Any] | None = None) -> None:
        self.ctrl = ctrl
        self.limit = limit
        self.cancel_file = os.fdopen(cancel_fd, "r", buffering=1)
        self.lock = threading.Lock()
        self.task: str | None = None
        self.cancellation = Cancellation()
        self.handlers = Handlers(modules)  # finding, converting for and calling the tasks' handlers
        self.progress = Progress(self)  # the tasks' progress (throttled for the running one)
        self.peak = PeakRss()
        self.dropped: dict[str, str] = {}  # token -> reason: cancelled before it started
        self.concurrent: Any = None  # the async handlers running side by side (async_concurrency)
        self.held = False  # the last attempt left processes: start nothing until "go"
        self.limits = TaskLimits()  # the rlimits of tasks with resource limits
        #: main's and the cancel watcher's idents, when no other thread lived as the loop
        #: started (empty otherwise: a thread that may end would make a count of them wrong)
        self.own_threads: frozenset[int | None] = frozenset()

    def send(self, message: dict[str, Any]) -> None:
        data = protocol.encode(message)
        with self.lock:
            self.ctrl.sendall(data)

    def watch_cancels(self) -> None:
        """Watcher thread: trip the current task's handle when its cancel arrives."""
        for line in self.cancel_file:
            token, _, reason = line.strip().partition(" ")
            reason = reason or "cancelled"
            with self.lock:  # (the main loop submits a side-by-side task under it: see loop)
                if self.concurrent is not None and self.concurrent.cancel(token, reason):
                    continue  # one of the async handlers running side by side
                if token != self.task:
                    # A task queued behind the current one (or not read yet, or already
                    # finished): it will not start. Said now, not when the current one
                    # ends, so the supervisor can release it in time.
                    if token not in self.dropped:
                        self.dropped[token] = reason
                        try:
                            self.ctrl.sendall(dropped_frame(token, reason))
                        except OSError:  # the supervisor closed our socket: it is gone or recycling us
                            os._exit(0)
                        if len(self.dropped) > DROPPED_KEPT:  # cancels of tasks that had already ended
                            del self.dropped[next(iter(self.dropped))]
                elif reason != RELEASED:  # "released" takes back a queued task only: a started one runs
                    self.cancellation.set(reason)
        os._exit(0)  # the supervisor closed the pipe: it is gone or recycling us

    def note_own_threads(self) -> None:
        """Once the cancel watcher runs: if it and main are the only threads, their idents
        are the threads alive before any task while the count stays at two (both live as
        long as this process). Any other thread then (one a ``sitecustomize`` started, say)
        may end, and a count could no longer tell the set: each task enumerates."""
        alive = frozenset(t.ident for t in threading.enumerate())
        self.own_threads = alive if len(alive) == 2 else frozenset()

    def concurrent_tasks(self) -> Any:
        """The async handlers running side by side (made at the first such task)."""
        if self.concurrent is None:
            from ._concurrent import ConcurrentTasks  # lazy: only async handlers need it

            self.concurrent = ConcurrentTasks(self)
        return self.concurrent

    def send_result(self, result: dict[str, Any]) -> None:
        """Send one result frame (of a concurrent task: its output checked as any)."""
        frame = result_frame(result, self.limit)
        with self.lock:
            self.ctrl.sendall(frame)

    def progress_for(self, token: str) -> Any:
        """The ``ctx.set_progress`` sink of a concurrent task: sent at once (checked)."""
        return self.progress.sink_for(token)

    def run_task(self, task: dict[str, Any]) -> dict[str, Any]:
        try:
            inputs = task_inputs(task)
        except PayloadError as exc:  # an input no retry can fix
            return failure("permanent", exc)
        ctx = Context(
            run_id=task["run_id"], step_name=task["step"], node=task["node"], attempt=task["attempt"],
            deadline=self.handlers.deadline_of(task), upstream=inputs[1], progress_sink=self.progress.report,
            cancellation=self.cancellation, spawned=spawned_of(task),
        )
        hooks = task.get("hooks")
        result = self.handlers.call(task, ctx, inputs[0], hooks.get("start") if hooks else None, self.cancellation)
        if hooks and hooks.get("end"):
            self.handlers.end_hooks(hooks["end"], ctx, result)
        return result

    def preload(self, modules: list[list[Any]]) -> None:
        """Import the handlers' modules before saying ready, so the first attempt in a
        fresh child does not spend its timeout importing. A module that fails is left for its steps to
        report, as their attempts' error. Each module is announced first: if importing it
        kills or hangs this process, the supervisor leaves it out of the next child's
        preload."""
        for name, path in modules:
            self.send({"t": "preloading", "module": name, "path": path})
            try:
                load_module(name, path, self.handlers.modules)
            except BaseException:  # noqa: BLE001 - its step's attempt reports it
                pass

    def loop(self, preload: list[list[Any]] | None = None, entered: dict[str, Any] | None = None,
             userns: bool | str | None = None) -> None:
        """Run tasks until told to exit. ``preload``: the handlers' modules to import
        before saying ready; None: a spawned child's, from its environment. A child forked
        from the zygote gets those the zygote had not imported, and imports them once it
        is in its slot's cgroups: ``entered`` (it moved itself; sent first) without an
        error, else after the supervisor's ``start`` (the supervisor moved it).
        ``userns``: True, this process made a user namespace of its own; a string, why it
        could not (both said with ``ready``)."""
        threading.Thread(target=self.watch_cancels, name="cyclone-cancel-watch", daemon=True).start()
        self.note_own_threads()
        reader = protocol.FrameReader(protocol.TASK_FRAME_LIMIT)  # tasks come from our parent: input + fan-in
        inbox: list[dict[str, Any]] = []
        if entered is not None:
            self.send(entered)
        if preload is None:
            preload = json.loads(os.environ.pop(protocol.PRELOAD_ENV, None) or "[]")
        elif preload and (entered is None or entered.get("failed")):
            while not inbox or inbox[0].get("t") != "start":
                if inbox:
                    if inbox.pop(0).get("t") == "exit":  # retired before it started
                        return
                    continue
                data = self.ctrl.recv(protocol.READ_CHUNK)
                if not data:
                    return
                inbox.extend(reader.feed(data))
            inbox.pop(0)
        self.preload(preload)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        ready = {"t": "ready", "pid": os.getpid(), "cpu_total": usage.ru_utime + usage.ru_stime}
        if userns is not None:
            ready["userns" if userns is True else "userns_error"] = userns
        self.send(ready)
        # After "ready": under SCHED_BATCH a woken process waits for its turn on a busy
        # CPU, which delayed every step of the start (the watcher's, the imports').
        batch_scheduling()
        held: list[dict[str, Any]] = []  # tasks received while self.held
        while True:
            while not inbox:
                data = self.ctrl.recv(protocol.READ_CHUNK)
                if not data:
                    return
                inbox.extend(reader.feed(data))
            message = inbox.pop(0)
            kind = message.get("t")
            if kind == "exit":
                return
            if kind == protocol.UNDECODABLE:  # a task we cannot read: say so, never leave it hanging
                if message.get("of") == "task" and message.get("task"):
                    self.send({"t": "result", "task": message["task"], **failure("permanent", PayloadError(
                        f"the task could not be decoded: {message.get('error')}")),
                        "cpu": 0.0, "children": False})
                continue
            if kind == "go":  # the supervisor has swept the last attempt's leftover processes
                reap_killed(message.get("reap") or ())  # those that were ours (we are their subreaper)
                self.held = False
                inbox[:0], held = held, []
                continue
            if kind != "task":
                continue
            if self.held:  # a queued task waits until the leftovers of the last one are gone
                held.append(message)
                continue
            if message.get("concurrent"):  # an async handler beside others (async_concurrency)
                with self.lock:  # a cancel the watcher said was dropped before this read: it never starts
                    if self.dropped.pop(message["task"], None) is None:
                        self.concurrent_tasks().submit(message)
                continue
            with self.lock:
                if self.dropped.pop(message["task"], None) is not None:
                    continue  # cancelled while queued (the watcher said so): it never starts
                start_by = message.get("start_by")
                if start_by is not None and time.monotonic() >= start_by:
                    # Queued too long (behind a handler that may have held the GIL, so the
                    # watcher could not hear a cancel): the supervisor releases it itself.
                    self.ctrl.sendall(dropped_frame(message["task"], RELEASED))
                    continue
                self.task = message["task"]
                self.cancellation = Cancellation()
                self.progress.pending = None
            self.run_one(message)

    def run_one(self, message: dict[str, Any]) -> None:
        """Run the task of ``message`` (this runner's current task by now) under its
        rlimits, measure it and send its result; then, if it left threads running after
        its cancel, wait for them and say ``threads_done``."""
        self.peak.reset()
        started = time.monotonic()
        limits = message.get("limits")
        self.limits.apply(limits)
        before = resource.getrusage(resource.RUSAGE_SELF)
        kids_peak = bool(limits) and bool(limits.get("rlimit_data"))  # no cgroup counts the tree's memory
        kids_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if kids_peak else 0
        # the threads alive as it starts (those it leaves running after a cancel are the
        # others): while only main and the cancel watcher live, the set noted at the start
        threads_before = (self.own_threads if threading.active_count() == len(self.own_threads)
                          else frozenset(t.ident for t in threading.enumerate()))
        # "t" and "task" first: the head of every frame names its task (protocol._TASK_HEAD)
        result = {"t": "result", "task": message["task"], **self.run_task(message)}
        if limits and limits.get("max_processes") and limits.get("count_tree"):
            result["tree_count"] = self.tree_count()
        if self.cancellation.is_set() or not result.get("ok"):
            # a cancelled or failed attempt may leave threads of its own running
            # (asyncio.to_thread, an executor, threads the handler started): its retry must
            # not run beside them, so this child says so, takes nothing more until they
            # end, and is killed if they outlive kill_grace (a success has no retry)
            lingering = lingering_threads(self.handlers.event_loop, threads_before)
            if lingering:
                result["lingering"] = [t.name for t in lingering]
        after = resource.getrusage(resource.RUSAGE_SELF)
        # The peak is forensics of failed and long attempts; a quick success skips the read.
        slow = not result.get("ok") or time.monotonic() - started >= PEAK_READ_AFTER
        result.update({
            "began": started,  # CLOCK_MONOTONIC, one clock for every process of the machine: its start
            "cpu": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 6),
            "cpu_total": after.ru_utime + after.ru_stime,  # the parent's baseline for the next task
            "maxrss_kb": peak_rss_kb() if slow else None, "cancel_reason": self.cancellation.reason,
            "children": has_own_children(),  # the parent scans for leftovers only then
        })
        if message.get("rss"):  # max_child_rss: judged on the RSS between tasks, not during the next one
            result["rss"] = current_rss()
        if self.limits.nofile_pinned:  # only tasks with a max_open_files as small from now on
            result["nofile_pinned"] = True
        if kids_peak:  # the largest descendant waited for during the task (the tree's forensics)
            kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            if kids > kids_before:
                result["children_maxrss_kb"] = kids
        with self.lock:
            result["progress"], self.progress.pending = self.progress.pending, None
        frame = result_frame(result, self.limit)
        # the supervisor answers "go" once it swept the attempt's processes; never while
        # its threads run (it kills this child instead)
        self.held = bool(result["children"]) or bool(result.get("lingering"))
        with self.lock:
            self.ctrl.sendall(frame)
        if result.get("lingering"):  # the attempt is over once they are (or when it is killed)
            for thread in lingering:
                thread.join()
            self.held = bool(result["children"])
            self.send({"t": "threads_done", "task": message["task"]})
        with self.lock:
            self.task = None

    def tree_count(self) -> dict[str, Any]:
        """This task's tree as its handler ended, where no pids cgroup holds its
        ``max_processes``: its processes and tasks now (this runner included, zombies
        too), and the ``RLIMIT_NPROC`` it ran under (None: none). A tree at that rlimit is
        one over its cap; one with more processes than its cap is over it: the supervisor
        names the attempt ``process_limit`` (a burst between two of its looks)."""
        processes, tasks = tree_size()
        return {"processes": processes, "tasks": tasks, "nproc": self.limits.nproc}



def serve(ctrl_fd: int, cancel_fd: int, limit: int, *,
          modules: dict[tuple[str, str | None], Any] | None = None, preload: list[list[Any]] | None = None,
          entered: dict[str, Any] | None = None, userns: bool | str | None = None) -> None:
    """Run as a child whose death with its parent is already arranged: become a child
    subreaper, ignore Ctrl-C (the programs its steps start do not), serve tasks (under
    ``SCHED_BATCH`` once ready; ``modules``: those imported already, a zygote's;
    ``preload``, ``entered``, ``userns``: see :meth:`Runner.loop`). Then exit."""
    adopt_orphans()
    signal.signal(signal.SIGINT, ignore_interrupt)  # Ctrl-C is the supervisor's to handle
    ctrl = socket.socket(fileno=ctrl_fd)
    try:
        Runner(ctrl, cancel_fd, limit, modules).loop(preload, entered, userns)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor went away (or recycled us): nothing left to report to
    os._exit(0)


def main(argv: list[str]) -> None:
    """``CTRL_FD CANCEL_FD PARENT_PID LIMIT`` (a spawned child), or ``zygote FD
    SUPERVISOR_PID LIMIT`` (the zygote, :mod:`cyclone_mp._zygote`: its children show
    ``forked`` there instead)."""
    if argv and argv[0] == "zygote":
        from . import _zygote  # lazy: the zygote's own path

        _zygote.main(argv[1:])
        return
    ctrl_fd, cancel_fd, parent_pid, limit = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    die_with_parent(parent_pid)
    userns = None
    if os.environ.pop(USERNS_ENV, "") == "1":  # while single-threaded: the kernel's rule
        userns = own_user_namespace() or True
    serve(ctrl_fd, cancel_fd, limit, userns=userns)


if __name__ == "__main__":
    main(sys.argv[1:])
