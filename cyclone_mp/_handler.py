"""Finding and calling a child's handlers: a task's handler imported and checked, its input
converted to the handler's annotation, the ``mux`` hooks run around it, an ``async def``
handler run to its end on the child's own event loop (made once, kept between attempts;
the attempt's cancel cancels its task). The child's main loop (:mod:`cyclone_mp._child`)
and its side-by-side async tasks (:mod:`cyclone_mp._concurrent`) both call here.

Part of the child: it never touches the database.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

from . import unhealable
from ._tasks import (
    attribute,
    convert_input,
    failure_of,
    input_annotation,
    is_coroutine,
    load_module,
    success_of,
    task_inputs,
    with_spawns,
)
from .context import Cancellation, Context


class Handlers:
    """A child's handlers. ``modules``: the modules imported already (a zygote's), by
    ``(name, path)``; filled as tasks import more."""

    def __init__(self, modules: dict[tuple[str, str | None], Any] | None = None) -> None:
        self.modules: dict[tuple[str, str | None], Any] = modules if modules is not None else {}
        self._annotations: dict[Any, Any] = {}  # handler -> the input annotation to convert to
        self._resolved: dict[tuple[Any, ...], Any] = {}  # (module, qualname, path) -> (module, target, handler)
        self.event_loop: Any = None  # the event loop of async handlers: made once, reused

    def resolve(self, ref: dict[str, Any]) -> Any:
        """The handler function a task names (a Step object wraps it). Raises
        :class:`~cyclone_mp.unhealable.NotImportable` if its module raises at import
        (``MemoryError`` aside: the attempt's own memory), lacks the name, or the name is
        not callable. What a top-level name was found to be is kept, and used while the
        module still holds the same object under that name (reassigned or reloaded, it is
        looked up again)."""
        where = (ref["module"], ref["qualname"], ref.get("path"))
        found = self._resolved.get(where)
        if found is not None:
            module, target, fn = found
            if getattr(module, ref["qualname"], None) is target and getattr(target, "fn", target) is fn:
                return fn
        try:
            module = load_module(ref["module"], ref.get("path"), self.modules)
        except MemoryError:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the module's code raised
            raise unhealable.NotImportable(unhealable.import_failed(ref, exc)) from exc
        try:
            target = attribute(module, ref["qualname"])
        except AttributeError as exc:
            raise unhealable.NotImportable(unhealable.no_attribute(ref, exc)) from exc
        fn = getattr(target, "fn", target)
        if not callable(fn):
            raise unhealable.NotImportable(unhealable.not_callable(ref, fn))
        if "." not in ref["qualname"]:  # (a nested name is looked up each time)
            self._resolved[where] = (module, target, fn)
        return fn

    @staticmethod
    def deadline_of(task: dict[str, Any]) -> Any:
        """``ctx.deadline`` of a task: the supervisor's worker clock decides it (and may be
        skewed in tests), or None."""
        if task.get("deadline") is None:
            return None
        import datetime as dt  # here, not at import: a child starts faster without it

        return dt.datetime.fromtimestamp(task["deadline"], dt.timezone.utc)

    @staticmethod
    def inputs_of(task: dict[str, Any]) -> tuple[Any, Any]:
        """A task's ``(input, upstream)``; raises PayloadError (an input no retry can fix)."""
        return task_inputs(task)

    def converted(self, fn: Any, inp: Any) -> Any:
        """``inp`` as ``fn``'s input annotation asks (a dataclass, a pydantic model)."""
        if fn not in self._annotations:
            self._annotations[fn] = input_annotation(fn)
        return convert_input(self._annotations[fn], inp)

    def end_hooks(self, refs: list[dict[str, Any]], ctx: Context, result: dict[str, Any]) -> None:
        """``mux.on_attempt_end`` hooks: ``hook(ctx, outcome)``; what they raise is printed
        to stderr and changes nothing."""
        outcome = {"ok": bool(result.get("ok")), "kind": result.get("kind"), "error": result.get("message")}
        for ref in refs:
            try:
                self.resolve(ref)(ctx, outcome)
            except BaseException as exc:  # noqa: BLE001 - a hook never changes the attempt's outcome
                print(f"cyclone_mp: on_attempt_end hook {ref.get('qualname')} raised {exc!r}", file=sys.stderr)

    def call(self, task: dict[str, Any], ctx: Context, inp: Any, start_hooks: list[dict[str, Any]] | None,
             cancellation: Cancellation) -> dict[str, Any]:
        """Call the task's handler (after the ``mux.on_attempt_start`` hooks, whose error
        fails the attempt as the handler's would): the result, as plain data."""
        try:
            fn = self.resolve(task["ref"])
            for ref in start_hooks or ():
                self.resolve(ref)(ctx)
            output = fn(ctx, self.converted(fn, inp))
            if is_coroutine(output):  # an async def handler (or a callable that returns a coroutine)
                output = self.run_async(output, cancellation)
        except BaseException as exc:  # noqa: BLE001 - every handler error is an attempt's outcome
            return failure_of(exc, cancellation)
        return with_spawns(success_of(output), ctx)

    def run_async(self, coro: Any, cancellation: Cancellation) -> Any:
        """Run an async handler's coroutine to its end as a task on this child's event
        loop (made at the first async attempt, then reused). The attempt's cancel cancels
        the task from the watcher thread (``call_soon_threadsafe``), so the handler's
        ``await`` raises ``asyncio.CancelledError`` at once; a cancel that came before it
        started cancels it before its first step."""
        import asyncio  # here, not at import: a child of sync handlers starts faster without it

        if self.event_loop is None or self.event_loop.is_closed():
            self.event_loop = asyncio.new_event_loop()
        loop = self.event_loop
        task = loop.create_task(coro)

        def cancel(reason: str) -> None:
            try:
                loop.call_soon_threadsafe(task.cancel, f"cyclone_mp: attempt cancelled ({reason})")
            except RuntimeError:  # the loop is closed: the attempt is over
                pass

        cancellation.on_set(cancel)
        return loop.run_until_complete(task)
