"""The supervisor's watchdog: when the supervisor dies, nothing it started survives.

``python -m cyclone_mp._watchdog FD SUPERVISOR_ID``. The supervisor holds the only write
end of pipe ``FD``; EOF means the supervisor is gone (exited or SIGKILLed). Children
already die with it (``PR_SET_PDEATHSIG``), but their own children (grandchildren, even
ones that left the group with ``setsid()``) would be reparented to init. On EOF the
watchdog SIGKILLs every process whose environment carries this supervisor's marker
(only processes this supervisor started carry it), then exits.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> None:
    fd, supervisor_id = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    from .procs import kill_marked

    for _ in range(3):  # a fork may race one pass
        if not kill_marked(supervisor_id, exclude={os.getpid()}):
            break
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
