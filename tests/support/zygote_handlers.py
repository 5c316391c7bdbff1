"""Steps of tests/acceptance/test_zygote.py (issue 23: children forked from a zygote).

Importing this module in a supervisor's process (a child, or the zygote: they carry
``CYCLONE_MP_SUPERVISOR``) appends the importing pid to the file ``ZYGOTE_IMPORTS``
names: a module-level side effect, so a test counts how many processes imported it.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import cyclone_mp as cy

if os.environ.get("CYCLONE_MP_SUPERVISOR") and os.environ.get("ZYGOTE_IMPORTS"):
    with open(os.environ["ZYGOTE_IMPORTS"], "a") as fh:
        fh.write(f"{os.getpid()}\n")
if os.environ.get("CYCLONE_MP_SUPERVISOR") and os.environ.get("ZYGOTE_SLOW_IMPORT"):
    time.sleep(float(os.environ["ZYGOTE_SLOW_IMPORT"]))  # seconds: an import a kill can land in


@cy.step("zy_whoami", max_attempts=1)
def whoami(ctx: cy.Context, inp: dict) -> dict:
    """Who runs the handler: pid, parent, process group, session; sleeps ``inp["sleep"]``."""
    time.sleep(inp.get("sleep", 0))
    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0)}


@cy.step("zy_cgroups", max_attempts=1)
def cgroups(ctx: cy.Context, inp: dict) -> dict:
    """The handler's pid and its cgroup paths by hierarchy (``/proc/self/cgroup``)."""
    with open("/proc/self/cgroup") as fh:
        lines = [line.rstrip("\n").split(":", 2) for line in fh if line.strip()]
    return {"pid": os.getpid(), "cgroups": {controllers or "v2": path for _, controllers, path in lines}}


@cy.step("zy_cgroups_capped", max_attempts=1, memory_limit="4GiB", max_processes=256)
def cgroups_capped(ctx: cy.Context, inp: dict) -> dict:
    """:func:`cgroups` of a step that declares caps (its children join the v1 cgroups that
    hold them at birth, where the host has those)."""
    return cgroups(ctx, inp)


@cy.step("zy_holdings", max_attempts=1)
def holdings(ctx: cy.Context, inp: dict) -> dict:
    """What the handler's process holds: its sockets (kind, peer), its threads, and its
    environment as the kernel shows it (/proc/self/environ) and as Python sees it."""
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                peer = sock.getpeername()
            except OSError:
                peer = None
            sockets.append({"fd": fd, "family": int(sock.family), "peer": str(peer)})
    with open("/proc/self/environ", "rb") as fh:
        raw = fh.read().decode(errors="replace").replace("\x00", "\n")
    return {"pid": os.getpid(), "sockets": sockets, "threads": len(os.listdir("/proc/self/task")),
            "environ": dict(os.environ), "raw": raw}


@cy.step("zy_block", max_attempts=3)
def block(ctx: cy.Context, inp: dict) -> dict:
    """Writes ``pid`` to ``inp["pids"]`` and runs until killed (``inp["seconds"]``)."""
    with open(inp["pids"], "a") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(inp.get("seconds", 300))
    return {"pid": os.getpid()}


def _ticker() -> None:
    while True:
        time.sleep(3600)


if os.environ.get("CYCLONE_MP_SUPERVISOR") and os.environ.get("ZYGOTE_THREAD_AT_IMPORT"):
    threading.Thread(target=_ticker, daemon=True, name="started-at-import").start()
