"""The inbox's wake-up from a signal handler (the supervisor's SIGTERM and SIGINT)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A signal handler runs on the main thread between two bytecodes, so it can interrupt that
# thread while it holds the inbox's lock (process control's own ``take`` every turn, or a
# ``post``). Run in a child: a deadlock is a hang, which the timeout turns into a failure.
INTERRUPTED_UNDER_THE_LOCK = textwrap.dedent("""
    import os, signal
    from cyclone_mp.mailbox import Inbox, readable

    inbox = Inbox()
    signal.signal(signal.SIGTERM, lambda signum, frame: inbox.wake())
    with inbox._lock:  # where take() and post() hold it
        os.kill(os.getpid(), signal.SIGTERM)
        total = sum(range(1000))  # the handler runs here
    print("woken" if readable([inbox], 0.0) else "not woken")  # the wake-up byte is in its pipe
""")


def test_a_wake_from_a_signal_handler_returns_while_the_interrupted_thread_holds_the_lock():
    """A supervisor signalled while process control held its inbox's lock hung for good
    (a plain lock taken twice by one thread): no drain, no reap, no exit."""
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_UNDER_THE_LOCK], capture_output=True, text=True,
                          timeout=10)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "woken"
