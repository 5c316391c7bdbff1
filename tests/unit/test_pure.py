"""Pure logic, no I/O: decisions, backoff, frames, redaction (STYLE pattern 11)."""

from __future__ import annotations

import datetime as dt
import os

import psycopg
import pytest

from cyclone_mp import RunStatus, StepStatus, backoff, decisions, protocol
from cyclone_mp.store import Q, redact
from cyclone_mp.store.queries import _code


def test_failed_attempt_retries_until_exhausted():
    end = decisions.end_attempt(attempt=1, max_attempts=3, kind="error", timed_out=False, backoff=2.0)
    assert (end.state, end.attempt, end.error_kind, end.delay) == ("available", 2, "error", 2.0)
    end = decisions.end_attempt(attempt=3, max_attempts=3, kind="error", timed_out=False, backoff=2.0)
    assert (end.state, end.attempt, end.delay) == ("discarded", 3, 0.0)


def test_permanent_discards_and_db_timeout_wins():
    assert decisions.end_attempt(attempt=1, max_attempts=9, kind="permanent", timed_out=False, backoff=1).state == "discarded"
    end = decisions.end_attempt(attempt=1, max_attempts=9, kind="child_exited", timed_out=True, backoff=1)
    assert (end.state, end.error_kind) == ("available", "timeout")
    with pytest.raises(ValueError):
        decisions.end_attempt(attempt=1, max_attempts=9, kind="nope", timed_out=False, backoff=1)


@pytest.mark.parametrize("timed_out,expired,reclaims,max_reclaims,action", [
    (True, True, 0, None, "timeout"),
    (False, False, 0, None, "none"),
    (False, True, 5, None, "reclaim"),
    (False, True, 1, 2, "reclaim"),
    (False, True, 2, 2, "reclaim_limit"),
    (False, True, 0, 0, "reclaim_limit"),
])
def test_expiry_decisions(timed_out, expired, reclaims, max_reclaims, action):
    got = decisions.expiry(timed_out=timed_out, lease_expired=expired, reclaims=reclaims, max_reclaims=max_reclaims)
    assert got.action == action


def test_default_backoff_is_attempt_to_the_fourth_with_jitter():
    assert backoff.default_backoff(3, rand=lambda: 0.5) == 81.0
    assert backoff.default_backoff(3, rand=lambda: 0.0) == pytest.approx(72.9)
    assert backoff.default_backoff(3, rand=lambda: 1.0) == pytest.approx(89.1)
    assert backoff.compute_backoff(lambda n: "bad", 2) == pytest.approx(16, rel=0.11)  # broken user backoff
    assert backoff.from_spec([1, 5], 1) == 1 and backoff.from_spec([1, 5], 7) == 5 and backoff.from_spec(3, 9) == 3
    with pytest.raises(ValueError):
        backoff.check_backoff([])


def test_frames_roundtrip_and_limits():
    reader = protocol.FrameReader(limit=1024)
    data = protocol.encode({"t": "x", "n": 1}) + protocol.encode({"t": "y"})
    assert reader.feed(data[:5]) == []
    assert reader.feed(data[5:]) == [{"t": "x", "n": 1}, {"t": "y"}]
    with pytest.raises(protocol.ProtocolError):
        protocol.FrameReader(limit=4).feed(protocol.encode({"big": "x" * 10}))


def test_unstorable_values_are_named():
    assert protocol.unstorable({"a": ["ok", {"b": "x\x00y"}]}) == "a NUL character (\\u0000)"
    assert protocol.unstorable({"\ud800": 1}).startswith("a lone surrogate")
    assert protocol.unstorable({"fine": [1, 2.5, None, True]}) is None
    assert protocol.storable("a\x00b\udcff") == "a\\x00b\\udcff"


@pytest.mark.parametrize("text", [
    "host=127.0.0.1 port=1 user=u password='se cret' dbname=x",
    "postgresql://u@127.0.0.1:1/x?password=secret: connection failed",
    "postgresql://u:secret@h/x",
    "postgres://u:p%20secret@h:5/d?sslmode=require&password=secret",
    "user=u PASSWORD = secret host=h",
    "postgresql://u@h/x?password=se):cret&sslmode=require",  # ")" and ":" are legal in a query value
    "postgresql://u@h/x?password=a)(b):secret",
])
def test_redact_hides_every_password(text):
    out = redact(text)
    assert "secret" not in out and "cret" not in out and "***" in out


def test_sql_loses_its_comments_but_never_a_string():
    assert _code("   AND s.id = ANY(%(ids)s)  -- by primary key") == "   AND s.id = ANY(%(ids)s)"
    assert _code("SELECT '--not a comment' AS x -- a comment") == "SELECT '--not a comment' AS x"
    assert _code("SELECT 'it''s -- here', 1") == "SELECT 'it''s -- here', 1"
    assert all("--" not in line or "'" in line for q in Q.values() for line in q.splitlines())


def test_the_hot_statements_fit_psycopgs_parse_cache():
    # psycopg caches the parsed form of queries up to MAX_CACHED_STATEMENT_LENGTH
    # characters; a longer one is parsed again on every call (about 75 us for the 6,700
    # characters settle had). The store raises that limit to fit the hot statements.
    from psycopg import _queries

    from cyclone_mp.store import PARSE_CACHE_LENGTH

    assert _queries.MAX_CACHED_STATEMENT_LENGTH >= PARSE_CACHE_LENGTH
    for name in ("claim", "settle", "settle_completions"):
        assert len(Q[name].encode()) <= PARSE_CACHE_LENGTH, name


def test_a_script_that_fails_to_load_raises_its_error_again(tmp_path):
    """A child preloads handler scripts and loads them again for a step if that failed:
    the second try must raise the script's own error, not find a half-run module."""
    from cyclone_mp._tasks import import_ref

    script = tmp_path / "broken_app.py"
    script.write_text("def handler(ctx, inp):\n    return 1\n\nraise RuntimeError('broken on purpose')\n")
    ref = {"module": "cyclone_mp_app_broken_test", "qualname": "handler", "path": str(script)}
    for _ in range(2):
        with pytest.raises(RuntimeError, match="broken on purpose"):
            import_ref(ref, {})
    script.write_text("def handler(ctx, inp):\n    return 1\n")  # mended: it loads
    assert import_ref(ref, {})(None, None) == 1


def test_a_handler_that_cannot_take_ctx_and_input_is_refused_at_registration() -> None:
    """Found by a new user: ``def x(ctx)`` was accepted, then every attempt of every run
    failed with a TypeError and was retried 25 times."""
    import cyclone_mp as cy

    with pytest.raises(cy.ConfigurationError, match=r"called as fn\(ctx, input\); \S*x\(ctx\) cannot be"):
        @cy.step("one_argument")
        def x(ctx):  # noqa: ANN001 - the wrong signature on purpose
            return {}
    with pytest.raises(cy.ConfigurationError, match="cannot be"):
        cy.step("keyword_only")(lambda ctx, *, inp: {})

    @cy.step("extras_are_fine")
    def fine(ctx, inp, *more, option=1):  # noqa: ANN001
        return {}

    assert cy.step("varargs")(lambda *args: {}).name == "varargs"



def test_a_new_watchdog_hears_what_the_last_one_knew(monkeypatch):
    """WatchdogLink.restart: the cgroups, the children still alive (each with its pidfd),
    their due times, then the descendants seen that still run go to the new watchdog, in
    that order (what a slow new watchdog cannot take in time is dropped from the end). A
    child gone before is not mentioned and our copy of its pidfd was closed with it."""
    import socket

    import psutil

    from cyclone_mp import watchdoglink
    from cyclone_mp.watchdoglink import WatchdogLink

    closed: list[int] = []
    close = os.close
    monkeypatch.setattr(watchdoglink.os, "close", lambda fd: (closed.append(fd), close(fd)))
    link = WatchdogLink.__new__(WatchdogLink)  # its bookkeeping alone: no watchdog process
    link._due, link._held, link._warned = {}, {}, False
    link._children, link._seen, link._cgroups = {}, {}, []
    sent: list[tuple[str, int]] = []
    link._send = lambda data, fds=None: sent.append((data.decode(), len(fds or [])))  # type: ignore[method-assign]
    r, w = os.pipe()  # stand in for two children's pidfds
    me = psutil.Process().create_time()
    try:
        link.cgroups([("v2", "/sys/fs/cgroup/sup")])
        link.child(5, r, "/sys/fs/cgroup/sup/slot-0")
        link.child(6, w)
        link.seen(os.getpid(), me)  # still runs
        link.seen(2**22 + 7, 12.5)  # gone (no such pid)
        link.due(5, 130.0, now=100.0, horizon=15.0)
        link.due(6, 131.0, now=100.0, horizon=15.0)
        copy_of_6 = link._children[6][0]
        link.gone(6)
        assert 6 not in link._children and copy_of_6 in closed
        link.sock, new_sock = socket.socket(), socket.socketpair()
        link.popen = type("Exited", (), {"wait": lambda self, timeout=None: 0})()
        link._start = lambda: setattr(link, "sock", new_sock[0])  # type: ignore[method-assign]
        sent.clear()
        link.restart()
        assert sent == [("cgroup v2 /sys/fs/cgroup/sup", 0), ("child 5 /sys/fs/cgroup/sup/slot-0", 1),
                        ("due 5 130.0", 0), (f"seen {os.getpid()} {me!r}", 0)]
        for end in new_sock:
            end.close()
    finally:
        for pid in list(link._children):
            link._forget_child(pid)
        close(r)
        close(w)


def test_the_watchdog_hears_an_earlier_due_at_once_and_a_later_one_before_the_earlier_comes_near():
    """WatchdogLink.due (issue 17): a message per pipelined step cost the supervisor a third
    of its CPU. The time the watchdog holds is never later than the child's real due; a
    later one (or None: idle) is sent once the earlier one is ``horizon`` away."""
    from cyclone_mp.watchdoglink import WatchdogLink

    link = WatchdogLink.__new__(WatchdogLink)  # its bookkeeping alone: no watchdog process
    link._due, link._held, link._warned = {}, {}, False
    link._children, link._seen, link._cgroups = {}, {}, []
    sent: list[str] = []
    link._send = lambda data, fds=None: sent.append(data.decode())  # type: ignore[method-assign]

    link.due(7, 130.0, now=100.0, horizon=15.0)
    assert sent == ["due 7 130.0"]  # the first one goes
    link.due(7, 130.5, now=100.1, horizon=15.0)
    link.due(7, None, now=100.2, horizon=15.0)  # idle: held back, the watchdog keeps 130
    assert sent == ["due 7 130.0"] and link.next_refresh(15.0) == 115.0
    link.due(7, 129.0, now=100.3, horizon=15.0)  # earlier than what the watchdog has: at once
    assert sent[-1] == "due 7 129.0" and link.next_refresh(15.0) is None
    link.due(7, 140.0, now=100.4, horizon=15.0)
    link.refresh(113.0, 15.0)  # 129 is 16 s away: not yet
    assert sent[-1] == "due 7 129.0"
    link.refresh(114.5, 15.0)  # within the horizon: the later time goes
    assert sent[-1] == "due 7 140.0" and link.next_refresh(15.0) is None
    link.due(7, 150.0, now=130.0, horizon=15.0)  # the one sent is 10 s away: a later one goes at once
    assert sent[-1] == "due 7 150.0"
    link.gone(7)
    assert link._held == {} and link._due == {}


def test_a_sigkill_is_oom_killed_only_when_the_kernel_log_names_that_pid(tmp_path):
    """Where no cgroup counts a child's memory, a SIGKILL nobody here sent is ``oom_killed``
    only when the kernel log says the OOM killer killed that very pid, after the child
    was born; another process's OOM kill (the machine-wide counter moving) is not
    evidence, nor is an OOM kill of an earlier process that had the pid. Else it is
    nobody's known doing (``child_exited``, signal 9)."""
    from types import SimpleNamespace

    from cyclone_mp.limits.confinement import Confinement
    from cyclone_mp.limits.declared import NO_LIMITS
    from cyclone_mp.limits.watch import LimitWatch

    log = tmp_path / "kmsg"
    log.write_bytes(b"")
    conf = Confinement.none(userns=lambda: None, kmsg=str(log))
    assert conf.kernel_log.readable and conf.mechanism.oom == "kernel log"
    watch = LimitWatch(conf)

    def sigkilled(pid: int, born: float):
        child = SimpleNamespace(slot=None, pid=pid, spawned=born)
        att = SimpleNamespace(child=child, usage=None, base=None, limits=NO_LIMITS, killed_for=None)
        found = watch.death(att, exit_signal=9)
        return found[0] if found else None

    def logged(pid: int, at: float) -> None:  # a record as /dev/kmsg gives it, one per read
        with open(log, "ab") as fh:
            fh.write(f"3,{int(at)},{int(at * 1e6)},-;Out of memory: Killed process {pid} (python3) "
                     f"total-vm:157424kB, anon-rss:71808kB, UID:1000\n".encode())

    logged(111, 50.0)  # another process, anywhere on the machine
    assert sigkilled(4242, born=40.0) is None  # not this child's evidence
    logged(4242, 30.0)  # an earlier process with this pid, before the child was born
    assert sigkilled(4242, born=40.0) is None
    logged(4242, 60.0)  # this child
    assert sigkilled(4242, born=40.0) == "oom_killed"
    # without a readable log: no evidence at all
    conf.close()
    blind = Confinement.none(userns=lambda: None, kmsg=str(tmp_path / "absent"))
    assert not blind.kernel_log.readable and blind.mechanism.oom == "none"
    assert "a SIGKILL nobody here sent is child_exited" in blind.mechanism.start_line()[1]
    blind.close()


def _step(name: str, state: str, *, kind: str = "task", started: bool = False) -> StepStatus:
    at = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc) if started else None
    return StepStatus(name=name, state=state, attempt=1, max_attempts=3, reclaims=0, error=None, error_kind=None,
                      errors=[], started_at=at, finished_at=None, lease_owner=None, output=None, kind=kind)


@pytest.mark.parametrize("state, steps, queued", [
    ("running", [_step("a", "available")], True),
    ("running", [_step("a", "available", started=True)], False),  # reclaimed, retried or released: it ran
    ("running", [_step("a", "running", started=True)], False),
    ("paused", [_step("a", "available")], False),
    ("running", [_step("s", "waiting_signal", kind="signal"), _step("a", "pending")], True),
    ("running", [_step("s", "completed", kind="signal"), _step("a", "available")], True),  # no supervisor runs a signal
    ("running", [_step("a", "completed", started=True), _step("b", "available")], False),
    ("running", [_step("t", "waiting_timer", kind="timer")], False),  # no task step at all
])
def test_a_run_is_queued_until_a_supervisor_claims_one_of_its_task_steps(state, steps, queued):
    run = RunStatus(id="r", name="n", kind="workflow", state=state, input=None,
                    created_at=dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc), finished_at=None,
                    steps={s.name: s for s in steps})
    assert run.queued is queued


def test_the_call_timer_cuts_a_call_due_before_the_one_it_sleeps_for() -> None:
    """CallTimer (SPEC 9: every database call has a client-side bound) sleeps until the
    first entry of its heap is due and is woken only for a call due before that. A call
    bounded to 0.2 s inside one bounded to 30 s has its socket shut down within 0.2 s
    (not after 30), the outer call's socket is left alone, and a call whose block ended
    before its bound is never cut."""
    import socket
    import time
    import types

    from cyclone_mp.calltimer import CallTimer

    def store(sock: socket.socket) -> types.SimpleNamespace:
        return types.SimpleNamespace(conn=types.SimpleNamespace(pgconn=types.SimpleNamespace(socket=sock.fileno())))

    timer = CallTimer()
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        (outer, _), (inner, _), (quick, _) = pairs
        with timer.bound(store(outer), 30.0):
            time.sleep(0.05)  # the timer thread now sleeps until the outer call's bound
            with timer.bound(store(inner), 0.2):
                inner.settimeout(5.0)
                started = time.monotonic()
                assert inner.recv(1) == b""  # shut down: the waiting call ends at once
                assert time.monotonic() - started < 2.0
            with timer.bound(store(quick), 0.2):
                pass  # over before its bound
            time.sleep(0.4)  # past the quick call's bound
            for sock in (outer, quick):
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):  # still open, nothing to read
                    sock.recv(1)
        assert timer.fired == 1
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_prepared_statement_a_pooler_mixed_up_is_named_and_not_retried_as_a_stale_plan():
    """42P05 comes from a transaction-mode pooler without --pgbouncer: preparing again
    would not help (and DEALLOCATE ALL would reach other clients' sessions), so it is no
    stale plan; its error says what to do."""
    from cyclone_mp.connections import STALE_PLAN_LOG, classify, stale_plan

    dup = psycopg.errors.DuplicatePreparedStatement('prepared statement "_pg3_1" already exists')
    assert not stale_plan(dup) and "--pgbouncer" in str(classify(dup))
    assert stale_plan(psycopg.errors.InvalidSqlStatementName('prepared statement "_pg3_3" does not exist'))
    assert not stale_plan(psycopg.errors.UniqueViolation("duplicate key"))
    assert "--pgbouncer" in STALE_PLAN_LOG
