"""The outputs of a map node, as its join reads them (SPEC section 10, ``wf.map``).

A node after a map node gets the items' outputs in item order as ``ctx.upstream[name]``.
Children never read the cyclone tables (SPEC 1), so the supervisor that claimed the join
reads the items in pages of :data:`PAGE_ITEMS` (``map_outputs_page``, keyset by item
index) and writes them to a file, one JSON line per item (:class:`OutputsFile`): neither
the database nor the supervisor ever holds the whole list. The child then reads the file:
up to :data:`LIST_BYTES` it becomes a plain ``list``; past that an :class:`Outputs`
sequence that decodes the lines as they are iterated, so a 100,000-item map costs the
join's child one line at a time (plus 8 bytes an item once it is indexed).

An item a map with ``allow_failures=True`` discarded appears as an :class:`ItemFailed`.
"""

from __future__ import annotations

import array
import atexit
import dataclasses
import json
import os
import shutil
import tempfile
import uuid
TYPE_CHECKING = False  # annotations only: a child imports this module when a join starts
if TYPE_CHECKING:
    from typing import Any, Callable, Iterator

#: Items read per statement when a join's outputs are written out (keyset pages).
PAGE_ITEMS = 1000
#: Size in bytes of a map's outputs file up to which the join's child gets a plain list.
LIST_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ItemFailed:
    """In a join's list of outputs: the item of a map with ``allow_failures=True`` that was
    discarded (its attempts spent, or a permanent error).

    Attributes:
        item: the item's index in the list mapped (0-based).
        error: the item's last error message; error_kind: its kind (``error``,
            ``permanent``, ``timeout``...).
    """

    item: int
    error: str | None
    error_kind: str | None


def _decode(line: str) -> Any:
    """One line of an outputs file: ``[1, output]`` or ``[0, {item, error, error_kind}]``."""
    ok, value = json.loads(line)
    return value if ok else ItemFailed(value["item"], value.get("error"), value.get("error_kind"))


class OutputsFile:
    """The supervisor's side: a map's outputs written to ``path`` page by page, as the
    rows of ``map_outputs_page`` come (``item, ok, output`` as JSON text, ``error``,
    ``error_kind``); the output text is written as the database gave it, never decoded.

    Use as a context manager; ``count`` and ``last`` (the last item index written, -1
    before any) say where the next page starts.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0
        self.last = -1
        self._file = open(path, "w", encoding="utf-8")

    def write_page(self, rows: list[dict[str, Any]]) -> None:
        """Append one page of rows (in item order)."""
        lines = []
        for row in rows:
            if row["ok"]:
                lines.append(f"[1,{row['output']}]\n")
            else:
                lines.append(json.dumps([0, {"item": row["item"], "error": row["error"],
                                             "error_kind": row["error_kind"]}]) + "\n")
            self.last = row["item"]
        self.count += len(rows)
        self._file.write("".join(lines))

    def __enter__(self) -> "OutputsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
        if exc[0] is not None:
            discard(self.path)


_folder: list[str] = []  # this process's folder of outputs files, made on first use


def folder() -> str:
    """This supervisor's folder for outputs files (private to its user, removed at exit)."""
    if not _folder:
        path = tempfile.mkdtemp(prefix="cyclone-mp-maps-")
        atexit.register(shutil.rmtree, path, True)
        _folder.append(path)
    return _folder[0]


def write_outputs(call: Callable[[Callable[[Any], Any]], Any], run_id: str,
                  maps: list[list[Any]]) -> dict[str, dict[str, Any]]:
    """Write the outputs of each of ``maps`` (``[node, items]`` pairs, as ``load_payload``
    gives them) of run ``run_id`` to a file of its own, :data:`PAGE_ITEMS` items per
    statement; returns ``{node: {"path", "count", "list"}}`` for the join's task (``list``:
    the file is at most :data:`LIST_BYTES`, the child reads it whole into a list). ``call(fn)`` runs
    ``fn(store)`` on the caller's bounded connection. Files written before an error are
    deleted.

    Raises:
        DatabaseError: a page could not be read; OSError: a file could not be written.
    """
    written: dict[str, dict[str, Any]] = {}
    try:
        for node, _items in maps:
            path = os.path.join(folder(), f"{run_id}-{uuid.uuid4().hex}.jsonl")
            with OutputsFile(path) as out:
                written[node] = {"path": path, "count": 0}
                while True:
                    rows = call(lambda store, after=out.last: store.payloads.map_outputs_page(
                        run_id, node, after, PAGE_ITEMS))
                    out.write_page(rows)
                    if len(rows) < PAGE_ITEMS:
                        break
                written[node]["count"] = out.count
            written[node]["list"] = os.path.getsize(path) <= LIST_BYTES
    except BaseException:
        for entry in written.values():
            discard(entry["path"])
        raise
    return written


def discard(path: str | None) -> None:
    """Delete an outputs file (gone already: nothing to do)."""
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


class Outputs:
    """A map's outputs in item order, read from the file the supervisor wrote (see the
    module docstring): ``len()``, iteration (one line decoded at a time), indexing and
    slicing (an index of line offsets is built on first use), ``list(outputs)``.
    Read-only; equal to any sequence with the same values."""

    def __init__(self, path: str, count: int) -> None:
        self.path = path
        self._count = count
        self._offsets: array.array | None = None

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                yield _decode(line)

    def _index(self) -> array.array:
        if self._offsets is None:
            offsets = array.array("q")
            with open(self.path, "rb") as f:
                at = 0
                for line in f:
                    offsets.append(at)
                    at += len(line)
            self._offsets = offsets
        return self._offsets

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError("map output index out of range")
        with open(self.path, "rb") as f:
            f.seek(self._index()[index])
            return _decode(f.readline().decode("utf-8"))

    def __eq__(self, other: object) -> bool:
        try:
            return len(other) == self._count and all(a == b for a, b in zip(self, other))  # type: ignore[arg-type]
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"<map outputs: {self._count} items>"


def read(path: str, count: int, as_list: bool) -> list[Any] | Outputs:
    """A map's outputs for the join's ``ctx.upstream``: a list when ``as_list`` (the
    supervisor found the file at most :data:`LIST_BYTES`), else an :class:`Outputs`
    sequence over it."""
    if as_list:
        with open(path, encoding="utf-8") as f:
            return [_decode(line) for line in f]
    return Outputs(path, count)


def summary(items: dict[str, int]) -> str:
    """``10,000 items: 9,120 completed, 850 running, 30 available``: a map's items by
    state (``items`` as ``StepStatus.items`` has them: ``total`` and one count per state),
    the states in the order an operator reads them."""
    order = ("completed", "running", "available", "paused", "discarded", "cancelled", "pending")
    total = items.get("total") or 0
    parts = [f"{items[s]:,} {s}" for s in order if items.get(s)]
    noun = "item" if total == 1 else "items"
    return f"{total:,} {noun}" + (": " + ", ".join(parts) if parts else "")
