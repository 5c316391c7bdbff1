"""What to say about errors no retry can heal: one line each, what is wrong and how to fix it.

Two kinds of failed attempt discard their step at once (:data:`cyclone_mp.decisions.UNHEALABLE_KINDS`):

- ``not_importable``: the child cannot find the handler. Its module does not import
  there (a missing package, an error or ``sys.exit`` in module-level code, a script
  that starts a supervisor at module level because it has no ``__main__`` guard), has
  no attribute of the handler's name, or that attribute is not callable.
- ``output_invalid``: the handler's output (or a progress value) breaks the payload
  boundary (:mod:`cyclone_mp.protocol`): not JSON, not storable by PostgreSQL, nested
  too deeply, or over ``max_payload``.

The child runner builds these messages (it imports this module only when such an error
happens, so a child's start does not pay for it); the supervisor logs them.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

from .errors import PayloadError, SupervisorInChild

MAIN_GUARD = "`if __name__ == '__main__':`"
#: How to fix an output that is not a JSON value.
JSON_HINT = ("return a JSON value: dicts, lists, strings, numbers, booleans or None "
             "(a dataclass or a pydantic model converts)")


class NotImportable(Exception):
    """The task's handler cannot be found in the child: its module does not import, has
    no attribute of its name, or that is not callable. The message says what to fix; the
    cause is the import's exception. The attempt fails with kind ``not_importable``."""


def where(ref: dict[str, Any]) -> str:
    """The handler's module as a user knows it: the script's path, else the module name."""
    return str(ref["path"]) if ref.get("path") else f"module {ref['module']}"


def import_failed(ref: dict[str, Any], exc: BaseException) -> str:
    """Why importing the handler's module raised ``exc`` in the child, and the fix."""
    place, name = where(ref), ref["qualname"]
    if isinstance(exc, SupervisorInChild):
        return (f"importing {place} starts a cyclone_mp supervisor at module level (client.run() or "
                f"client.start()): put that code under {MAIN_GUARD} (a handler's child imports "
                f"the module to find handler {name}, and a supervisor cannot start inside a handler's child)")
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, (int, str, type(None))) else type(exc.code).__name__
        return (f"importing {place} calls sys.exit({code!r}) at module level: put the script's own "
                f"code under {MAIN_GUARD} (a handler's child imports the module to find handler {name})")
    detail = one_line(exc)
    if isinstance(exc, ModuleNotFoundError) and not ref.get("path") and \
            ref["module"].split(".")[0] == (exc.name or "").split(".")[0]:
        return (f"the worker's children cannot import {place} ({detail}): run the worker where that "
                f"module imports (its directory on sys.path or PYTHONPATH, the same code on every worker)")
    if isinstance(exc, ImportError):
        return (f"importing {place} failed ({detail}): install what it imports for the worker's "
                f"Python ({sys.executable}), or fix the import")
    return (f"importing {place} raised {detail}: fix its module-level code so that it imports "
            f"(it runs again in every child that imports the module; a script's own code belongs "
            f"under {MAIN_GUARD})")


def no_attribute(ref: dict[str, Any], exc: BaseException) -> str:
    """The handler's module imports in the child but has no attribute of its name."""
    detail = f" ({one_line(exc)})" if "." in ref["qualname"] else ""  # which part is missing
    return (f"{where(ref)} has no attribute {ref['qualname']!r} in the worker's children{detail}: "
            f"define the handler at module level under that name, with the same code on every "
            f"worker (not only under {MAIN_GUARD} or another condition)")


def not_callable(ref: dict[str, Any], obj: Any) -> str:
    """The handler's name is bound to something that cannot be called in the child."""
    kind = type(obj).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return (f"{ref['qualname']} in {where(ref)} is {article} {kind}, not a callable handler, in the "
            f"worker's children: bind that name to the step's function fn(ctx, input)")


def not_json(detail: str) -> str:
    """An output ``json.dumps`` (or a dataclass's or a model's conversion) refused."""
    return f"handler output is not a JSON value ({detail}): {JSON_HINT}"


def too_deep(limit: int) -> str:
    return f"handler output is nested deeper than {limit} levels (the limit): return a flatter value"


def unstorable(problem: str) -> str:
    return (f"handler output cannot be stored in PostgreSQL: it contains {problem}: remove it from "
            f"the output's text (or encode the text, e.g. as base64)")


def too_big(size: int, limit: int) -> str:
    return (f"handler output is {size} bytes, over the max_payload limit of {limit} bytes: return less "
            f"(put large data in a file or a table and return where it is), or raise max_payload")


def bad_progress(exc: PayloadError) -> PayloadError:
    """What ``ctx.set_progress`` raises for a value outside the payload boundary: uncaught,
    the attempt fails as ``output_invalid``."""
    error = PayloadError(f"{exc}: ctx.set_progress takes numbers as done and total (text goes in message)")
    error.kind = "output_invalid"  # type: ignore[attr-defined]
    return error


def undecodable(why: Any) -> str:
    """A result frame the supervisor could not decode (the child let it through)."""
    return (f"the child's result could not be decoded ({why}): return a JSON value within the "
            f"payload rules (see docs/limits.md)")


def rejected(exc: BaseException) -> str:
    """An output the database refused to store."""
    return (f"the database rejected the handler's output ({one_line(exc)}): return a smaller value "
            f"that PostgreSQL's jsonb accepts")


def unsendable(exc: BaseException) -> str:
    """An output the supervisor could not encode for the database (a child that sent one
    past the payload rules its own checks hold)."""
    return (f"the handler's output could not be sent to the database ({one_line(exc)}): return a plain JSON "
            f"value that PostgreSQL's jsonb accepts")


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (the message's whitespace collapsed)."""
    try:
        text = " ".join(str(exc).split())
    except BaseException:  # noqa: BLE001 - a broken __str__ must not hide the failure
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
