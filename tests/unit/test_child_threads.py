"""A cancelled attempt's lingering threads are the ones it started: never a thread an
earlier attempt left running, never the runner's own (the cancel watcher)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from cyclone_mp import _child as child_module
from cyclone_mp import protocol
from cyclone_mp._child import Runner

STOP = threading.Event()  # ends every thread these handlers start


def leave_a_thread(ctx, inp):
    """A successful attempt that leaves a thread running (nobody cancels it) for 5 s at most."""
    threading.Thread(target=STOP.wait, args=(5,), name="left-by-an-earlier-attempt", daemon=True).start()
    return "ok"


def cancelled_with_a_thread(ctx, inp):
    """An attempt that starts a thread and is cancelled while it runs."""
    # it ends on its own soon after (the runner waits for it before it takes another task)
    threading.Thread(target=STOP.wait, args=(0.3,), name="started-by-this-attempt", daemon=True).start()
    RUNNER.cancellation.set("timeout")
    return "ok"


RUNNER: Runner


@pytest.fixture
def runner(monkeypatch):
    """A runner on a socketpair in this process, its cancel watcher started as its loop
    starts it (it does not reap this process's children: those are the tests')."""
    global RUNNER
    STOP.clear()
    monkeypatch.setattr(child_module, "has_own_children", lambda: False)
    ours, theirs = socket.socketpair()
    cancel_r, cancel_w = os.pipe()
    RUNNER = Runner(ours, cancel_r, 1 << 20)
    RUNNER.watch_cancels = lambda: STOP.wait()  # (a watcher that stays alive, as the real one does)
    threading.Thread(target=RUNNER.watch_cancels, name="cyclone-cancel-watch", daemon=True).start()
    RUNNER.own_threads = frozenset(t.ident for t in threading.enumerate())
    reader = protocol.FrameReader(1 << 20)

    def run(qualname: str) -> dict:
        task = {"t": "task", "task": qualname, "run_id": "r", "step": "s", "node": "n", "attempt": 1,
                "timeout": None, "deadline": None, "input_json": "null", "upstream_json": None,
                "ref": {"module": __name__, "qualname": qualname, "path": None}}
        RUNNER.task = qualname
        RUNNER.cancellation = type(RUNNER.cancellation)()
        RUNNER.run_one(task)
        return reader.feed(theirs.recv(1 << 20))[0]

    yield run
    STOP.set()
    for thread in threading.enumerate():
        if thread.name in ("left-by-an-earlier-attempt", "started-by-this-attempt", "cyclone-cancel-watch"):
            thread.join(5)
    ours.close()
    theirs.close()
    os.close(cancel_w)
    RUNNER.cancel_file.close()
    if RUNNER.peak._fd is not None:
        os.close(RUNNER.peak._fd)


def test_a_cancelled_attempt_names_the_threads_it_started(runner):
    result = runner("cancelled_with_a_thread")
    assert result["cancel_reason"] == "timeout"
    assert result["lingering"] == ["started-by-this-attempt"]


def test_a_thread_an_earlier_attempt_left_is_not_the_cancelled_attempts(runner):
    assert "lingering" not in runner("leave_a_thread")
    result = runner("cancelled_with_a_thread")
    assert result["lingering"] == ["started-by-this-attempt"]
