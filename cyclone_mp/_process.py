"""A handler child's own process: it dies with its parent (``PR_SET_PDEATHSIG``), adopts
its handlers' orphans (a child subreaper), runs under ``SCHED_BATCH`` and leaves Ctrl-C
to the supervisor. Child-side: the standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

TYPE_CHECKING = False  # annotations only: not importing typing keeps a child's start fast
if TYPE_CHECKING:
    from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
OWN_THREAD_PREFIX = "cyclone-"  # the runner's own threads (never a handler's leftovers)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent thread dies (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(70)


def adopt_orphans() -> None:
    """Become a child subreaper (Linux): orphans of the handlers' trees become ours."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def batch_scheduling() -> None:
    """Run this child (and what it starts) under ``SCHED_BATCH`` (Linux; elsewhere a no-op).

    A step is background work: under SCHED_BATCH a child woken by its next task no longer
    preempts the supervisor or PostgreSQL on its core, and keeps its fair share of the
    CPU (same nice value). Without it every dispatch handed the core to the child
    mid-loop: a send to a waiting child took 86 us instead of 18 us, and short steps ran
    about 12 % slower. The supervisor's timers gain from it too.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def ignore_interrupt(signum: int, frame: Any) -> None:
    """SIGINT in a child does nothing: Ctrl-C is the supervisor's to handle. A handler,
    not ``SIG_IGN``: an ignored signal stays ignored across ``exec``, so every program a
    step started (ffmpeg, a script that stops on KeyboardInterrupt) could not be
    interrupted; a handler is reset to the default there."""


def lingering_threads(event_loop: Any, before: frozenset[int | None], wait: float = 0.05) -> list[threading.Thread]:
    """The threads started during the attempt that still run after it was
    cancelled or failed (waited for up to ``wait`` seconds). The async handlers' default
    executor (of ``event_loop``, None: no async handler ran) is shut down first (its
    idle workers end; a busy one is the attempt's) and made anew by the next attempt."""
    executor = getattr(event_loop, "_default_executor", None) if event_loop is not None else None
    if executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)
        event_loop._default_executor = None  # the next run_in_executor/to_thread makes a fresh one
    deadline = time.monotonic() + wait
    while True:
        left = [t for t in threading.enumerate()
                if t.ident not in before and t.is_alive() and not t.name.startswith(OWN_THREAD_PREFIX)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.005)
