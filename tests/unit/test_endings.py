"""Process control's endings on a fake clock: what is said in the log about errors no retry can heal."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from cyclone_mp import decisions
from cyclone_mp.attempts import Attempt
from cyclone_mp.endings import UNHEALABLE_LOG_EVERY, AttemptEndings


def test_an_unhealable_error_is_said_once_a_minute_per_step_and_kind_with_a_count(caplog):
    now = [100.0]
    endings = AttemptEndings(SimpleNamespace(clock=lambda: now[0]))  # only the clock is read
    att = Attempt(key=(1, 1), run_id="r", node="n", step_name="s", attempt=1, timeout=None, token="t1",
                  child=None, workflow=False, started=0.0, deadline=None, lease_sent=0.0)
    caplog.set_level(logging.ERROR, logger="cyclone_mp.supervisor")
    for _ in range(3):
        endings.say_unhealable(att, decisions.NOT_IMPORTABLE, {"message": "no module"})
    assert len(caplog.records) == 1
    endings.say_unhealable(att, decisions.OUTPUT_INVALID, {"message": "bad output"})  # another kind: said
    assert len(caplog.records) == 2
    now[0] += UNHEALABLE_LOG_EVERY
    endings.say_unhealable(att, decisions.NOT_IMPORTABLE, {"message": "no module"})
    assert len(caplog.records) == 3 and "2 more of step 's'" in caplog.records[-1].getMessage()
