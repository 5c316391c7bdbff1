"""Resource caps as options: sizes parsed and printed, bad values refused, the precedence
of client, step and enqueue stored on the step row; and the pure decisions that judge a
tree from its evidence (``over_limit``, ``cause_of_death``) and quarantine a step that
keeps dying of the same cause."""

from __future__ import annotations

import signal

import pytest

import cyclone_mp as cy
from cyclone_mp import decisions
from cyclone_mp.errors import ConfigurationError
from cyclone_mp.limits.declared import GIB, MIB, Limits, format_size, parse_size
from cyclone_mp.limits.verdicts import Usage, cause_of_death, death_summary, note_tree_count, over_limit
from cyclone_mp.store import Q, connect

import limit_handlers as lh

pytestmark = pytest.mark.usefixtures("no_cgroup_left_behind")


# -- options: precedence, validation, storage ----------------------------------------------------


def test_sizes_parse_and_print():
    assert parse_size("512MiB") == 512 * MIB and parse_size("512M") == 512 * MIB
    assert parse_size("2G") == 2 * GIB and parse_size("1.5GiB") == int(1.5 * GIB)
    assert parse_size("300MB") == 300_000_000 and parse_size(64 * MIB) == 64 * MIB
    assert format_size(2.1 * GIB) == "2.1 GiB" and format_size(512 * MIB) == "512 MiB"
    for bad in ("lots", "12 parsecs", -1, 10, True, 1.5, "1 KiB"):
        with pytest.raises(ConfigurationError):
            parse_size(bad)


@pytest.mark.parametrize("options, words", [
    ({"memory_limit": "lots"}, "memory_limit"),
    ({"cpu_limit": -1}, "cpu_limit"),
    ({"cpu_limit": "2"}, "cpu_limit"),
    ({"max_processes": 0}, "max_processes"),
    ({"max_open_files": 1.5}, "max_open_files"),
])
def test_bad_limits_are_configuration_errors(cyclone_env, options, words):
    with pytest.raises(ConfigurationError, match=words):
        cy.step("lim_bad", **options)(lh.noop.fn)
    with pytest.raises(ConfigurationError, match=words):
        cyclone_env.enqueue(lh.noop, {}, **options)
    with pytest.raises(ConfigurationError, match=words):
        cy.Client(cyclone_env.dsn, **options)


def test_limits_follow_the_precedence_and_are_stored_on_the_row(cyclone_env_factory):
    """Client-wide < the step's < the enqueue's (SPEC 2), stored on the step row at
    enqueue (so every supervisor applies the same caps), shown by status and --json."""
    env = cyclone_env_factory(memory_limit="1GiB", cpu_limit=30, max_open_files=100)
    step = cy.step("lim_prec", memory_limit="256MiB", max_processes=8)(lh.noop.fn)
    env.mux().register(step)
    plain = env.enqueue(step, {})
    over = env.enqueue(step, {}, memory_limit=64 * MIB, max_open_files=10)
    many = env.client().enqueue_many(step, [{}, {}], cpu_limit=5)
    wf = cy.Workflow("lim_prec_wf")
    wf.add(step)
    flow = env.enqueue(wf, {}, max_processes=3)
    st = env.status(plain).step
    assert (st.memory_limit, st.cpu_limit, st.max_processes, st.max_open_files) == (256 * MIB, 30.0, 8, 100)
    st = env.status(over).step
    assert (st.memory_limit, st.cpu_limit, st.max_processes, st.max_open_files) == (64 * MIB, 30.0, 8, 10)
    for run_id in many:
        assert env.status(run_id).step.cpu_limit == 5.0
    assert env.status(flow).step.max_processes == 3
    assert env.status(over).to_dict()["steps"]["lim_prec"]["memory_limit"] == 64 * MIB
    # no limits at all: nothing stored
    with cy.Client(env.dsn, cy.Mux().register(lh.noop)) as plain_client:
        free = plain_client.enqueue(lh.noop, {})
    st = env.status(free).step
    assert (st.memory_limit, st.cpu_limit, st.max_processes, st.max_open_files) == (None, None, None, None)
    with connect(env.dsn) as conn:
        row = conn.execute("SELECT memory_limit, max_processes FROM cyclone_steps WHERE run_id = %s", (over,)).fetchone()
    assert (row["memory_limit"], row["max_processes"]) == (64 * MIB, 8)


# -- pure decisions ---------------------------------------------------------------------------------


def test_over_limit_and_cause_of_death_decide_from_evidence():
    caps = Limits(memory=256 * MIB, cpu=2.0, processes=20)
    quiet = Usage(memory=100 * MIB, cpu=1.0, processes=3)
    for kernel in (True, False):
        assert over_limit(caps, quiet, kernel_memory_cap=kernel, kernel_process_cap=kernel) is None
    # a kernel cap: the memory cannot cross it, an OOM kill inside is the evidence
    assert over_limit(caps, Usage(memory=300 * MIB), kernel_memory_cap=True, kernel_process_cap=True) is None
    assert over_limit(caps, Usage(oom_kills=1, memory_cap_hits=3), kernel_memory_cap=True,
                      kernel_process_cap=True) == "memory_limit"
    # an OOM kill without the tree at its own cap is the machine's doing: judged if the tree dies
    assert over_limit(caps, Usage(oom_kills=1), kernel_memory_cap=True, kernel_process_cap=True) is None
    # sampling decides without a kernel cap
    assert over_limit(caps, Usage(memory=257 * MIB), kernel_memory_cap=False, kernel_process_cap=False) == "memory_limit"
    assert over_limit(caps, Usage(processes=21), kernel_memory_cap=False, kernel_process_cap=False) == "process_limit"
    assert over_limit(caps, Usage(processes=21), kernel_memory_cap=True, kernel_process_cap=True) is None
    assert over_limit(caps, Usage(fork_failures=1, at_process_cap=True), kernel_memory_cap=True,
                      kernel_process_cap=True) == "process_limit"
    # a refused fork with the tree below its cap now: an earlier attempt's, not this one's
    assert over_limit(caps, Usage(fork_failures=1), kernel_memory_cap=True, kernel_process_cap=True) is None
    assert over_limit(caps, Usage(cpu=2.0), kernel_memory_cap=True, kernel_process_cap=True) == "cpu_limit"
    # causes of a death nobody here caused
    assert cause_of_death(caps, Usage(), exit_signal=9, killed_for="cpu_limit") == "cpu_limit"
    assert cause_of_death(caps, Usage(oom_kills=1, memory_cap_hits=1), exit_signal=9, killed_for=None) == "memory_limit"
    assert cause_of_death(Limits(), Usage(oom_kills=1), exit_signal=9, killed_for=None) == "oom_killed"
    assert cause_of_death(caps, Usage(), exit_signal=signal.SIGXCPU, killed_for=None) == "cpu_limit"
    assert cause_of_death(caps, Usage(), exit_signal=None, killed_for=None, memory_error=True,
                          memory_by_rlimit=True) == "memory_limit"
    assert cause_of_death(caps, Usage(), exit_signal=None, killed_for=None, memory_error=True) is None
    # the kernel log names this child as the OOM killer's victim; without it a SIGKILL is nobody's known doing
    assert cause_of_death(Limits(), Usage(), exit_signal=9, killed_for=None, oom_logged=True) == "oom_killed"
    assert cause_of_death(Limits(), Usage(), exit_signal=9, killed_for=None) is None  # someone's kill -9
    # no pids cgroup: the tree seen over its cap, or at its RLIMIT_NPROC (one over the cap), as its handler ended
    assert over_limit(caps, Usage(processes=3, at_process_rlimit=True), kernel_memory_cap=False,
                      kernel_process_cap=False) == "process_limit"
    assert cause_of_death(caps, Usage(processes=21), exit_signal=None, killed_for=None) == "process_limit"
    assert cause_of_death(caps, Usage(processes=3, at_process_rlimit=True), exit_signal=None,
                          killed_for=None) == "process_limit"
    assert cause_of_death(caps, Usage(processes=20), exit_signal=None, killed_for=None) is None  # at the cap: allowed
    assert cause_of_death(caps, Usage(processes=21), exit_signal=None, killed_for=None, kernel_process_cap=True) is None
    counted = Usage()
    note_tree_count(counted, {"processes": 4, "tasks": 6, "nproc": 6})  # a runner of 2 threads, cap 4: 6 tasks is over
    assert (counted.processes, counted.at_process_rlimit) == (4, True)
    note_tree_count(counted := Usage(), {"processes": 4, "tasks": 5, "nproc": 6})
    assert not counted.at_process_rlimit
    assert death_summary("memory_limit", Limits(memory=512 * MIB), Usage(peak_memory=int(2.1 * GIB))) == \
        "memory_limit 512 MiB, peak 2.1 GiB"


def test_the_poison_quarantine_names_the_repeated_cause():
    entry = {"cause": "memory_limit 512 MiB, peak 2.1 GiB"}
    assert decisions.discard_message("memory_limit", entry, ["memory_limit", "memory_limit"]) == \
        "killed 3 times: memory_limit 512 MiB, peak 2.1 GiB"
    assert decisions.discard_message("memory_limit", entry, ["memory_limit", "cancelled", "memory_limit"]) == \
        "killed 3 times: memory_limit 512 MiB, peak 2.1 GiB"
    assert decisions.discard_message("memory_limit", entry, ["memory_limit", "error"]) is None  # once in a row
    assert decisions.discard_message("memory_limit", entry, []) is None
    assert decisions.discard_message("error", entry, ["error"]) is None
    assert decisions.discard_message("cpu_limit", {}, ["cpu_limit"]) is None
    for kind in decisions.DEATH_KINDS:
        assert kind in decisions.FAILURE_KINDS
        end = decisions.end_attempt(attempt=1, max_attempts=2, kind=kind, timed_out=False, backoff=0.0)
        assert (end.state, end.error_kind) == ("available", kind)
    assert {k.strip(" '") for k in Q["attempt_kinds_expr"].split(",")} == set(decisions.FAILURE_KINDS)
