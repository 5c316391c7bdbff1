"""The payload boundary's pure rules, no process: frames decode one by one (a frame the
parent cannot decode becomes a marker in its place, never losing its neighbours), one
turn reads at most a megabyte of a child, and values and JSON texts are checked for
depth, encoding and size without recursing. What a real child and the engine make of the
same boundary is in ``tests/acceptance/test_hostile_payloads.py``."""

from __future__ import annotations

import enum
import json
import sys
import threading
import uuid

import pytest

from cyclone_mp import protocol
from cyclone_mp.errors import PayloadError

import hostile_handlers as hh
from hostile_support import LIMIT_WORDS, frame


# -- 2. one payload boundary: frames decode one by one ------------------------------------------


BAD_FRAMES = {
    "deep": ("[" * 5000 + "]" * 5000).encode(),
    "deep_result": b'{"t":"result","task":"7.3","ok":true,"output":' + b"[" * 5000 + b"]" * 5000 + b"}",
    # past the json module's depth (about 1,000), within orjson's (1,024): still refused
    "deep_for_json_only": b'{"t":"result","task":"7.3","ok":true,"output":' + b"[" * 1010 + b"]" * 1010 + b"}",
    "not_utf8": b'{"t":"progress","task":"7.3","done":"\xff\xfe"}',
    "not_json": b'{"t":"result","task":"7.3",',
    "not_an_object": b"[1, 2]",
    "huge_integer": b'{"t":"result","task":"7.3","ok":true,"output":' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_frame_reader_never_loses_a_frame_or_its_neighbours(case, chunk):
    """Issue 18 fault 2: a frame the parent cannot decode (975-990 deep: RecursionError)
    was dropped with every other message of the same read. Now it becomes an
    ``undecodable`` marker in its place, naming its task when its head says it."""
    before, after = {"t": "progress", "task": "7.3", "done": 1}, {"t": "result", "task": "7.4", "ok": True}
    data = protocol.encode(before) + frame(BAD_FRAMES[case]) + protocol.encode(after)
    reader = protocol.FrameReader(1 << 20)
    if chunk is None:
        got = reader.feed(data)
    else:
        got = [m for i in range(0, len(data), chunk) for m in reader.feed(data[i:i + chunk])]
    assert len(got) == 3, got
    assert got[0] == before and got[2] == after
    marker = got[1]
    assert marker["t"] == protocol.UNDECODABLE and marker["error"] and marker["size"] == len(BAD_FRAMES[case])
    if case in ("deep_result", "deep_for_json_only", "not_utf8", "not_json", "huge_integer"):
        assert marker["task"] == "7.3" and marker["of"] in ("result", "progress")
    else:
        assert marker["task"] is None


def test_the_supervisors_own_frames_read_back_as_the_json_module_reads_them():
    """Task frames are encoded by orjson (encode_own); what orjson refuses (a lone
    surrogate) goes through the json module, and a frame reads back the same either way."""
    task = {"t": "task", "task": "12.3", "attempt": 2, "timeout": 1.5, "start_by": None, "deadline": 1.7e9,
            "input_json": '{"name": "caf\u00e9 \"q\" \\ \u2603"}', "upstream_json": "{}",
            "ref": {"module": "m", "qualname": "f", "path": None}, "limits": {"memory_limit": 1 << 40}}
    odd = {**task, "input_json": "\ud800 lone", "node": "\ud800"}
    for message in (task, odd):
        data = protocol.encode_own(message)
        assert json.loads(data[protocol.HEADER.size:]) == message
        assert protocol.FrameReader(1 << 20).feed(data) == [message]


@pytest.mark.parametrize("output", [
    10 ** 25, -(2 ** 64), 2 ** 63 - 1, 0.1 + 0.2, 1e-320, 1.7976931348623157e308, "\ud800 lone", "caf\u00e9",
    {"n": [12345678901234567890, 1.5, None, True]}, "digits in text: 12345678901234567890123",
])
def test_a_childs_result_frame_reads_back_as_the_json_module_reads_it(output):
    """Results are read by orjson where it reads them exactly as the json module does, and
    by the json module otherwise: integers keep every digit, floats every bit, a lone
    surrogate escape stays."""
    result = {"t": "result", "task": "7.3", "ok": True, "output": output, "cpu": 0.000123, "children": False}
    data = protocol.encode(result)
    got = protocol.FrameReader(1 << 20).feed(data)
    assert got == [json.loads(data[protocol.HEADER.size:])]
    assert repr(got[0]["output"]) == repr(output)


def test_frame_reader_still_refuses_an_oversized_header():
    reader = protocol.FrameReader(1024)
    with pytest.raises(protocol.ProtocolError, match="exceeds the 1024-byte limit"):
        reader.feed(protocol.HEADER.pack(4096) + b"{}")


def test_one_turn_reads_at_most_a_megabyte_of_a_child_and_a_reaped_child_all():
    """A child streaming a 3 MiB result: each ``receive`` (one turn of process control)
    takes at most READS_PER_CALL reads of READ_CHUNK bytes and leaves the rest to the
    next turn, so one child cannot hold the loop. What a dead child left in its socket
    is read in one call (``max_reads=None``). The socket is a stand-in that always has
    more to give, so the bound is what stops a call."""
    import io

    from cyclone_mp.childproc import READS_PER_CALL, ChildProc

    class Stream:
        def __init__(self, data: bytes) -> None:
            self.data, self.reads = io.BytesIO(data), 0

        def recv(self, size: int) -> bytes:
            self.reads += 1
            return self.data.read(size)

    big = {"t": "result", "task": "1", "ok": True, "output": "x" * (3 << 20)}
    for max_reads in (READS_PER_CALL, None):
        child = ChildProc.__new__(ChildProc)  # its socket and reader only: no process
        child.sock, child.reader = Stream(protocol.encode(big)), protocol.FrameReader(1 << 30)
        got, calls = [], []
        while not got:
            before = child.sock.reads
            messages, eof = child.receive(max_reads=max_reads)
            got, calls = got + messages, calls + [child.sock.reads - before]
            assert not eof and len(calls) < 10
        assert got == [big]
        if max_reads is None:
            assert len(calls) == 1  # all of it at once
        else:
            assert calls[:3] == [READS_PER_CALL] * 3 and len(calls) == 4, calls  # 3 MiB + a header: 49 reads


@pytest.mark.parametrize("depth,ok", [(1, True), (200, True), (201, False), (985, False), (3000, False)])
def test_check_value_limits_depth_without_recursing(depth, ok):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # a producer that raised its limit (issue 18, fault 3) still gets the rule
    try:
        value = hh.nested(depth)
        if ok:
            assert json.loads(protocol.check_value(value, "input", 1 << 20)) == value
        else:
            with pytest.raises(PayloadError, match=LIMIT_WORDS):
                protocol.check_value(value, "input", 1 << 20)
    finally:
        sys.setrecursionlimit(old)


def test_depth_from_the_text_agrees_with_the_walk():
    """text_depth_over (regex passes over the JSON text) and depth_over (a walk of the
    value) agree, brackets and quotes inside strings included."""
    import random

    rng = random.Random(18)
    for _ in range(300):
        depth = rng.choice([1, 2, 50, 199, 200, 201, 202, 210, 400])
        value = rng.choice([[], {}, 'x[{"\\', 1])
        for _ in range(depth - (1 if isinstance(value, (list, dict)) else 0)):
            value = [value, ']}"[', {"a": [1]}] if rng.random() < 0.5 else {'k"[\\': value, "z": [[]]}
        text = json.dumps(value)
        expected = protocol.depth_over(value)
        assert protocol.text_depth_over(text) is expected
        assert protocol.text_depth_over(text.encode()) is expected
        assert protocol.text_depth_over(json.dumps(value, separators=(",", ":"))) is expected


def test_load_value_reports_each_bad_text():
    with pytest.raises(PayloadError, match=LIMIT_WORDS):
        protocol.load_value("[" * 5000 + "]" * 5000, "the file")
    with pytest.raises(PayloadError, match=LIMIT_WORDS):
        protocol.load_value("[" * 300 + "]" * 300, "the file")
    with pytest.raises(PayloadError, match="not valid UTF-8"):
        protocol.load_value(b'{"a": "\xff"}', "the file")
    with pytest.raises(PayloadError, match="4300 digits"):
        protocol.load_value("9" * 5000, "the value")
    with pytest.raises(PayloadError, match="not valid JSON"):
        protocol.load_value("{", "the value")
    assert protocol.load_value(b'{"a": [1, 2.5, "\xc3\xa9"]}', "x") == {"a": [1, 2.5, "é"]}


@pytest.mark.parametrize("value", [
    10 ** 25, -(2 ** 64), 2 ** 63 - 1, 0.1 + 0.2, 1e-320, "\ud800 lone", "caf\u00e9", None, [1, "x"],
    {"n": [12345678901234567890, 1.5, None, True], "s": "digits in text: 12345678901234567890123"},
])
def test_load_value_reads_a_text_as_the_json_module_reads_it(value):
    """A task's input is read by orjson where it reads it exactly as the json module does
    (no 19-digit run, few brackets), and by the json module otherwise: the same value,
    from text or bytes."""
    text = json.dumps(value)
    for given in (text, text.encode("utf-8", "surrogatepass")):
        got = protocol.load_value(given, "the input")
        assert repr(got) == repr(json.loads(text))


@pytest.mark.parametrize("text,words", [
    (b'{"a": "\xff"}', "not valid UTF-8"), ('{"a": ', "not valid JSON"), ("[" * 300 + "]" * 300, "nested deeper"),
])
def test_load_value_still_refuses_with_one_clear_error(text, words):
    with pytest.raises(PayloadError, match=words):
        protocol.load_value(text, "the input")


def test_a_digit_run_is_found_anywhere_in_a_frame():
    """The gate before orjson: 19 digits in a row anywhere (a number, a string, the end)
    send the frame to the json module; 18 do not."""
    for body, long in ((b'{"a":1234567890123456789}', True), (b'{"a":"x1234567890123456789"}', True),
                       (b'{"a":123456789012345678}', False), (b'{"a":1.23456789012345678,"b":9}', False)):
        assert protocol._orjson_reads_as_json(body) is not long


@pytest.mark.parametrize("odd", [None, 2 ** 64 + 1, "x" * 3 + "1234567890123456789", [[[[1]]]] * 60])
def test_frames_of_one_read_are_gated_together_and_read_as_the_json_module_reads_each(odd):
    """A read's frames pass the orjson gate together, a group at a time; a group holding
    one frame the gate refuses (a 19-digit run, an integer over 64 bits) or more brackets
    than one frame may hold in all reads each frame as the json module does."""
    messages = [{"t": "result", "task": f"7.{i}", "ok": True, "output": {"i": i, "xs": [i, None]}} for i in range(40)]
    if odd is not None:
        messages[21]["output"] = odd
    data = b"".join(protocol.encode(m) for m in messages)
    got = protocol.FrameReader(1 << 20).feed(data)
    assert got == [json.loads(json.dumps(m)) for m in messages]
    if isinstance(odd, int):
        assert type(got[21]["output"]) is int and got[21]["output"] == odd


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize("output,kept", [
    (None, True), ("plain", True), (True, True), (1.5, True), (2 ** 64 - 1, True), (-(2 ** 63), True),
    (2 ** 64, True), ("caf\u00e9", True),
    (uuid.UUID(int=7), False), (Colour.RED, False), (float("nan"), False), (float("inf"), False),
    ("a\x00b", False), ("\ud800", False),
])
def test_a_result_frame_keeps_what_the_json_module_kept_and_refuses_what_it_refused(output, kept):
    """Results with a simple output are written by orjson; what orjson would accept but
    the json module refuses (a UUID, an Enum, NaN) still fails the attempt as
    ``output_invalid``, and what is sent reads back exactly."""
    from cyclone_mp._tasks import result_frame

    result = {"t": "result", "task": "7.3", "ok": True, "output": output, "cpu": 0.000123, "cancel_reason": None,
              "children": False}
    got = protocol.FrameReader(1 << 20).feed(result_frame(dict(result), 1 << 20))[0]
    if kept:
        assert got["ok"] is True and repr(got["output"]) == repr(output)
    else:
        assert got["ok"] is False and got["kind"] == "output_invalid" and "output" not in got


def test_a_cancellation_wakes_a_waiter_and_calls_back_once():
    from cyclone_mp.context import Cancellation

    handle, seen = Cancellation(), []
    handle.on_set(seen.append)
    assert not handle.is_set() and handle.wait(0.01) is False
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(handle.wait(10)))
    waiter.start()
    handle.set("timeout")
    handle.set("cancelled")  # the first reason wins
    waiter.join(5)
    assert woke == [True] and seen == ["timeout"] and handle.reason == "timeout" and handle.is_set()
    assert handle.wait(0) is True
    handle.on_set(seen.append)  # registered after: called at once
    assert seen == ["timeout", "timeout"]


@pytest.mark.parametrize("result", [
    {"t": "result", "task": "7.3", "ok": True, "output": "\x7f" * 900, "cpu": 0.1, "children": False},
    {"t": "result", "task": "7.3", "ok": False, "kind": "error", "type": "builtins.ValueError", "message": "no",
     "traceback": "\u00e9" * 50000, "cpu": 0.1, "children": False},
])
def test_the_payload_limit_decides_as_the_json_module_measures(result):
    """The limit counts a frame as the json module writes it (DEL and non-ASCII text
    escaped): an output of 900 DEL characters is 5,402 bytes of JSON, over a 1,024-byte
    max_payload, and a failure's 300 KB traceback is over it too, whichever encoder is
    fastest for other results."""
    from cyclone_mp._tasks import result_frame

    got = protocol.FrameReader(1 << 20).feed(result_frame(dict(result), 1024))[0]
    assert got["ok"] is False and got["kind"] == "output_invalid", got
