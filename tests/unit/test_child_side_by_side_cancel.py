"""A child's side-by-side async task (``async_concurrency``) whose cancel reached the child
before the task itself never starts: the child said it dropped it, so the supervisor
reports it dead at once, and a handler that ran anyway would run beside its retry
untracked. A real child loop (``Runner.loop``) in a forked process, on a socketpair."""

from __future__ import annotations

import json
import os
import socket
import time

from cyclone_mp import _child, protocol


async def side_note(ctx, inp):
    """Notes that it ran, in the file its input names."""
    with open(inp["path"], "a") as fh:
        fh.write(ctx.run_id + "\n")
    return "ran"


def note(ctx, inp):
    """The same, for a plain task (the test's barrier: the loop has read what came before)."""
    with open(inp["path"], "a") as fh:
        fh.write(ctx.run_id + "\n")
    return "ran"


def task(token: str, qualname: str, path: str, concurrent: bool) -> dict:
    message = {"t": "task", "task": token, "run_id": token, "step": qualname, "node": qualname, "attempt": 1,
               "timeout": None, "deadline": None, "input_json": json.dumps({"path": path}), "upstream_json": None,
               "ref": {"module": __name__, "qualname": qualname, "path": None}}
    if concurrent:
        message["concurrent"] = True
    return message


def frames_until(sock: socket.socket, reader: protocol.FrameReader, done, timeout: float = 10.0) -> list[dict]:
    """Frames from the child until ``done(frames)`` holds (or ``timeout`` seconds pass)."""
    frames: list[dict] = []
    sock.settimeout(0.1)
    deadline = time.monotonic() + timeout
    while not done(frames) and time.monotonic() < deadline:
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not data:
            break
        frames.extend(reader.feed(data))
    return frames


def test_a_side_by_side_task_cancelled_before_it_was_read_never_runs(tmp_path):
    path = str(tmp_path / "ran.log")
    ours, theirs = socket.socketpair()
    cancel_r, cancel_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its loop until the cancel pipe closes (the watcher then exits it)
        try:
            ours.close()
            os.close(cancel_w)
            _child.Runner(theirs, cancel_r, 1 << 20).loop(preload=[])
        finally:
            os._exit(0)
    theirs.close()
    os.close(cancel_r)
    reader = protocol.FrameReader(1 << 20)
    try:
        assert any(f.get("t") == "ready" for f in frames_until(ours, reader, lambda fs: fs))
        os.write(cancel_w, b"early cancelled\n")  # the cancel comes first, the task after it
        dropped = frames_until(ours, reader, lambda fs: any(f.get("task") == "early" for f in fs))
        assert [(f["task"], f.get("dropped")) for f in dropped] == [("early", True)]
        ours.sendall(protocol.encode(task("early", "side_note", path, concurrent=True)))
        ours.sendall(protocol.encode(task("later", "side_note", path, concurrent=True)))
        ours.sendall(protocol.encode(task("barrier", "note", path, concurrent=False)))
        results = frames_until(ours, reader, lambda fs: {"later", "barrier"} <= {f.get("task") for f in fs})
        assert {f["task"]: f.get("ok") for f in results} == {"later": True, "barrier": True}
        time.sleep(0.2)  # (a task submitted to the loop thread would have run by now)
        with open(path) as fh:
            assert sorted(fh.read().split()) == ["barrier", "later"]  # "early" never ran
    finally:
        os.close(cancel_w)
        ours.close()
        os.waitpid(pid, 0)
