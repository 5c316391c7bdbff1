"""Async handlers run side by side in one child (the step option ``async_concurrency``).

A task marked ``concurrent`` does not take the child's main loop: it becomes a task on an
event loop of its own thread, with its own :class:`~cyclone_mp.context.Context` and
cancellation, and the main loop goes on reading the next tasks. Each sends its own result
when it ends (the frame written under the runner's lock). A cancel for its token cancels
its asyncio task; what cannot be cancelled (a loop blocked in C) is the supervisor's to
kill, which ends the child and every task in it.

Part of the child; imported only by a child that gets such a task.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from ._tasks import failure_of, spawned_of, success_of, with_spawns
from .context import Cancellation, Context
from .errors import Permanent, Snooze


class ConcurrentTasks:
    """The child's concurrent async tasks, on a loop thread of their own.

    Args:
        runner: the child's :class:`cyclone_mp._child.Runner` (its ``handlers``,
            :class:`~cyclone_mp._handler.Handlers`, its ``send_result`` and ``progress_for``).
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[str, tuple[asyncio.Future[Any] | None, Cancellation]] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cyclone-concurrent", daemon=True)
        self.thread.start()

    def submit(self, message: dict[str, Any]) -> None:
        """Start the task of ``message`` on the loop (returns at once)."""
        token = message["task"]
        cancellation = Cancellation()
        with self.lock:
            self.tasks[token] = (None, cancellation)
        future = asyncio.run_coroutine_threadsafe(self._run(message, cancellation), self.loop)
        with self.lock:
            if token in self.tasks:
                self.tasks[token] = (future, cancellation)

    def cancel(self, token: str, reason: str) -> bool:
        """Cancel the task of ``token`` (False: not one of ours)."""
        with self.lock:
            entry = self.tasks.get(token)
        if entry is None:
            return False
        entry[1].set(reason)
        return True

    async def _run(self, message: dict[str, Any], cancellation: Cancellation) -> None:
        token = message["task"]
        started = time.monotonic()
        try:
            result = await self._attempt(message, cancellation)
        except BaseException as exc:  # noqa: BLE001 - a task's failure is its outcome
            result = failure_of(exc, cancellation)
        finally:
            with self.lock:
                self.tasks.pop(token, None)
        # "t" and "task" first: the head of every frame names its task
        self.runner.send_result({"t": "result", "task": token, **result, "children": False, "concurrent": True,
                                 "cancel_reason": cancellation.reason, "began": started,
                                 "elapsed": round(time.monotonic() - started, 6)})

    async def _attempt(self, message: dict[str, Any], cancellation: Cancellation) -> dict[str, Any]:
        inputs = self.runner.handlers.inputs_of(message)
        ctx = Context(run_id=message["run_id"], step_name=message["step"], node=message["node"],
                      attempt=message["attempt"], deadline=self.runner.handlers.deadline_of(message), upstream=inputs[1],
                      progress_sink=self.runner.progress_for(message["task"]), cancellation=cancellation,
                      spawned=spawned_of(message))
        fn = self.runner.handlers.resolve(message["ref"])
        hooks = message.get("hooks") or {}
        for ref in hooks.get("start") or ():
            self.runner.handlers.resolve(ref)(ctx)
        coro = fn(ctx, self.runner.handlers.converted(fn, inputs[0]))
        if not asyncio.iscoroutine(coro):
            raise TypeError(f"async_concurrency needs an async def handler; {message['step']} returned "
                            f"{type(coro).__name__}")
        task = asyncio.ensure_future(coro)
        cancellation.on_set(lambda reason: self.loop.call_soon_threadsafe(
            task.cancel, f"cyclone_mp: attempt cancelled ({reason})"))
        try:
            output = await task
            result = with_spawns(success_of(output), ctx)
        except (Permanent, Snooze, Exception, asyncio.CancelledError) as exc:
            result = failure_of(exc, cancellation)
        if hooks.get("end"):
            self.runner.handlers.end_hooks(hooks["end"], ctx, result)
        return result

    def count(self) -> int:
        with self.lock:
            return len(self.tasks)

