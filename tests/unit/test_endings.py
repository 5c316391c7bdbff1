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


def test_the_childs_own_start_is_the_attempts_start_when_it_lies_between_the_claim_and_now():
    """A result's ``began`` (the child's CLOCK_MONOTONIC) becomes the start that
    ``start_delay`` and ``started_wall`` say, mapped onto process control's clock (here
    skewed 1000 s from the monotonic one); nonsense leaves the noted start alone."""
    def attempt() -> Attempt:
        return Attempt(key=(1, 1), run_id="r", node="n", step_name="s", attempt=1, timeout=None, token="t1",
                       child=None, workflow=False, started=1010.0, deadline=None, lease_sent=1000.0,
                       claimed=1000.0, started_wall=5010.0)

    att = attempt()  # noted at 1010 (control clock); the child began at monotonic 15.5, i.e. 1015.5
    att.began_in_child(15.5, now=1020.0, mono=20.0)
    assert (att.started, att.start_delay(), att.started_wall) == (1015.5, 15.5, 5015.5)
    for began in (True, 3, "15.5", None, -1.0, 21.0, float("nan")):  # not a float, before the claim, in the future
        att = attempt()
        att.began_in_child(began, now=1020.0, mono=20.0)
        assert (att.started, att.start_delay(), att.started_wall) == (1010.0, 10.0, 5010.0), began


def test_a_rss_cap_below_what_one_step_leaves_is_said_once(caplog):
    """A child over max_child_rss after its first step is retired (as any over the cap),
    and the cap is said to be too low, once: every child would be replaced after each step."""
    retired = []
    control = SimpleNamespace(config=SimpleNamespace(max_steps_per_child=None, max_child_rss=5 * 2**20),
                              pool=SimpleNamespace(retire=retired.append, maintain=lambda now, draining: None),
                              clock=lambda: 0.0, draining=False)
    endings = AttemptEndings(control)
    caplog.set_level(logging.WARNING, logger="cyclone_mp.supervisor")
    for steps_run in (1, 1, 3):
        child = SimpleNamespace(returncode=None, recycle_due=False, steps_run=steps_run, last_rss=18 * 2**20,
                                concurrent={}, attempt=None)
        endings.maybe_recycle(child)
        assert child.recycle_due and retired[-1] is child
    assert len(caplog.records) == 1 and "below the RSS of a child after its first step (18.0 MiB)" in caplog.text
