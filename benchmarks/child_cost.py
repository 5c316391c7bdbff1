"""A handler child's CPU per no-op step, alone: a :class:`cyclone_mp._child.Runner` in a
forked process on a socketpair, fed task frames as a pipelined supervisor writes them.

    python benchmarks/child_cost.py [--steps 20000] [--batch 16] [--profile]

No supervisor, database or other process shares the measurement, so a change to the
child's per-step path shows here even on a shared machine where B7's children figure
moves with the neighbours; run two trees alternately to compare them (``PYTHONPATH``).
``--batch``: tasks per write, with at most two batches in flight. ``--profile``: the
child's main thread under cProfile with a CPU clock (its shares, not its seconds).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import time
import uuid

import bench_steps  # noqa: F401 - the handler the tasks name, imported before the fork
import psutil

from cyclone_mp import _child, protocol

REF = {"module": "bench_steps", "qualname": "noop", "path": None}


def task(i: int) -> dict:
    """A task frame's message as process control builds one for a no-op step."""
    return {"t": "task", "task": str(i), "run_id": str(uuid.uuid4()), "step": "bench_noop", "node": "bench_noop",
            "attempt": 1, "timeout": 60.0, "start_by": time.monotonic() + 60, "deadline": time.time() + 60,
            "input_json": "null", "upstream_json": "{}", "ref": REF}


def serve(sock: socket.socket, cancel_fd: int, profile: bool) -> None:
    """The child: run tasks until told to exit (profiled on request), then exit."""
    profiler = cProfile.Profile(time.thread_time) if profile else None
    if profiler:
        profiler.enable()
    _child.Runner(sock, cancel_fd, 1 << 20).loop(preload=[])
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    ours, theirs = socket.socketpair()
    cancel_r, cancel_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ours.close()
        os.close(cancel_w)
        serve(theirs, cancel_r, args.profile)
    theirs.close()
    os.close(cancel_r)
    reader = protocol.FrameReader(1 << 24)
    while not any(m.get("t") == "ready" for m in reader.feed(ours.recv(1 << 16))):
        pass
    child = psutil.Process(pid)
    before, started = child.cpu_times(), time.monotonic()
    sent = done = 0
    while done < args.steps:
        if sent - done < 2 * args.batch and sent < args.steps:
            count = min(args.batch, args.steps - sent)
            ours.sendall(b"".join(protocol.encode_own(task(sent + j)) for j in range(count)))
            sent += count
        done += sum(m.get("t") == "result" for m in reader.feed(ours.recv(1 << 16)))
    after, elapsed = child.cpu_times(), time.monotonic() - started
    ours.sendall(protocol.encode({"t": "exit"}))
    os.waitpid(pid, 0)
    user, system = after.user - before.user, after.system - before.system
    print(f"{args.steps} no-ops in batches of {args.batch}: {elapsed:.2f} s; the child's CPU per step "
          f"{(user + system) * 1e6 / args.steps:.1f} us (user {user * 1e6 / args.steps:.1f}, "
          f"system {system * 1e6 / args.steps:.1f})")


if __name__ == "__main__":
    main()
