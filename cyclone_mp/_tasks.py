"""What the child runner does with one task, besides running it: finding the handler
(:func:`import_ref`, by module and qualified name, a script by its path), reading its
inputs (the input, the upstream outputs, a join's map outputs, the runs its upstream
spawned) and converting them to the handler's annotated type, turning its output into a
JSON value, and describing a failure. Child-side: it imports no more than the runner.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

from . import protocol, unhealable
from .context import Cancellation, Context
from .errors import Cancelled, PayloadError, Permanent, Snooze
from .protocol import storable, unstorable

# error kinds this runner reports besides "error", "permanent" and "cancelled" (cyclone_mp.decisions)
OUTPUT_INVALID, NOT_IMPORTABLE, MEMORY_ERROR, EXIT = "output_invalid", "not_importable", "memory_error", "exit"
SNOOZE = "snooze"  # a result's kind: the handler raised cy.Snooze (its "snooze": seconds)


def reap_killed(pids: Any) -> None:
    """Reap the leftover processes the supervisor killed that are this child's own (a
    subreaper adopts its handlers' orphans): they would stay zombies until it exits. Only
    those pids: a process a handler's ``Popen`` still tracks is never taken from it."""
    for pid in pids:
        try:
            os.waitpid(int(pid), os.WNOHANG)
        except (ChildProcessError, OSError, ValueError, TypeError):
            pass


def is_coroutine(value: Any) -> bool:
    """True for a coroutine object (what calling an ``async def`` handler returns),
    without importing asyncio or inspect for the sync handlers' sake."""
    return type(value).__name__ == "coroutine" and hasattr(value, "send") and hasattr(value, "cr_frame")


def is_cancelled_error(exc: BaseException) -> bool:
    """True for ``asyncio.CancelledError`` (asyncio is only imported once some handler used it)."""
    asyncio = sys.modules.get("asyncio")
    return asyncio is not None and isinstance(exc, asyncio.CancelledError)


def dropped_frame(token: str, reason: str) -> bytes:
    """The result frame of a queued task given back unstarted (``reason``: the cancel's)."""
    return protocol.encode({
        "t": "result", "task": token, "ok": False, "kind": "cancelled", "dropped": True,
        "type": "cyclone_mp.errors.Cancelled", "cancel_reason": reason,
        "message": f"cancelled before it started ({reason})", "cpu": 0.0, "children": False,
    })


def import_ref(ref: dict[str, Any], cache: dict[tuple[str, str | None], Any] | None = None) -> Any:
    """Import ``ref["module"]`` (or, for a script, load ``ref["path"]``) and return the
    attribute ``ref["qualname"]``."""
    return attribute(load_module(ref["module"], ref.get("path"), cache), ref["qualname"])


def attribute(module: Any, qualname: str) -> Any:
    """``module``'s attribute ``qualname``, dots walking attributes (AttributeError if missing)."""
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def load_module(name: str, path: str | None, cache: dict[tuple[str, str | None], Any] | None = None) -> Any:
    """Import module ``name`` (or, for a script, load ``path``). A script's ``__main__``
    is loaded as ``__mp_main__``, so its ``if __name__ == "__main__":`` block does not
    run (as multiprocessing does). A script that fails to load is not left half-run in
    ``sys.modules`` (as ``import`` does), so the next try raises the same error."""
    module = cache.get((name, path)) if cache is not None else None
    if module is not None:
        return module
    if path and (name in ("__main__", "__mp_main__") or name not in sys.modules):
        load_name = "__mp_main__" if name in ("__main__", "__mp_main__") else name
        import importlib.util as import_util  # deferred: children start faster without it

        spec = import_util.spec_from_file_location(load_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = import_util.module_from_spec(spec)
        sys.modules[load_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(load_name, None)
            raise
    else:
        module = importlib.import_module(name)
    if cache is not None:
        cache[(name, path)] = module
    return module


def failure(kind: str, exc: BaseException, message: str | None = None) -> dict[str, Any]:
    """Describe an exception as plain data: type, message (``message``, else ``str(exc)``)
    and traceback (never pickled)."""
    exc_type = type(exc)
    try:
        message = str(exc) if message is None else message
    except BaseException:  # noqa: BLE001 - a broken __str__ must not lose the failure
        message = f"<{exc_type.__name__}: str() failed>"
    try:
        import traceback  # lazy: only a failure needs it

        tb = "".join(traceback.format_exception(exc))
    except BaseException:  # noqa: BLE001
        tb = f"{exc_type.__name__}: {message}"
    return {
        "ok": False, "kind": kind, "type": storable(f"{exc_type.__module__}.{exc_type.__qualname__}"),
        "message": storable(message[:10_000]), "traceback": storable(tb[-50_000:]),
    }


def exit_message(code: Any) -> str:
    """The stored message of a handler's ``sys.exit(code)``: it names SystemExit and the
    exit code the process would have had (0 for None, 1 for a message)."""
    if code is None:
        return "SystemExit: exit code 0 (sys.exit() without a code)"
    if isinstance(code, int) and not isinstance(code, bool):
        return f"SystemExit: exit code {code}"
    return f"SystemExit: exit code 1 ({str(code)[:1000]})"


def task_inputs(task: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The task's input and upstream outputs. Either is a value (``input``,
    ``upstream``) or, from a supervisor that hands them on undecoded, JSON text
    (``input_json``, ``upstream_json``), decoded here with the payload rules; the outputs
    of upstream map nodes (``maps``) are read from the files the supervisor wrote
    (:func:`cyclone_mp.mapped.read`).

    Raises:
        PayloadError: a text that cannot be decoded (nested deeper than ``MAX_DEPTH``...).
    """
    text = task.get("input_json")
    if text is not None:
        inp = None if text == "null" else protocol.load_value(text, "the run's input")  # (no input: not read)
    else:
        inp = task.get("input")
    text = task.get("upstream_json")
    if text is not None:
        upstream = None if text == "{}" else protocol.load_value(text, "the upstream outputs")  # (no upstream)
    else:
        upstream = task.get("upstream")
    if task.get("maps"):  # upstream map nodes: their outputs in the files the supervisor wrote
        from . import mapped  # lazy: only a join's task reads map outputs

        upstream = dict(upstream or {})
        for node, outputs in task["maps"].items():
            upstream[node] = mapped.read(outputs["path"], outputs["count"], outputs.get("list", True))
    return inp, upstream or {}


def spawned_of(task: dict[str, Any]) -> Any:
    """The runs the upstream nodes spawned (``ctx.spawned``), sent as JSON text for a node
    that waits for them; None otherwise."""
    text = task.get("spawned_json")
    return protocol.load_value(text, "the spawned runs") if text is not None else None


def with_spawns(result: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """A successful result carries what the handler spawned (``ctx.spawn``): the
    supervisor enqueues it with the completion; a failed one drops it."""
    if result.get("ok") and ctx.spawns:
        result["spawns"] = ctx.spawns
    return result


def input_annotation(fn: Any) -> Any:
    """The annotation of the handler's second parameter (its input), or None."""
    import inspect  # lazy: inspect is slow to import; only typed inputs need it

    try:
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2:
            return None
        ann = getattr(fn, "__annotations__", {}).get(params[1].name)
        if isinstance(ann, str):
            ann = inspect.get_annotations(fn, eval_str=True).get(params[1].name)
        return ann
    except (ValueError, TypeError, NameError):
        return None


def is_dataclass_type(obj: Any) -> bool:
    """``dataclasses.is_dataclass`` for a class, without importing dataclasses."""
    return isinstance(obj, type) and hasattr(obj, "__dataclass_fields__")


def convert_input(ann: Any, inp: Any) -> Any:
    """dict -> dataclass or pydantic model per the annotation; anything else unchanged."""
    if isinstance(ann, type) and isinstance(inp, dict):
        if is_dataclass_type(ann):
            return ann(**inp)
        if hasattr(ann, "model_validate"):
            return ann.model_validate(inp)
    return inp


def to_json_value(output: Any) -> Any:
    """dataclass and pydantic outputs become plain JSON values."""
    if hasattr(type(output), "__dataclass_fields__") and not isinstance(output, type):
        import dataclasses  # lazy: only dataclass outputs need it

        return dataclasses.asdict(output)
    if hasattr(output, "model_dump") and callable(output.model_dump):
        return output.model_dump(mode="json")
    return output


def success_of(output: Any) -> dict[str, Any]:
    """A returned output as a result (``output_invalid`` when it is not a JSON value)."""
    try:
        return {"ok": True, "output": to_json_value(output)}
    except Exception as exc:  # noqa: BLE001 - e.g. dataclasses.asdict deep-copying a Lock
        return failure(OUTPUT_INVALID, TypeError(unhealable.not_json(str(exc))))

def failure_of(exc: BaseException, cancellation: Cancellation) -> dict[str, Any]:
    """What a handler raised, as a result: its kind, type, message and traceback."""
    if isinstance(exc, Cancelled):
        return failure("cancelled", exc)
    if isinstance(exc, unhealable.NotImportable):  # the import's own exception and traceback, with what to fix
        return failure(NOT_IMPORTABLE, exc.__cause__ or exc, str(exc))
    if isinstance(exc, Permanent):
        return failure("permanent", exc.error if isinstance(exc.error, BaseException) else exc)
    if isinstance(exc, Snooze):  # run again later, no attempt spent
        return {"ok": False, "kind": SNOOZE, "snooze": exc.seconds, "type": "cyclone_mp.errors.Snooze",
                "message": str(exc)}
    if isinstance(exc, MemoryError):
        return failure(MEMORY_ERROR, exc, f"MemoryError: {exc}" if str(exc) else
                       "MemoryError: the handler ran out of memory (an allocation failed)")
    if isinstance(exc, SystemExit):
        return failure(EXIT, exc, exit_message(exc.code))
    if cancellation.is_set() and is_cancelled_error(exc):  # our cancel, seen as CancelledError
        return failure("cancelled", exc)
    kind = getattr(exc, "kind", None) if isinstance(exc, PayloadError) else None
    return failure(kind or "error", exc)


def result_frame(result: dict[str, Any], limit: int) -> bytes:
    """The result's frame (``limit``: max_payload, bytes). An output outside the payload boundary (not JSON, not
    storable in jsonb, nested deeper than ``MAX_DEPTH``, over ``max_payload``) is
    never sent: the attempt fails with kind ``output_invalid`` instead, which discards
    its step (the same code returns the same output on every attempt)."""
    try:
        frame = protocol.encode_own(result) if _written_alike(result) else protocol.encode(result)
    except RecursionError:
        return _invalid(result, PayloadError(unhealable.too_deep(protocol.MAX_DEPTH)))
    except (TypeError, ValueError) as exc:
        return _invalid(result, TypeError(unhealable.not_json(str(exc))))
    output = result.get("output")
    if protocol.too_deep(frame, output, wrapping=1):
        return _invalid(result, PayloadError(unhealable.too_deep(protocol.MAX_DEPTH)))
    problem = unstorable(output) if b"\\u" in frame else None
    if problem:
        return _invalid(result, ValueError(unhealable.unstorable(problem)))
    if len(frame) > limit:  # then measure the output alone (max_payload is the output's limit)
        size = len(json.dumps(output, separators=(",", ":"), allow_nan=False).encode())
        if size > limit or len(frame) > limit + protocol.FRAME_ENVELOPE:
            return _invalid(result, PayloadError(unhealable.too_big(size, limit)))
    return frame

def _written_alike(result: dict[str, Any]) -> bool:
    """True when orjson (:func:`~cyclone_mp.protocol.encode_own`, several times faster)
    writes ``result`` as the same JSON as the json module, at the same length (a float's
    exponent aside: ``1e-7`` for ``1e-07``), so every limit decides as before: a success
    whose output is None, a bool, an ASCII string without DEL (which the json module
    escapes), a finite float or an integer orjson holds, with no spawns, progress or
    lingering threads (values of the handler's). Anything else (a failure's message, a
    dict, a UUID or an Enum orjson would accept where the json module refuses it) goes
    through :func:`~cyclone_mp.protocol.encode`."""
    if result.get("ok") is not True or result.get("spawns") or result.get("progress") is not None \
            or "lingering" in result:
        return False
    output = result.get("output")
    kind = type(output)
    if output is None or kind is bool:
        return True
    if kind is str:
        return output.isascii() and "\x7f" not in output
    if kind is int:
        return -(1 << 63) <= output < (1 << 64)
    return kind is float and math.isfinite(output)


def _invalid(result: dict[str, Any], exc: BaseException) -> bytes:
    result.pop("output", None)
    result.pop("progress", None)  # checked when it was set, but it must not sink the report
    result.update(failure(OUTPUT_INVALID, exc))
    return protocol.encode(result)
