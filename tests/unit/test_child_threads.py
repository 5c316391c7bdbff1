"""A cancelled attempt's lingering threads are the ones it started: never a thread an
earlier attempt left running, never the runner's own (the cancel watcher), whatever
threads lived as the runner started."""

from __future__ import annotations

import contextlib
import json
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


def failed_with_a_thread(ctx, inp):
    """An attempt that starts a thread and fails while it runs (no cancel)."""
    threading.Thread(target=STOP.wait, args=(0.3,), name="started-by-this-attempt", daemon=True).start()
    raise RuntimeError("failed")


RUNNER: Runner


@contextlib.contextmanager
def started_runner(monkeypatch):
    """A runner on a socketpair in this process, its cancel watcher started and its own
    threads noted as its loop does (it does not reap this process's children: those are
    the tests'). Yields ``run(qualname)``: one task of that handler, its result."""
    global RUNNER
    STOP.clear()
    monkeypatch.setattr(child_module, "has_own_children", lambda: False)
    ours, theirs = socket.socketpair()
    cancel_r, cancel_w = os.pipe()
    RUNNER = Runner(ours, cancel_r, 1 << 20)
    RUNNER.watch_cancels = lambda: STOP.wait()  # (a watcher that stays alive, as the real one does)
    threading.Thread(target=RUNNER.watch_cancels, name="cyclone-cancel-watch", daemon=True).start()
    RUNNER.note_own_threads()
    reader = protocol.FrameReader(1 << 20)

    def run(qualname: str) -> dict:
        task = {"t": "task", "task": qualname, "run_id": "r", "step": "s", "node": "n", "attempt": 1,
                "timeout": None, "deadline": None, "input_json": "null", "upstream_json": None,
                "ref": {"module": __name__, "qualname": qualname, "path": None}}
        RUNNER.task = qualname
        RUNNER.cancellation = type(RUNNER.cancellation)()
        RUNNER.run_one(task)
        return reader.feed(theirs.recv(1 << 20))[0]

    try:
        yield run
    finally:
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


@pytest.fixture
def runner(monkeypatch):
    with started_runner(monkeypatch) as run:
        yield run


def test_a_cancelled_attempt_names_the_threads_it_started(runner):
    result = runner("cancelled_with_a_thread")
    assert result["cancel_reason"] == "timeout"
    assert result["lingering"] == ["started-by-this-attempt"]


def test_a_thread_an_earlier_attempt_left_is_not_the_cancelled_attempts(runner):
    assert "lingering" not in runner("leave_a_thread")
    result = runner("cancelled_with_a_thread")
    assert result["lingering"] == ["started-by-this-attempt"]


def test_a_thread_alive_as_the_runner_started_may_end_without_hiding_a_leftover(monkeypatch):
    """A thread besides main and the watcher as the loop starts (one a sitecustomize
    started): the runner does not count on the threads it noted then. That thread ends,
    an attempt leaves one running: the next cancelled attempt names only its own."""
    early_stop = threading.Event()
    early = threading.Thread(target=early_stop.wait, name="started-before-the-loop", daemon=True)
    early.start()
    try:
        with started_runner(monkeypatch) as run:
            assert RUNNER.own_threads == frozenset()  # (more than its own two lived)
            early_stop.set()
            early.join(5)
            assert "lingering" not in run("leave_a_thread")
            assert run("cancelled_with_a_thread")["lingering"] == ["started-by-this-attempt"]
    finally:
        early_stop.set()
        early.join(5)


def test_a_runner_whose_own_two_threads_are_alone_counts_on_them():
    """In a process of one thread (a child as it starts: here a fork of this test), the
    runner notes main and the watcher, and a count of two stands for them: a cancelled
    attempt still names only the thread it started, and after an attempt left one
    running, the next cancelled attempt names only its own."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: one thread, as a runner's child process starts
        code = 1
        try:
            with started_runner(pytest.MonkeyPatch()) as run:
                found = {"noted": len(RUNNER.own_threads),
                         "first": run("cancelled_with_a_thread").get("lingering"),
                         "left": run("leave_a_thread").get("lingering"),
                         "second": run("cancelled_with_a_thread").get("lingering")}
            os.write(write_end, json.dumps(found).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        found = json.loads(os.read(read_end, 4096) or b"null")
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert found == {"noted": 2, "first": ["started-by-this-attempt"], "left": None,
                     "second": ["started-by-this-attempt"]}


def test_a_failed_attempt_names_the_threads_it_started(runner):
    """Its retry must not run beside them: a failure is looked at as a cancel is."""
    result = runner("failed_with_a_thread")
    assert (result["ok"], result["cancel_reason"], result["lingering"]) == (False, None, ["started-by-this-attempt"])
