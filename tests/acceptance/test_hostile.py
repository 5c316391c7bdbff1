"""Hostile data and hostile handlers (issue 18): one bad row never stalls the engine,
every death is named right, bad input is reported as bad input, and secrets stay out
of handlers' reach.

Each numbered fault of the issue is a test here, with the issue's exact inputs; the
fuzz test at the end sends random JSON values (deep, huge, unstorable) through
enqueue, signal and handler output.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import sys
import time
from typing import Any

import psycopg
import pytest

import cyclone_mp as cy
from cyclone_mp import decisions, procs, protocol
from cyclone_mp.store import operations
from cyclone_mp.errors import (
    ConfigurationError, DatabaseBusy, DatabaseDiskFull, DatabaseError, DatabaseUnavailable, PayloadError,
    QueryRejected, UnstorableText,
)
from cyclone_mp.store import Q, NodeRow, Store, classify, connect, redact

import handlers as h
import hostile_handlers as hh
from waiting import wait_for

LIMIT_WORDS = f"deeper than {protocol.MAX_DEPTH} levels"


# -- 2. one payload boundary: frames decode one by one ------------------------------------------


def frame(body: bytes) -> bytes:
    return protocol.HEADER.pack(len(body)) + body


BAD_FRAMES = {
    "deep": ("[" * 5000 + "]" * 5000).encode(),
    "deep_result": b'{"t":"result","task":"7.3","ok":true,"output":' + b"[" * 5000 + b"]" * 5000 + b"}",
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
    if case in ("deep_result", "not_utf8", "not_json", "huge_integer"):
        assert marker["task"] == "7.3" and marker["of"] in ("result", "progress")
    else:
        assert marker["task"] is None


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


def _task(token: str, **fields) -> dict:
    return {"t": "task", "task": token, "run_id": "r", "step": "h18_echo", "node": "h18_echo", "attempt": 1,
            "timeout": None, "start_by": None, "deadline": None,
            "ref": {"module": "hostile_handlers", "qualname": "echo", "path": None}, **fields}


def test_a_child_answers_every_task_even_one_it_cannot_decode():
    """The child's half of the boundary: a task frame it cannot decode, and an input
    handed on as JSON text (``input_json``) deeper than the limit, each get a failed
    result for their own task (never silence); the task after them runs."""
    import select

    from cyclone_mp.childproc import ChildProc

    child = ChildProc("h18-test", 1 << 20)
    try:
        deep = b"[" * 5000 + b"]" * 5000
        child.outbox += frame(b'{"t":"task","task":"9.1","input":' + deep + b"}")
        child.queue(_task("9.2", input_json=deep.decode()))
        child.queue(_task("9.3", input={"a": 1}))
        child.flush()
        results: dict[str, dict] = {}
        deadline = time.monotonic() + 20
        while len(results) < 3 and time.monotonic() < deadline:
            select.select([child.sock], [], [], 0.5)
            child.flush()
            messages, eof = child.receive()
            results.update({m["task"]: m for m in messages if m.get("t") == "result"})
            assert not eof, results
        assert (results["9.1"]["ok"], results["9.1"]["kind"]) == (False, "permanent")
        assert "could not be decoded" in results["9.1"]["message"]
        assert (results["9.2"]["ok"], results["9.2"]["kind"]) == (False, "permanent")
        assert results["9.2"]["message"] == f"the run's input is nested deeper than {protocol.MAX_DEPTH} levels (the limit)"
        assert results["9.3"]["ok"] and results["9.3"]["output"] == {"a": 1}
    finally:
        child.kill()


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


# -- 1. database errors classified by SQLSTATE ---------------------------------------------------


@pytest.mark.parametrize("error,expected", [
    (psycopg.errors.ProgramLimitExceeded, QueryRejected),  # 54000: jsonb over 256 MB, index row too large
    (psycopg.errors.StatementTooComplex, QueryRejected),  # 54001
    (psycopg.errors.NumericValueOutOfRange, QueryRejected),  # 22003
    (psycopg.errors.UntranslatableCharacter, QueryRejected),  # 22P05
    (psycopg.errors.UniqueViolation, QueryRejected),  # 23505
    (psycopg.errors.AdminShutdown, DatabaseUnavailable),  # 57P01
    (psycopg.errors.CannotConnectNow, DatabaseUnavailable),  # 57P03
    (psycopg.errors.ConnectionFailure, DatabaseUnavailable),  # 08006
    (psycopg.errors.IdleInTransactionSessionTimeout, DatabaseUnavailable),  # 25P03
    (psycopg.OperationalError, DatabaseUnavailable),  # no SQLSTATE: the connection was lost
    (psycopg.errors.QueryCanceled, DatabaseBusy),  # 57014 statement_timeout: nothing done, try again (issue 17)
    (psycopg.errors.LockNotAvailable, DatabaseBusy),  # 55P03 lock_timeout: the same
    (psycopg.errors.UndefinedTable, DatabaseError),  # 42P01: neither
    (psycopg.errors.DiskFull, DatabaseDiskFull),  # 53100: an outage, named
    (psycopg.errors.OutOfMemory, DatabaseUnavailable),  # 53200: the same
])
def test_classify_by_sqlstate_not_by_exception_class(error, expected):
    got = classify(error("total size of jsonb object elements exceeds the maximum of 268435455 bytes"))
    assert type(got) is expected, got
    if expected is QueryRejected:
        assert got.sqlstate == error.sqlstate and f"SQLSTATE {error.sqlstate}" in str(got)
        assert str(got).startswith("the database rejected the call")


def test_a_broken_connection_is_an_outage_whatever_the_sqlstate():
    assert type(classify(psycopg.errors.ProgramLimitExceeded("x"), broken=True)) is DatabaseUnavailable


def test_index_row_too_large_is_a_rejected_call_not_an_outage(cyclone_dsn):
    """Issue 18 fault 1: a 10 kB idempotency key reported "database unavailable: index
    row requires 10016 bytes" (and a supervisor took the same class of error for an
    outage). Written past the client's check, it is a QueryRejected of that call, and
    the connection goes on."""
    store = Store.open(cyclone_dsn)
    try:
        key = secrets.token_hex(5000)  # 10,000 characters, incompressible
        node = NodeRow(node="ok", step_name="ok", kind="task", depends_on=(), queue="default", priority=0,
                       state="available", max_attempts=1, max_reclaims=None, timeout=None)
        with pytest.raises(QueryRejected) as info:
            store.runs.enqueue(name="ok", kind="step", input={}, nodes=[node], delay=0, idempotency_key=key)
        assert info.value.sqlstate == "54000" and "index row requires" in str(info.value)
        assert not isinstance(info.value, DatabaseUnavailable)
        assert not store.broken
        run_id, created = store.runs.enqueue(name="ok", kind="step", input={}, nodes=[node], delay=0,
                                                 idempotency_key="short")
        assert created and run_id
    finally:
        store.close()


def test_a_terminated_session_is_an_outage(cyclone_dsn):
    store = Store.open(cyclone_dsn)
    try:
        pid = store.conn.info.backend_pid
        with psycopg.connect(cyclone_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(DatabaseUnavailable):
            store.run(operations.list_runs())
    finally:
        store.close()


def test_a_full_disk_is_named_and_is_an_outage_not_a_rejected_call():
    error = classify(psycopg.errors.DiskFull('could not extend file "base/16384/16390": No space left on device'))
    assert type(error) is DatabaseDiskFull and isinstance(error, DatabaseUnavailable)
    assert str(error) == ("the database server's disk is full (SQLSTATE 53100): could not extend file "
                          '"base/16384/16390": No space left on device')
    assert str(classify(psycopg.errors.OutOfMemory("out of memory"))).startswith(
        "the database server is out of memory (SQLSTATE 53200)")


DISK_FULL = """
CREATE FUNCTION cyclone_test_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'could not extend file "base/1/2": No space left on device' USING ERRCODE = 'disk_full';
END $$;
CREATE TRIGGER cyclone_test_disk_full BEFORE UPDATE ON cyclone_steps FOR EACH ROW
    WHEN (NEW.state = 'completed') EXECUTE FUNCTION cyclone_test_disk_full();
CREATE TRIGGER cyclone_test_disk_full BEFORE INSERT ON cyclone_runs FOR EACH ROW
    EXECUTE FUNCTION cyclone_test_disk_full();
"""


def test_a_full_disk_is_an_outage_the_supervisor_outlasts(cyclone_env_factory, caplog):
    """The server refuses writes with SQLSTATE 53100 (here a trigger raises it: on every
    completion and every new run). An enqueue fails with DatabaseDiskFull, saying so; the
    supervisor takes it for an outage (it keeps the outcome and writes it again once
    space is back), never for a bad row: the step completes once, on its first attempt."""
    env = cyclone_env_factory(worker="thread")
    env.mux().register(h.ok)
    run_id = env.enqueue(h.ok, {"n": 1})
    with connect(env.dsn) as conn:
        conn.execute(DISK_FULL)
    caplog.set_level(logging.INFO, logger="cyclone_mp")
    with pytest.raises(DatabaseDiskFull, match=r"^the database server's disk is full \(SQLSTATE 53100\)"):
        env.client().enqueue(h.ok, {"n": 2})
    handle = env.start_worker()
    wait_for(lambda: any("disk is full" in r.getMessage() and "database lost" in r.getMessage()
                         for r in caplog.records), 30, "the writer to meet the full disk")
    with connect(env.dsn) as conn:
        row = conn.execute("SELECT state, errors FROM cyclone_steps WHERE run_id = %s", (run_id,)).fetchone()
        assert (row["state"], row["errors"]) == ("running", [])  # not failed as a bad row: kept to write again
        conn.execute("DROP FUNCTION cyclone_test_disk_full() CASCADE")
    done = env.run_until_complete(run_id, timeout=30)
    assert (done.state, done.step.attempt, done.step.errors) == ("completed", 1, [])
    assert handle.alive()


def test_idempotency_key_of_10kB_is_bad_input(cyclone_env):
    """Issue 18 fault 1, second half: the key's size is checked at enqueue."""
    with pytest.raises(ConfigurationError, match="at most 1024 bytes"):
        cyclone_env.enqueue(h.ok, {}, idempotency_key="k" * 10_000)
    with pytest.raises(ConfigurationError, match="NUL"):
        cyclone_env.enqueue(h.ok, {}, idempotency_key="a\x00b")
    assert cyclone_env.enqueue(h.ok, {}, idempotency_key="é" * 512)  # 1024 bytes: the limit itself


@pytest.mark.slow  # 280 MB through PostgreSQL: 30 s alone, minutes on a busy machine
def test_a_fan_in_past_jsonbs_limit_is_claimed_and_is_not_an_outage(cyclone_env_factory, caplog, tmp_path):
    """Issue 18 fault 1, the issue's exact case: five 56 MB outputs into one join exceed
    jsonb's 256 MB. Claiming the join used to fail every time and was taken for an
    outage ("database lost; reconnecting" 58 times in 40 s): no heartbeats, and an
    unrelated handler running meanwhile was killed as lease_lost. The claim now builds
    the upstream outputs as text (1 GB) and the child reads them under the payload
    rules: the join ends with a clear outcome, the supervisor never loses its database,
    and the unrelated step completes."""
    ttl = 4.0  # long enough for the supervisor to move 56 MB outputs between two renewals
    env = cyclone_env_factory(worker="thread", workers=2, lease_ttl=ttl, max_payload=64 * 1024 * 1024)
    env.mux().register(hh.fan_in, hh.sleep_until)
    flag = tmp_path / "release"
    unrelated = env.enqueue(hh.sleep_until, {"path": str(flag), "max": 120})
    handle = env.start_worker()
    env.wait_for_state(unrelated, None, "running", timeout=30)
    caplog.set_level(logging.INFO, logger="cyclone_mp")
    run_id = env.client().enqueue(hh.fan_in, {"mb": 56})

    def states() -> dict[str, dict[str, Any]]:  # (status() would read 280 MB of outputs each time)
        with connect(env.dsn) as conn:
            return {r["node"]: r for r in conn.execute(
                "SELECT node, state, error_kind, error FROM cyclone_steps WHERE run_id = %s", (run_id,))}

    wait_for(lambda: all(states()[f"part{i}"]["state"] == "completed" for i in range(5)), 120, "the five 56 MB parts")
    first = len(caplog.records)
    join = wait_for(lambda: (lambda s: s if s["state"] in ("completed", "discarded") else None)(states()["join"]),
                    300, "the join to end", interval=0.2)
    if join["state"] == "discarded":  # the fan-in is over max_payload: a clear, permanent error
        assert join["error_kind"] == "permanent" and "upstream" in (join["error"] or ""), join
    flag.write_text("go")
    done = env.run_until_complete(unrelated, timeout=30)
    assert (done.state, done.step.attempt, done.step.errors) == ("completed", 1, [])
    assert done.step.output == {"saw_file": True}
    assert handle.alive()
    lost = [r.getMessage() for r in caplog.records[first:] if "database lost" in r.getMessage()]
    assert not lost, lost[:3]


def test_a_fan_in_is_loaded_with_its_own_statement_timeout(cyclone_env):
    """The upstream outputs too big to come with a claim are loaded by maintenance, whose
    session's statement_timeout is a write's bound: a big fan-in failed its join as
    "database busy: statement timeout". The load has its own (here the session's is
    1 ms), and says the upstream object's size."""
    run_id = cyclone_env.enqueue(hh.noisy_fan_in, {"bytes": 400_000})
    with connect(cyclone_env.dsn) as conn:
        conn.execute("UPDATE cyclone_steps SET state = 'completed', output = to_jsonb("
                     "(SELECT string_agg(md5(i::text || node), '') FROM generate_series(1, 12500) i))"
                     " WHERE run_id = %s AND node <> 'join'", (run_id,))
        join = conn.execute("SELECT id FROM cyclone_steps WHERE run_id = %s AND node = 'join'",
                            (run_id,)).fetchone()["id"]
    store = Store.open(cyclone_env.dsn, statement_timeout=0.001)
    try:
        with pytest.raises(DatabaseBusy, match="statement timeout"):  # the session's bound alone
            store.payloads.load(join)
        payload = store.payloads.load(join, statement_timeout=60)
        upstream = json.loads(payload["upstream"])
        assert sorted(upstream) == [f"part{i}" for i in range(5)] and len(upstream["part0"]) == 400_000
        assert payload["upstream_outputs"] == 5 and payload["upstream_bytes"] == len(payload["upstream"].encode())
        over = store.payloads.load(join, statement_timeout=60, max_upstream=payload["upstream_bytes"] - 1)
        assert over["upstream"] is None and over["upstream_bytes"] == payload["upstream_bytes"]
    finally:
        store.close()


def test_the_upstream_size_message_names_the_size_and_the_limit():
    limit = protocol.upstream_limit(64 * 1024 * 1024)
    assert limit == (1 << 30) - 64 * 1024 * 1024 - protocol.FRAME_ENVELOPE
    assert protocol.upstream_too_big("join", 5, 1_234_500_000, limit) == (
        "the upstream outputs of step 'join' total 1234.5 MB (5 outputs), over the 1007 MB a step's upstream "
        "outputs may total (they reach the step as one JSON text, and PostgreSQL's text values hold at most 1 GB)")


def test_a_fan_in_over_the_limit_fails_its_join_saying_its_size(cyclone_env_factory, monkeypatch):
    """A join whose upstream outputs total more than a task can carry (here the limit is
    made 1 MB, for five 0.4 MB outputs) is discarded at once, permanently, with a
    message that says their size and the limit: never a statement timeout."""
    from cyclone_mp import loader

    monkeypatch.setattr(loader, "upstream_limit", lambda max_payload: 1_000_000)
    env = cyclone_env_factory(worker="thread")
    env.mux().register(hh.noisy_fan_in)
    run_id = env.enqueue(hh.noisy_fan_in, {"bytes": 400_000})
    handle = env.start_worker()
    run = env.run_until_complete(run_id, timeout=60)
    join = run.steps["join"]
    assert (run.state, join.state, join.error_kind, join.attempt) == ("discarded", "discarded", "permanent", 1)
    assert join.error.startswith("the upstream outputs of step 'join' total 2.0 MB (5 outputs), over the 1 MB a "
                                 "step's upstream outputs may total"), join.error
    assert "timeout" not in join.error
    assert all(run.steps[f"part{i}"].state == "completed" for i in range(5))
    assert handle.alive()


# -- 2. the boundary in the producer and in the child --------------------------------------------


def test_producer_refuses_values_past_the_limits(cyclone_env):
    client = cyclone_env.client()
    cyclone_env.mux().register(hh.echo, hh.signal_flow)
    with pytest.raises(PayloadError, match=LIMIT_WORDS):
        cyclone_env.enqueue(hh.echo, hh.nested(201))
    with pytest.raises(PayloadError, match=LIMIT_WORDS):
        client.enqueue_many(hh.echo, [{}, hh.nested(3000)])
    run_id = client.enqueue(hh.signal_flow, None)
    with pytest.raises(PayloadError, match=LIMIT_WORDS):
        client.signal(run_id, "payload", {"a": hh.nested(250)})
    with pytest.raises(PayloadError, match="max_payload"):
        cyclone_env.enqueue(hh.echo, "x" * (client.config.max_payload + 1))
    ok = cyclone_env.enqueue(hh.echo, hh.nested(200))  # the limit itself crosses every process
    assert cyclone_env.run_until_complete(ok).step.output == hh.nested(200)


@pytest.mark.parametrize("depth", [975, 990, 3000])
def test_a_deep_output_becomes_a_stored_error_not_a_dropped_frame(cyclone_env, depth):
    """Issue 18 fault 2: a result 975-990 levels deep was dropped by the parent and the
    step stayed running (forever without a timeout). Now the child refuses it before
    sending: the attempt fails at once with an error naming the limit, and the other
    steps run."""
    run_id = cyclone_env.enqueue(hh.deep_output, {"depth": depth})
    others = [cyclone_env.enqueue(h.ok, {"i": i}) for i in range(3)]
    run = cyclone_env.run_until_complete(run_id, timeout=15)
    step = run.step
    assert (run.state, step.state, step.attempt) == ("discarded", "discarded", 1)
    assert step.errors[0]["type"] == "cyclone_mp.errors.PayloadError"
    assert LIMIT_WORDS in step.error and "exit_code" not in step.errors[0]
    for rid in others:
        assert cyclone_env.run_until_complete(rid).state == "completed"


def test_a_deep_progress_value_fails_the_attempt_at_its_call(cyclone_env):
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(hh.deep_progress, {"depth": 300}), timeout=15)
    entry = run.step.errors[0]
    assert run.step.state == "discarded" and entry["type"] == "cyclone_mp.errors.PayloadError"
    assert "progress" in entry["message"] and LIMIT_WORDS in entry["message"]
    assert "set_progress" in entry["traceback"]


def test_a_deep_output_is_stored_as_output_invalid(cyclone_env):
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(hh.deep_output, {"depth": 985}), timeout=15)
    assert run.step.error_kind == "output_invalid"


# -- 5. misnamed deaths (the child's half) -------------------------------------------------------


def test_memory_error_is_named(cyclone_env):
    """Issue 18 fault 5: MemoryError was stored with an empty message."""
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(hh.memory_error, {}), timeout=15)
    entry = run.step.errors[0]
    assert entry["type"] == "builtins.MemoryError"
    assert entry["message"].startswith("MemoryError: ") and len(entry["message"]) > len("MemoryError: ")
    assert run.step.error == entry["message"]


@pytest.mark.parametrize("code,message", [
    (0, "SystemExit: exit code 0"), (3, "SystemExit: exit code 3"), ("bye", "SystemExit: exit code 1 (bye)"),
])
def test_sys_exit_is_named(cyclone_env, code, message):
    """Issue 18 fault 5: sys.exit(0) was stored as SystemExit "0"."""
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(hh.sys_exit, {"code": code}), timeout=15)
    entry = run.step.errors[0]
    assert (entry["type"], entry["message"], run.step.error) == ("builtins.SystemExit", message, message)
    assert "exit_code" not in entry  # the child did not exit: the handler raised


def test_memory_error_and_exit_have_their_kinds(cyclone_env):
    cyclone_env.mux().register(hh.memory_error, hh.sys_exit)
    mem_id = cyclone_env.enqueue(hh.memory_error, {})
    ex_id = cyclone_env.enqueue(hh.sys_exit, {"code": 0})
    mem = cyclone_env.run_until_complete(mem_id, timeout=15)
    ex = cyclone_env.run_until_complete(ex_id, timeout=15)
    assert (mem.step.error_kind, ex.step.error_kind) == ("memory_error", "exit")


def test_new_kinds_are_attempts_everywhere():
    """Every kind a failed attempt can have consumes an attempt in decisions and in the
    SQL of client.retry (which raises max_attempts for them); output_invalid, which no
    retry can heal, discards at once (tests/acceptance/test_permanent_errors.py)."""
    for kind in ("output_invalid", "memory_error", "exit"):
        assert kind in decisions.FAILURE_KINDS
        end = decisions.end_attempt(attempt=1, max_attempts=3, kind=kind, timed_out=False, backoff=1.0)
        expected = ("discarded", 1, kind) if kind == "output_invalid" else ("available", 2, kind)
        assert (end.state, end.attempt, end.error_kind) == expected
    listed = {k.strip(" '") for k in Q["attempt_kinds_expr"].split(",")}
    assert listed == set(decisions.FAILURE_KINDS)
    assert decisions.reported_kind("memory_error") == "memory_error"
    assert decisions.reported_kind("timeout") == "error" and decisions.reported_kind(None) == "error"


def test_status_shows_the_exception_type_beside_the_message(cyclone_env):
    """Issue 18 fault 5: `cyclone-mp status` did not show the exception type."""
    from cyclone_mp_cli import render

    from rich.console import Console

    run = cyclone_env.run_until_complete(cyclone_env.enqueue(h.raises, {}))
    con = Console(width=400, highlight=False)
    with con.capture() as captured:
        render.print_status(con, run)
    text = captured.get()
    assert "ValueError: bad value on attempt 3" in text  # the steps table
    assert "ValueError: bad value on attempt 1" in text  # the failed attempts table
    assert render.error_text("builtins.SystemExit", "SystemExit: exit code 0") == "SystemExit: exit code 0"


# -- 6. bad input is reported as bad input (the API) ---------------------------------------------


@pytest.mark.parametrize("options,words", [
    ({"timeout": 1e300}, "timeout must be at most 100 years"),
    ({"timeout": dt.timedelta.max}, "timeout must be at most 100 years"),
    ({"delay": 1e300}, "delay must be at most 100 years"),
    ({"scheduled_at": "tomorrow"}, "scheduled_at must be a timezone-aware datetime, not str"),
    ({"priority": 2**40}, "priority must be an int from -2147483648 to 2147483647"),
    ({"max_attempts": 2**40}, "max_attempts must be an int from 1 to 2147483647"),
    ({"max_reclaims": 2**40}, "max_reclaims must be an int from 0 to 2147483647"),
    ({"queue": "q" * 10_000}, "queue must be at most 200 characters"),
    ({"queue": "bad\x00queue"}, "queue cannot be stored in PostgreSQL: it contains a NUL character"),
    ({"queue": "bad\x07queue"}, "queue must not contain control characters"),
])
def test_enqueue_options_out_of_range_are_configuration_errors(options, words):
    """Issue 18 fault 6: these reached the database (bigint out of range, NOTIFY payload
    too long) or raised AttributeError; each is now a ConfigurationError before any I/O."""
    client = cy.Client("postgresql://nobody@127.0.0.1:1/never-connected", cy.Mux().register(h.ok))
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(")):
        client.enqueue(h.ok, {}, **options)


NOT_STORABLE = [("a\ud800b", "a lone surrogate (text that is not valid Unicode)"),
                ("a\x00b", "a NUL character (\\u0000)")]


@pytest.mark.parametrize("text,problem", NOT_STORABLE)
def test_text_postgresql_cannot_store_is_refused_alike_wherever_it_is(text, problem):
    """A lone surrogate (or a NUL) is refused before any I/O with one type,
    UnstorableText (a ConfigurationError and a PayloadError both), and one message
    naming where it was: a concurrency key used to reach the database (QueryRejected)
    where a queue gave a ConfigurationError about "control characters"."""
    client = cy.Client("postgresql://nobody@127.0.0.1:1/never-connected", cy.Mux().register(h.ok))
    by_key = cy.step("h18_keyed", concurrency_key=lambda inp: text)(h.ok.fn)
    places = {
        "step name": lambda: cy.step(text)(h.ok.fn),
        "workflow name": lambda: cy.Workflow(text),
        "workflow 'w': node name": lambda: cy.Workflow("w").add(h.ok, name=text),
        "queue": lambda: client.enqueue(h.ok, {}, queue=text),
        "concurrency_key": lambda: client.enqueue(h.ok, {}, concurrency_key=text),
        "idempotency_key": lambda: client.enqueue(h.ok, {}, idempotency_key=text),
        "input": lambda: client.enqueue(h.ok, {text: 1}),
        "signal name": lambda: client.signal("00000000-0000-0000-0000-000000000000", text),
        "key": lambda: client.runs(key=text),  # a filter of runs
    }
    for what, call in places.items():
        with pytest.raises(UnstorableText) as info:
            call()
        assert str(info.value) == f"{what} cannot be stored in PostgreSQL: it contains {problem}"
        assert isinstance(info.value, ConfigurationError) and isinstance(info.value, PayloadError)
    for call in (lambda: client.enqueue(by_key, {}), lambda: client.enqueue_many(h.ok, [{}], concurrency_key=text),
                 lambda: client.enqueue_many(h.ok, [{}], queue=text),
                 lambda: cy.Client("postgresql://x@127.0.0.1:1/x", queues=[text])):
        with pytest.raises(UnstorableText, match="cannot be stored in PostgreSQL"):
            call()


def test_constructors_refuse_bad_values_at_once():
    with pytest.raises(ConfigurationError, match="dsn must be a connection string or None"):
        cy.Client(5)
    with pytest.raises(ConfigurationError, match="step name must not contain control characters"):
        cy.step("bad\x1bname")(h.ok.fn)
    with pytest.raises(ConfigurationError, match="workflow name must be at most 200"):
        cy.Workflow("w" * 201)
    with pytest.raises(ConfigurationError, match="lease_ttl must be at most 100 years"):
        cy.Client("postgresql://x@127.0.0.1:1/x", lease_ttl=dt.timedelta.max)
    with pytest.raises(ConfigurationError, match="max_payload must be an int from 1024 to 268435455"):
        cy.Client("postgresql://x@127.0.0.1:1/x", max_payload=2**40)
    wf = cy.Workflow("w")
    with pytest.raises(ConfigurationError, match="until= must be timezone-aware"):
        wf.timer("t", until="tomorrow")
    client = cy.Client("postgresql://nobody@127.0.0.1:1/never-connected")
    with pytest.raises(ConfigurationError, match="signal name must be at most 200"):
        client.signal("00000000-0000-0000-0000-000000000000", "s" * 10_000)


# -- 7. credentials out of handlers' reach -------------------------------------------------------


def test_redact_hides_escaped_characters_too():
    """Issue 18 fault 7: the redaction of `password=S3cret\\ more` left `more`."""
    assert redact(r"host=db password=S3cret\ more dbname=x") == "host=db password=*** dbname=x"
    assert "more" not in redact(r"password=S3cret\ more")
    assert redact(r"password='S3 \' cret' dbname=x") == "password=*** dbname=x"


def test_helper_env_drops_the_dsn_and_every_password(monkeypatch):
    monkeypatch.setenv("CYCLONE_DSN", "host=db user=u")
    monkeypatch.setenv("PGPASSWORD", "pw1")
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:pw2@db/app")
    monkeypatch.setenv("OTHER_CONNINFO", "host=db password=pw3")
    monkeypatch.setenv("PLAIN_URL", "postgresql://u@db/app")
    monkeypatch.setenv("KEEP_ME", "postgres://u:visible@db/x")
    monkeypatch.setenv(procs.KEEP_ENV, "KEEP_ME,PGPASSWORD")
    env = procs.helper_env({"EXTRA": "1"})
    for name in ("CYCLONE_DSN", "PGPASSWORD", "DATABASE_URL", "OTHER_CONNINFO"):
        assert name not in env
    assert env["PLAIN_URL"] == "postgresql://u@db/app" and env["KEEP_ME"] and env["EXTRA"] == "1"
    assert not any(p in "".join(env.values()) for p in ("pw1", "pw2", "pw3"))


def test_children_and_the_watchdog_never_see_the_dsn(cyclone_env_factory, monkeypatch):
    """Issue 18 fault 7: with CYCLONE_DSN set, every child and the watchdog inherited it
    in /proc/PID/environ, where handler code can read the password."""
    secret = "pw-" + secrets.token_hex(8)
    monkeypatch.setenv("CYCLONE_DSN", f"postgresql://someone:{secret}@db.invalid/app")
    monkeypatch.setenv("PGPASSWORD", secret)
    monkeypatch.setenv("APP_DB", f"host=db.invalid password={secret}")
    env = cyclone_env_factory()
    env.mux().register(hh.environment)
    handle = env.start_worker()
    run = env.run_until_complete(env.enqueue(hh.environment, {}))
    seen = run.step.output
    assert secret not in json.dumps(seen)
    assert "CYCLONE_DSN" not in seen["environ"] and "PGPASSWORD" not in seen["environ"]
    import psutil

    watchdogs = [p for p in psutil.Process(handle.pid).children() if "_watchdog" in " ".join(p.cmdline())]
    assert watchdogs, "no watchdog found"
    for proc in watchdogs:
        with open(f"/proc/{proc.pid}/environ", "rb") as fh:
            assert secret.encode() not in fh.read()


# -- 8. dashboard tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("token,words", [
    (" ", "empty or only white space"), ("", None), ("x", "needs at least 16"),
    ("a" * 40, "too easy to guess"), ("passwordpassword", "too easy to guess"),
    (" " + secrets.token_urlsafe(32), "white space"),
])
def test_a_public_dashboard_needs_a_strong_token(token, words):
    """Issue 18 fault 8: `--token " "` on a public bind, then `?token=%20`, authenticated."""
    from cyclone_mp.dashboard import check_bind

    with pytest.raises(ConfigurationError, match=words or "without a token") as info:
        check_bind("0.0.0.0", token or None)
    assert token.strip() == "" or token.strip() not in str(info.value)  # the token is never echoed
    check_bind("0.0.0.0", secrets.token_urlsafe(32))
    check_bind("127.0.0.1", "short-but-local")
    with pytest.raises(ConfigurationError, match="white space"):
        check_bind("127.0.0.1", " ")


# -- the fuzz test -------------------------------------------------------------------------------

CLEAR_WORDS = ("nested deeper than 200 levels", "not a JSON value", "cannot be stored in PostgreSQL",
               "over the max_payload limit")


def _verdict(value, max_bytes):
    """What the payload boundary must make of ``value`` (an oracle written apart from
    cyclone_mp's own check): ``(True, its stored JSON form)`` or ``(False, None)``."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False, None
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= 200:
                return False, None
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
            if isinstance(item, dict):
                stack.extend((k, depth + 1) for k in item)
        elif isinstance(item, str):
            if "\x00" in item or any(0xD800 <= ord(c) <= 0xDFFF for c in item):
                return False, None
    if len(text) > max_bytes:
        return False, None
    return True, json.loads(text)


def test_fuzz_values_end_stored_or_clearly_refused(cyclone_env_factory):
    """Random JSON-ish values (seeded: ordinary ones, deep ones around and past the
    limits, huge ones past max_payload, NUL, lone surrogates, NaN, sets) go through
    enqueue, signal and handler output. Each ends as a stored value equal to its JSON
    form, or as a clear PayloadError (producer) or a stored error naming the rule
    (output); the supervisor stays alive and every ordinary step completes."""
    max_bytes = 256 * 1024
    env = cyclone_env_factory(workers=2, max_payload=max_bytes)
    env.mux().register(hh.echo, hh.fuzz_output, hh.signal_flow, h.ok)
    client = env.client()
    handle = env.start_worker()
    stored: dict[str, tuple[str, object]] = {}  # run id -> (node, expected output)
    failed_outputs: list[str] = []
    refused = 0
    for seed in range(600):
        value = hh.fuzz_value(seed, max_bytes)
        ok, normal = _verdict(value, max_bytes)
        route = seed % 3
        try:
            if route == 0:
                run_id = client.enqueue(hh.echo, value)
                stored[run_id] = ("h18_echo", normal)
            elif route == 1:
                run_id = client.enqueue(hh.signal_flow, None)
                client.signal(run_id, "payload", value)
                stored[run_id] = ("payload", normal)
            else:
                run_id = client.enqueue(hh.fuzz_output, {"seed": seed, "max_bytes": max_bytes})
                if ok:
                    stored[run_id] = ("h18_fuzz_output", normal)
                else:
                    failed_outputs.append(run_id)
                continue
        except PayloadError as exc:
            assert not ok, (seed, exc)
            assert any(words in str(exc) for words in CLEAR_WORDS), exc
            refused += 1
            continue
        assert ok, f"seed {seed} was accepted but breaks the boundary"
        if seed % 10 == 0:
            stored[client.enqueue(h.ok, {"seed": seed})] = ("ok", {"echo": {"seed": seed}, "attempt": 1})
    assert refused >= 10 and len(failed_outputs) >= 5  # the generator reaches the limits

    def all_done():
        assert handle.alive(), "the supervisor died"
        return all(env.status(r).terminal for r in list(stored) + failed_outputs)

    wait_for(all_done, 60, "every fuzzed run to end", interval=0.2)
    for run_id, (node, expected) in stored.items():
        run = env.status(run_id)
        step = run.steps[node]
        assert run.state == "completed", (node, step.state, step.errors[:1])
        if node == "ok":
            assert {k: step.output[k] for k in ("echo", "attempt")} == expected
        else:
            assert step.output == expected, node
    for run_id in failed_outputs:
        step = env.status(run_id).step
        assert step.state == "discarded" and step.attempt == 1
        message = step.errors[0]["message"]
        assert any(words in message for words in CLEAR_WORDS), message
        assert "exit_code" not in step.errors[0] and "signal" not in step.errors[0], step.errors[0]
    assert handle.alive()
