"""The watchdog process on its own (no supervisor, no database): a :class:`WatchdogLink`
tells it of children this test started, and their due times."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from cyclone_mp.watchdoglink import WatchdogLink

from waiting import not_zombie, wait_for


def test_the_watchdog_reports_only_the_kills_of_children_still_alive():
    """A child due while alive is killed and reported. One that had already exited (a
    zombie not reaped yet: it ended on its own, or a watchdog this one replaced killed
    it) is not reported: ``watchdog_kills`` counted it twice after a replacement."""
    link = WatchdogLink("test-watchdog")
    alive = subprocess.Popen(["sleep", "60"])
    ended = subprocess.Popen(["sleep", "60"])
    pidfds = [os.pidfd_open(alive.pid), os.pidfd_open(ended.pid)]
    try:
        link.child(alive.pid, pidfds[0])
        link.child(ended.pid, pidfds[1])
        ended.send_signal(signal.SIGKILL)
        wait_for(lambda: not not_zombie(ended.pid), 10, "the ended child to be a zombie")
        now = time.monotonic()
        link.due(ended.pid, now, now=now, horizon=1.0)
        link.due(alive.pid, now + 0.3, now=now, horizon=1.0)
        reported: list[int] = []
        wait_for(lambda: reported.extend(link.reports()) or reported, 10, "a kill report")
        assert alive.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.3)  # any later report has come by now
        reported.extend(link.reports())
        assert reported == [alive.pid]
        assert ended.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in (alive, ended):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for fd in pidfds:
            os.close(fd)
        link.close(clean=True)
