"""The probe that says whether children can hold ``max_processes`` in user namespaces of
their own (:func:`cyclone_mp.limits.userns.user_namespaces_refused`): a refusal is tried
again, and the reason names the kernel's error or the signal. Its children are real
forks; the ``unshare`` they call is a fake that writes each try to a file."""

from __future__ import annotations

import ctypes
import errno
import os
import signal

import pytest

from cyclone_mp.limits import userns


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """``probe(outcomes)``: the probe's answer when its n-th try does ``outcomes[n]`` (0:
    the namespace is made, an errno: refused with it, "kill": the child dies of SIGKILL);
    returns ``(answer, tries)``."""
    monkeypatch.setattr(userns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(userns, "read_text", lambda path: None)
    log = tmp_path / "tries"

    def run(outcomes):
        def unshare(flags):
            with open(log, "a") as fh:
                fh.write("x")
            outcome = outcomes[min(len(log.read_text()) - 1, len(outcomes) - 1)]
            if outcome == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            ctypes.set_errno(outcome)
            return 0 if outcome == 0 else -1

        monkeypatch.setattr(userns, "_unshare", lambda: unshare)
        answer = userns.user_namespaces_refused()
        return answer, len(log.read_text()) if log.exists() else 0

    return run


def test_a_namespace_made_at_the_first_try_is_none(probe):
    assert probe([0]) == (None, 1)


def test_a_refusal_is_tried_again_and_a_later_success_counts(probe):
    assert probe([errno.EPERM, "kill", 0]) == (None, 3)


def test_three_refusals_name_the_kernels_error(probe):
    answer, tries = probe([errno.ENOSPC])
    assert tries == 3 and answer == f"the kernel refused an unprivileged user namespace ({os.strerror(errno.ENOSPC)})"


def test_a_probe_killed_every_time_names_the_signal(probe):
    answer, tries = probe(["kill"])
    assert tries == 3 and answer.endswith(f"(the probe was killed by signal {int(signal.SIGKILL)})")
