"""Process control built alone (``control_alone``): a real ``ProcessControl`` whose
watchdog and outcome writer are fakes, so a test drives its decisions on a fake clock
(seconds, ``time.monotonic``'s scale) with nothing running and no database."""

from __future__ import annotations

import os
import time
from typing import Any

import cyclone_mp as cy
from cyclone_mp.control import ProcessControl

import handlers as h


class FakeWatchdog:
    """Stands in for procs.WatchdogLink when process control is built alone."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.pid = -1
        self.dues: dict[int, Any] = {}
        self.exited = False

    def fileno(self) -> int:
        return self.r

    def child(self, pid: int, pidfd: Any, cgroup: Any = None) -> None:
        pass

    def seen(self, pid: int, started: float) -> None:
        pass

    def due(self, pid: int, when: Any, *, now: float, horizon: float) -> None:
        self.dues[pid] = when

    def refresh(self, now: float, horizon: float) -> None:
        pass

    def next_refresh(self, horizon: float) -> None:
        return None

    def gone(self, pid: int) -> None:
        self.dues.pop(pid, None)

    def reports(self) -> list[int]:
        return []

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class FakeWriter:
    """Stands in for the outcome writer: keeps what process control hands it."""

    def __init__(self) -> None:
        self.outcomes: list[Any] = []
        self.idle = True

    def post(self, outcome: Any) -> None:
        self.outcomes.append(outcome)

    def post_batch(self, outcomes: Any, claim: int = 0, start_now: int | None = None) -> None:
        self.outcomes.extend(outcomes)

    def post_dead(self, keys: Any) -> None:
        pass


def control_alone(config: Any, clock: Any = time.monotonic) -> Any:
    """A ProcessControl with fake peers (nothing runs, no database): ``(control,
    watchdog, writer)``; the caller closes the control and the watchdog."""
    mux = cy.Mux()
    mux.register(h.ok)
    watchdog, writer = FakeWatchdog(), FakeWriter()
    control = ProcessControl("test-control", mux, config, keeper=lambda m: None, writer=writer,
                             watchdog=watchdog, clock=clock)
    return control, watchdog, writer
