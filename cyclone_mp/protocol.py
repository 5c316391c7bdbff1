"""Messages between the supervisor and a child: length-prefixed JSON frames, and the
one payload boundary every JSON value crossing the engine goes through.

Nothing crosses the pipe as pickle: a child turns its handler's return value into JSON
and its exceptions into ``{type, message, traceback}`` before sending, so an
unpicklable exception or a non-JSON output can never break the parent (SPEC 2,
scenario SC-10). The cancellation pipe carries one text line per cancel:
``"<task> <reason>\\n"``.

The payload boundary: an enqueue input, a signal payload, a handler output
and a progress value must each be a JSON value PostgreSQL can store (no NUL, no lone
surrogate, no NaN), nested at most :data:`MAX_DEPTH` levels, and at most
``max_payload`` bytes as JSON text. :func:`check_value` says so in the producer (a
:class:`~cyclone_mp.errors.PayloadError` at enqueue or signal) and the child checks its
handler's output before sending it (a failed attempt of kind ``output_invalid``).
Decoding is per frame: :meth:`FrameReader.feed` turns a frame it cannot decode into an
``{"t": "undecodable"}`` marker in its place and never loses its neighbours.
"""

from __future__ import annotations

import json
import re
import struct

import orjson

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

from .errors import PayloadError, UnstorableText

HEADER = struct.Struct(">Q")
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024  # bytes per message; larger outputs become a stored error
SLOT_CGROUPS = ("v2", "memory", "pids")  # a slot's cgroup directories by hierarchy (limits.slot.Slot.dirs' keys)
#: Bytes asked of one ``recv`` on a child's socket (either end): under glibc's mmap
#: threshold (128 KiB), so the buffer comes from the heap. ``recv(1 << 20)`` mapped,
#: resized and unmapped a fresh 1 MiB per read (three system calls; 20.5 us against
#: 3.8 us for a 300-byte frame). Larger frames take more reads.
READ_CHUNK = 1 << 16
ZYGOTE_MESSAGE_MAX = 1 << 18  # bytes of one message on the zygote's socket (a fork names the modules a child imports itself)
#: The largest ``max_payload`` allowed: jsonb's own limit on one value (268,435,455 bytes).
MAX_PAYLOAD_LIMIT = 268_435_455
#: Levels of nesting a JSON value may have (``[[1]]`` has 2). Python's json module
#: recurses once per level, in C but against the interpreter's recursion limit (1,000
#: by default, shared with the Python frames below the call in 3.11): a value about
#: 990 deep encoded in a shallow child failed to decode in the parent, and the driver's
#: jsonb loader, dataclass and pydantic conversion recurse the same way. 200 levels plus
#: the 2 that frames wrap around a value leave about 800 frames for the code that calls
#: the decoder, in every process. (Ruby's JSON parser stops at 100 by default,
#: serde_json at 128; hand-written data rarely nests past 20.)
MAX_DEPTH = 200
#: The largest task frame a child reads: PostgreSQL's own limit on one text value (1
#: GiB). A task carries the run's input and its upstream outputs, each within
#: ``max_payload``, so a fan-in may exceed ``max_payload`` many times; the parent is trusted.
TASK_FRAME_LIMIT = 1 << 30
#: Bytes a frame may carry beyond ``max_payload`` for its envelope (the result's fields,
#: its last progress value of at most 64 KiB): the parent reads frames up to
#: ``max_payload + FRAME_ENVELOPE``, so an output of ``max_payload`` bytes gets through.
FRAME_ENVELOPE = 128 * 1024


def upstream_limit(max_payload: int) -> int:
    """The most bytes a step's upstream outputs may total as one JSON object (text): what a
    task frame (:data:`TASK_FRAME_LIMIT`, PostgreSQL's own limit on one text value) holds
    beside an input of ``max_payload`` bytes and the frame's envelope."""
    return TASK_FRAME_LIMIT - max_payload - FRAME_ENVELOPE


def upstream_too_big(node: str, outputs: int, size: int, limit: int) -> str:
    """What a step whose upstream outputs total ``size`` bytes (``outputs`` of them), over
    ``limit`` (:func:`upstream_limit`), fails with (permanently: they never shrink)."""
    return (f"the upstream outputs of step {node!r} total {size / 1e6:.1f} MB ({outputs} outputs), over the "
            f"{limit / 1e6:.0f} MB a step's upstream outputs may total (they reach the step as one JSON text, "
            f"and PostgreSQL's text values hold at most 1 GB)")
UNDECODABLE = "undecodable"  # the ``t`` of the marker FrameReader puts in place of a bad frame
#: The head of every frame that belongs to a task: ``{"t":KIND,"task":TOKEN``, so the
#: task of a frame that cannot be decoded is still known.
_TASK_HEAD = re.compile(rb'\{"t":"([a-z_]{1,32})","task":"([^"\\]{1,200})"')
PRELOAD_ENV = "CYCLONE_MP_PRELOAD"  # a child's environment: JSON [[module, path or null], ...] to import before "ready"



class ProtocolError(Exception):
    """A frame was malformed or larger than the limit."""


def storable(text: str) -> str:
    """``text`` without what PostgreSQL text and jsonb refuse: NUL and lone surrogates (escaped)."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def depth_over(value: Any, limit: int = MAX_DEPTH) -> bool:
    """True when ``value`` nests lists or dicts more than ``limit`` levels deep (an
    explicit stack: never a RecursionError, whatever the depth)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, (list, tuple)):
            items = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in items)
    return False


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (our encoders escape every non-ASCII character)
_STRING_B = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NOT_BRACKET_B = re.compile(rb"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")  # one level per pass: re.sub never rescans what it joined
_INNERMOST_B = re.compile(rb"\[\]|\{\}")


def text_depth_over(text: str | bytes, limit: int = MAX_DEPTH) -> bool:
    """True when the JSON ``text`` nests more than ``limit`` levels. In C-speed passes:
    strings are cut out, every character but brackets dropped, then each pass removes
    the innermost ``[]``/``{}`` pairs (one level); ``limit`` passes that leave brackets
    mean a deeper value. Most values are wide, not deep: a few passes empty them."""
    if isinstance(text, bytes):
        string, not_bracket, innermost = _STRING_B, _NOT_BRACKET_B, _INNERMOST_B
    else:
        string, not_bracket, innermost = _STRING, _NOT_BRACKET, _INNERMOST  # type: ignore[assignment]
    rest = not_bracket.sub(type(text)(), string.sub(type(text)(), text))  # type: ignore[arg-type]
    for _ in range(limit):
        if not rest:
            return False
        rest, removed = innermost.subn(type(text)(), rest)  # type: ignore[arg-type]
        if not removed:
            return False  # unbalanced: not our encoder's output; the decoder will say so
    return bool(rest)


def too_deep(text: str | bytes, value: Any, wrapping: int = 0) -> bool:
    """``value`` nests deeper than :data:`MAX_DEPTH`; ``text`` is JSON holding it, in
    ``wrapping`` levels of containers (a frame around it). Counting brackets (C) rules
    out almost every value; past that, :func:`text_depth_over` decides, and the value
    itself is walked only when the text is too deep (the wrapping may hold other deep
    values)."""
    if isinstance(text, str):
        brackets = text.count("[") + text.count("{")
    else:
        brackets = text.count(b"[") + text.count(b"{")
    return (brackets > MAX_DEPTH and text_depth_over(text, MAX_DEPTH + wrapping)
            and (wrapping == 0 or depth_over(value)))


def check_value(value: Any, what: str, max_bytes: int) -> str:
    """``value`` as JSON text, checked against the payload boundary (see the module
    docstring): a JSON value, storable in jsonb, at most :data:`MAX_DEPTH` levels deep
    and ``max_bytes`` bytes long. ``what`` names it in the message ("input", ...).

    Raises:
        PayloadError: naming the rule and the limit (:class:`~cyclone_mp.errors.UnstorableText`
            for a NUL or a lone surrogate).
    """
    try:
        text = json.dumps(value, allow_nan=False)
    except RecursionError:
        raise PayloadError(f"{what} is nested deeper than {MAX_DEPTH} levels (the limit)") from None
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"{what} is not a JSON value: {exc}") from None
    if too_deep(text, value):
        raise PayloadError(f"{what} is nested deeper than {MAX_DEPTH} levels (the limit)")
    # json.dumps escapes every non-ASCII character, so a NUL or a lone surrogate shows
    # as "\u" in the text: without one, there is nothing to look for.
    problem = unstorable(value) if "\\u" in text else None
    if problem:
        raise UnstorableText(unstorable_message(what, problem))
    if len(text) > max_bytes:
        raise PayloadError(f"{what} is {len(text)} bytes, over the max_payload limit of {max_bytes} bytes")
    return text


def load_value(text: str | bytes, what: str) -> Any:
    """Decode JSON text from outside (a file, the command line, a raw column), with the
    rules of :func:`check_value` but the size.

    Raises:
        PayloadError: not UTF-8, not JSON, nested deeper than :data:`MAX_DEPTH`, or a
            number Python refuses (an integer over 4,300 digits).
    """
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if isinstance(raw, (bytes, bytearray)) and _orjson_reads_as_json(raw):  # as the json module reads it, faster
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the json module decides, and says why
    try:
        value = json.loads(text)
    except RecursionError:
        raise PayloadError(f"{what} is nested deeper than {MAX_DEPTH} levels (the limit)") from None
    except UnicodeDecodeError as exc:
        raise PayloadError(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise PayloadError(f"{what} is not valid JSON: {exc}") from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise PayloadError(f"{what} is not a JSON value Python accepts: {str(exc).split(';')[0]}") from None
    if too_deep(text, value):
        raise PayloadError(f"{what} is nested deeper than {MAX_DEPTH} levels (the limit)")
    return value


def unstorable(value: Any) -> str | None:
    """Why a JSON value cannot be stored in jsonb (a NUL or a lone surrogate), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, str):
            problem = unstorable_text(item)
            if problem:
                return problem
    return None


def unstorable_text(text: str) -> str | None:
    """Why PostgreSQL cannot store the string ``text`` (a NUL or a lone surrogate), or None."""
    if "\x00" in text:
        return "a NUL character (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (text that is not valid Unicode)"
    return None


def unstorable_message(what: str, problem: str) -> str:
    """The one message of a string PostgreSQL cannot store, wherever it is (``what``: "queue", "input"...)."""
    return f"{what} cannot be stored in PostgreSQL: it contains {problem}"


def check_text(text: str, what: str) -> str:
    """``text`` if PostgreSQL can store it (a name, a key).

    Raises:
        UnstorableText: it contains a NUL or a lone surrogate (:func:`unstorable_message`).
    """
    problem = unstorable_text(text)
    if problem:
        raise UnstorableText(unstorable_message(what, problem))
    return text


#: ``json.dumps(message, separators=(",", ":"), allow_nan=False)`` without building an
#: encoder per call (a child's frame per result).
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def encode(message: dict[str, Any]) -> bytes:
    """One frame: 8-byte big-endian length, then UTF-8 JSON (raises TypeError/ValueError)."""
    body = _ENCODE(message).encode()
    return HEADER.pack(len(body)) + body


def encode_own(message: dict[str, Any]) -> bytes:
    """A frame of a message the supervisor built itself (a task: strings, finite floats,
    integers within 64 bits, None, and dicts and lists of them), encoded by orjson, several
    times faster than :func:`encode`. Anything orjson refuses goes through
    :func:`encode`. Not for a handler's values: orjson writes NaN as ``null`` and has no
    ``allow_nan``."""
    try:
        body = orjson.dumps(message, option=_OWN_OPTIONS)
    except orjson.JSONEncodeError:
        return encode(message)
    return HEADER.pack(len(body)) + body


#: orjson leaves to :func:`encode` (which refuses them, as before) what the json module
#: would not encode: dataclasses, datetimes, subclasses of str, int, dict and list.
_OWN_OPTIONS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS


class FrameReader:
    """Incremental decoder: feed bytes, take whole messages. Rejects frames over ``limit``.

    Decoding is per frame: a frame that is not a JSON object (not UTF-8, not JSON, too
    deep for the decoder, an integer Python refuses) becomes, in its place, a marker
    ``{"t": "undecodable", "error": why, "size": bytes, "of": kind, "task": token}``
    (``of`` and ``task`` from the frame's head, or None), and the frames around it are
    decoded as usual.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add bytes; return every complete message, in order.

        Raises:
            ProtocolError: a frame header announces more than ``limit`` bytes (the
                stream cannot be trusted past it).
        """
        buf = self._buf
        buf += data
        out = []
        pos, end = 0, len(buf)
        head = HEADER.size
        spans = []  # (start, end) of each whole frame's body
        while end - pos >= head:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.limit:
                del buf[:pos]
                raise ProtocolError(f"message of {size} bytes exceeds the {self.limit}-byte limit")
            if end - pos < head + size:
                break
            spans.append((pos + head, pos + head + size))
            pos += head + size
        grouping = True  # until a group fails the gate: then its frames, and the rest, one by one
        for first in range(0, len(spans), GATED_TOGETHER):
            group = spans[first:first + GATED_TOGETHER]
            # one gate for the group: what holds for all of its bytes holds for each frame
            gated = grouping = grouping and len(group) > 1 and _orjson_reads_as_json(buf[group[0][0]:group[-1][1]])
            for start, stop in group:
                out.append(decode_frame(buf[start:stop], gated=gated))
        del buf[:pos]  # once for all the frames taken (not a move of the rest per frame)
        return out


#: Every digit as ``0``, every other byte as a space: a body translated by it holds
#: :data:`_LONG_RUN` where it holds 19 digits in a row (one C pass, where a regular
#: expression's search costs about 15 ns per byte).
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
#: 19 digits in a row: maybe an integer orjson cannot hold (it reads one over 64 bits as a
#: float, where the json module keeps every digit).
_LONG_RUN = b"0" * 19


#: Frames of one read whose bytes :func:`_orjson_reads_as_json` tests in one pass (a
#: group's brackets are counted together, so a larger group fails the test more often;
#: after a group fails, the read's other frames are tested one by one, as before).
GATED_TOGETHER = 16


def _orjson_reads_as_json(body: bytes | bytearray) -> bool:
    """True when orjson reads ``body`` exactly as the json module would, or refuses it: JSON
    text with no 19-digit run (no integer over 64 bits) and at most :data:`MAX_DEPTH`
    brackets in all (no nesting past the json module's own limit, about 1,000 levels,
    which orjson's 1,024 would let through). What orjson refuses (a lone surrogate escape,
    NaN, invalid UTF-8) goes to the json module anyway."""
    return (body.count(b"[") + body.count(b"{") <= MAX_DEPTH
            and _LONG_RUN not in body.translate(_DIGITS_AS_ZERO))


def decode_frame(body: bytes | bytearray, *, gated: bool = False) -> dict[str, Any]:
    """One frame's message, or the ``undecodable`` marker (see :class:`FrameReader`). A
    frame orjson reads exactly as the json module would (:func:`_orjson_reads_as_json`) is
    read by orjson, several times faster; anything else by the json module, whose rules
    hold (a lone surrogate escape is kept, an integer keeps every digit, too deep a value
    is refused). ``gated``: the bytes around ``body`` passed that test together, so it does."""
    if body[:2] == b'{"' and (gated or _orjson_reads_as_json(body)):
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the json module decides, and says why
        else:
            if isinstance(message, dict):
                return message
    try:
        message = json.loads(body)
        if isinstance(message, dict):
            return message
        why = f"a message must be a JSON object, not {type(message).__name__}"
    except RecursionError:
        why = "nested too deeply to decode"
    except UnicodeDecodeError as exc:
        why = f"not valid UTF-8 (byte {exc.start})"
    except ValueError as exc:  # not JSON, or an integer over Python's digit limit
        why = f"not valid JSON: {str(exc).split(';')[0]}"
    head = _TASK_HEAD.match(body)
    return {"t": UNDECODABLE, "error": why, "size": len(body),
            "of": head.group(1).decode() if head else None, "task": head.group(2).decode() if head else None}
