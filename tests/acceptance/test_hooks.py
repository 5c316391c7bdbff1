"""mux.on_attempt_start / on_attempt_end run in the child around every handler;
mux.on_step_discarded runs in the supervisor when it writes a step discarded."""

from __future__ import annotations

import json
import time

import pytest

import cyclone_mp as cy

import hook_handlers as hh


def test_attempt_hooks_wrap_every_handler_and_discards_are_told(cyclone_env_factory, tmp_path, monkeypatch):
    log = tmp_path / "hooks.log"
    monkeypatch.setenv("CYCLONE_TEST_HOOK_LOG", str(log))
    told: list[dict] = []
    env = cyclone_env_factory(worker="thread", workers=1, poll_interval=(0.05, 0.2))
    mux = env.mux().register(hh.hooked_ok, hh.hooked_fails)
    mux.on_attempt_start(hh.opened)
    mux.on_attempt_end(hh.closed)
    mux.on_step_discarded(told.append)
    ok = env.enqueue(hh.hooked_ok, {})
    bad = env.enqueue(hh.hooked_fails, {})
    env.start_worker()
    assert env.run_until_complete(ok).step.output == {"session": True}  # the start hook ran first, in its child
    assert env.run_until_complete(bad).state == "discarded"
    deadline = time.monotonic() + 5
    while not told and time.monotonic() < deadline:
        time.sleep(0.05)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by = lambda node, event: [r for r in records if r["node"] == node and r["event"] == event]  # noqa: E731
    assert len(by("hooked_ok", "start")) == 1 and by("hooked_ok", "end")[0]["ok"] is True
    ends = by("hooked_fails", "end")
    assert [(e["attempt"], e["ok"], e["kind"]) for e in ends] == [(1, False, "error"), (2, False, "error")]
    assert ends[0]["error"] == "no luck"
    assert [(t["run_id"], t["node"], t["step_name"], t["error_kind"]) for t in told] == \
        [(bad, "hooked_fails", "hooked_fails", "error")]


def test_hooks_must_be_importable():
    mux = cy.Mux()
    with pytest.raises(cy.ConfigurationError, match="module level"):
        mux.on_attempt_start(lambda ctx: None)
    with pytest.raises(cy.ConfigurationError):
        mux.on_step_discarded("not callable")
