"""Hostile payloads never stall the engine: a child answers every task, even one it
cannot decode; the producer refuses values past the limits, and an output or a progress
value too deep becomes a stored error, never a dropped frame; random JSON values (deep,
huge, unstorable), seeded, sent through enqueue, signal and handler output, each end
stored or clearly refused (the fuzz test). The pure rules of the same boundary are in
``tests/unit/test_payload_rules.py``."""

from __future__ import annotations

import json
import time

import pytest

from cyclone_mp import protocol
from cyclone_mp.errors import PayloadError

import handlers as h
import hostile_handlers as hh
from hostile_support import LIMIT_WORDS, frame
from waiting import wait_for


# -- 2. the boundary in the producer and in the child --------------------------------------------


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


@pytest.mark.long  # 7 s of generated values; each hostile kind above has its own case in the default run
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
