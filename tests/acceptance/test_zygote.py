"""Children forked from a zygote (issue 23) keep every guarantee of SPEC 1.

The zygote imports the runner and the handlers' modules once and forks each child with
``clone(CLONE_PARENT)``. These tests check what a user or an operator can observe: who
imported a module, whose child a child is, what it holds, and that the zygote's death,
and the supervisor's, leave nothing running. The rest of the suite runs with the
zygote too (it is the default); ``start_method="spawn"`` is the contrast where it shows.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time

import psutil
import pytest

import cyclone_mp as cy
from cyclone_mp.limits import slot as slot_module
from cyclone_mp.limits.confinement import Confinement
from cyclone_mp.limits.declared import Limits
from cyclone_mp.limits.slot import Slot
import handlers as h
import zygote_handlers as zh
from waiting import not_zombie


alive = not_zombie


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"{what} not within {timeout} s")


def output_in_a_new_child(env, killed: int, timeout: float = 30.0) -> dict:
    """The output of a ``zy_cgroups`` step that ran in a child other than ``killed`` (just
    SIGKILLed). A step handed to that child before its death was seen fails as
    ``child_exited`` (``max_attempts=1``: no output): another is enqueued then."""
    def ran_elsewhere() -> dict | None:
        step = env.run_until_complete(env.enqueue(zh.cgroups, {})).step
        if step.output is None:  # only the dying child's failure is expected here
            assert step.error_kind == "child_exited", step.errors
            return None
        return step.output if step.output["pid"] != killed else None

    return wait_for(ran_elsewhere, timeout, "a step in the replacement")


def imports(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
def test_a_handler_module_is_imported_once_and_children_are_the_supervisors_own(
        cyclone_env_factory, monkeypatch, tmp_path, start_method):
    """The module's import side effect runs once, in the zygote, however many children
    start (two, then two replacements of SIGKILLed ones); with ``spawn`` once per child.
    Either way a child's parent is the supervisor, in its own process group."""
    counter = tmp_path / "imports"
    monkeypatch.setenv("ZYGOTE_IMPORTS", str(counter))
    env = cyclone_env_factory(worker="thread", workers=2, start_method=start_method)
    env.mux().register(zh.whoami)
    handle = env.start_worker()
    seen = [env.run_until_complete(env.enqueue(zh.whoami, {"sleep": 0.2})).step.output for _ in range(2)]
    first = set(wait_for(lambda: len(env.child_pids()) == 2 and env.child_pids(), 10, "two children"))
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(env.child_pids()) == 2 and not set(env.child_pids()) & first, 10, "two replacements")
    seen += [env.run_until_complete(env.enqueue(zh.whoami, {"sleep": 0.2})).step.output for _ in range(2)]
    stats = handle.client.supervisor.stats
    assert stats["children_spawned"] >= 4
    for out in seen:
        assert out["ppid"] == os.getpid()  # the supervisor (a thread of this process), not the zygote
        assert out["pgid"] == out["pid"]  # its own process group
        assert out["sid"] == os.getsid(0)
    handler_pids = {out["pid"] for out in seen}
    if start_method == "zygote":
        zygotes = env.zygote_pids()
        assert len(zygotes) == 1
        assert imports(counter) == zygotes  # once, by the zygote
        assert not handler_pids & set(zygotes)
        assert stats["children_forked"] == stats["children_spawned"]
    else:
        assert env.zygote_pids() == []
        assert stats["children_forked"] == 0
        assert len(imports(counter)) == stats["children_spawned"]  # once per child
        assert handler_pids <= set(imports(counter))


HOST = Confinement.detect("zygote-probe")  # what this machine offers (removed at once below)
HOST.close()


V1_ON_DEMAND = bool(HOST.v2 and HOST.v2_kill and (HOST.memory_v1 or HOST.pids_v1))  # a hybrid host (as here)
V1_KEYS = [key for key, where in (("memory", HOST.memory_v1), ("pids", HOST.pids_v1)) if where]


def recorded_moves(monkeypatch) -> list[tuple[str, str]]:
    """Every ``cgroup.procs`` write of the supervisor (a move; in this process: it runs as a thread)."""
    writes: list[tuple[str, str]] = []
    real_write = slot_module.write_text

    def recording_write(path, text):
        if path.endswith("cgroup.procs"):
            writes.append((path, text))
        real_write(path, text)

    monkeypatch.setattr(slot_module, "write_text", recording_write)
    return writes


def in_slot(out: dict, slot_dirs: dict[str, str], keys) -> bool:
    """The step's ``/proc/self/cgroup`` (``zh.cgroups``) shows it in the slot's directories ``keys``."""
    return all(any(key in name.split(",") and slot_dirs[key].endswith(where) for name, where in out["cgroups"].items())
               for key in keys)


@pytest.mark.skipif(not HOST.v2, reason="no cgroup v2 here (children cannot be created in a cgroup)")
def test_a_forked_child_is_created_in_a_fresh_cgroup_of_its_slot_and_never_moved(cyclone_env_factory, monkeypatch):
    """Moving a process into a cgroup waits for a kernel RCU grace period (7-15 ms on
    this host's cgroup v1 before the favordynmods note in docs/operating.md); creating
    it in one does not. With handlers that declare no caps, every child is created in a
    v2 directory of its slot no process was ever in (the first ``slot-0``, a SIGKILLed
    child's replacement ``slot-0.1``: the old one is removed), and nothing, neither the
    supervisor nor the child, writes a ``cgroup.procs``: on a hybrid host the child is
    in none of the slot's v1 cgroups."""
    writes = recorded_moves(monkeypatch)
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.cgroups)
    handle = env.start_worker()
    pool = handle.client.supervisor.control.pool
    slot = pool.confinement.slot(0)
    first = env.run_until_complete(env.enqueue(zh.cgroups, {})).step.output
    dirs_first = dict(slot.dirs)
    (child,) = pool.children
    assert child.pid == first["pid"] and child.in_cgroup
    os.kill(first["pid"], signal.SIGKILL)  # our own child (the supervisor is a thread here), by its pid
    second = output_in_a_new_child(env, first["pid"])
    (child,) = pool.children
    assert child.pid == second["pid"] and child.in_cgroup
    assert dirs_first["v2"].endswith("/slot-0") and slot.dirs["v2"] == dirs_first["v2"] + ".1"
    assert not os.path.exists(dirs_first["v2"])
    assert in_slot(first, dirs_first, ["v2"]) and in_slot(second, slot.dirs, ["v2"])
    assert writes == []
    if V1_ON_DEMAND:
        for out in (first, second):
            assert not any(in_slot(out, slot.dirs, [key]) for key in V1_KEYS), out


@pytest.mark.skipif(not V1_ON_DEMAND, reason="not a hybrid host (caps in cgroup v1, the tree in v2)")
@pytest.mark.parametrize("can_move_itself", [True, False], ids=["itself", "moved"])
def test_an_attempt_with_caps_has_its_child_join_their_v1_cgroups_first(cyclone_env_factory, monkeypatch, tmp_path,
                                                                        can_move_itself):
    """The first attempt with ``memory_limit`` and ``max_processes`` (given at enqueue)
    runs in its slot's v1 ``memory`` and ``pids`` cgroups: the supervisor moved the idle
    child into them first, once (a second such attempt moves nothing). From then on
    every new child joins them at birth: a SIGKILLed child's replacement moves itself
    (process control's thread writes nothing for it), or, when it cannot (given
    directories without ``cgroup.procs``), is moved from the supervisor, as a spawned
    child is."""
    writes = recorded_moves(monkeypatch)
    decoys: list[int] = []  # directories without cgroup.procs, given instead of the slot's
    if not can_move_itself:
        real_entry = Slot.entry

        def decoy_entry(self):
            entry = real_entry(self)
            decoys.extend(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY) for _ in entry)
            return [(key, fd) for (key, _), fd in zip(entry, decoys[-len(entry):])]

        monkeypatch.setattr(Slot, "entry", decoy_entry)
    try:
        env = cyclone_env_factory(worker="thread", workers=1)
        env.mux().register(zh.cgroups)
        handle = env.start_worker()
        slot = handle.client.supervisor.control.pool.confinement.slot(0)
        caps = {"memory_limit": "4GiB", "max_processes": 256}
        first = env.run_until_complete(env.enqueue(zh.cgroups, {}, **caps)).step.output
        assert in_slot(first, slot.dirs, ["v2", *V1_KEYS]), (slot.dirs, first)
        assert sorted(writes) == sorted((os.path.join(slot.dirs[key], "cgroup.procs"), str(first["pid"]))
                                        for key in V1_KEYS)
        assert env.run_until_complete(env.enqueue(zh.cgroups, {}, **caps)).step.output["pid"] == first["pid"]
        assert len(writes) == len(V1_KEYS)  # in them already
        os.kill(first["pid"], signal.SIGKILL)
        second = output_in_a_new_child(env, first["pid"])
        assert in_slot(second, slot.dirs, ["v2", *V1_KEYS]), (slot.dirs, second)  # joined at birth, no caps needed
        moved_by_supervisor = [text for _, text in writes if text == str(second["pid"])]
        assert len(moved_by_supervisor) == (0 if can_move_itself else len(V1_KEYS)), writes
    finally:
        for fd in decoys:
            os.close(fd)


@pytest.mark.skipif(not (V1_ON_DEMAND and HOST.memory_v1), reason="no hybrid host with a v1 memory hierarchy")
def test_a_child_that_ran_steps_is_replaced_before_a_memory_limit_it_would_escape(cyclone_env_factory, monkeypatch):
    """What a process holds stays charged to its old cgroup when it joins a v1 memory
    cgroup, so a child that already ran steps outside it would take that beyond the
    cap: before the first attempt with ``memory_limit`` it is replaced by a fresh child,
    which joins at birth. ``max_processes`` alone counts the tree as it is: that child
    joins the pids cgroup in place."""
    writes = recorded_moves(monkeypatch)
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.cgroups)
    handle = env.start_worker()
    slot = handle.client.supervisor.control.pool.confinement.slot(0)
    plain = env.run_until_complete(env.enqueue(zh.cgroups, {})).step.output
    if HOST.pids_v1:
        counted = env.run_until_complete(env.enqueue(zh.cgroups, {}, max_processes=256)).step.output
        assert counted["pid"] == plain["pid"] and in_slot(counted, slot.dirs, ["v2", "pids"]), (slot.dirs, counted)
        assert not in_slot(counted, slot.dirs, ["memory"])
        assert writes == [(os.path.join(slot.dirs["pids"], "cgroup.procs"), str(plain["pid"]))]
    capped = env.run_until_complete(env.enqueue(zh.cgroups, {}, memory_limit="4GiB")).step.output
    assert capped["pid"] != plain["pid"] and in_slot(capped, slot.dirs, ["v2", *V1_KEYS]), (slot.dirs, capped)
    assert not [text for _, text in writes if text == str(capped["pid"])]  # it joined at birth, itself
    assert not psutil.pid_exists(plain["pid"])  # the old child was retired and reaped
    assert handle.client.supervisor.stats["children_spawned"] == 2


@pytest.mark.skipif(not (V1_ON_DEMAND and HOST.memory_v1), reason="no hybrid host with a v1 memory hierarchy")
def test_a_spawned_child_is_replaced_before_a_memory_limit_and_its_successor_is_moved_at_its_start(
        cyclone_env_factory, monkeypatch):
    """A spawned child imports the handlers itself, outside the v1 memory cgroup it has
    not joined: before the first attempt with ``memory_limit`` it is replaced, and its
    successor is moved into the slot's v1 cgroups as it starts (before its imports)."""
    writes = recorded_moves(monkeypatch)
    env = cyclone_env_factory(worker="thread", workers=1, start_method="spawn")
    env.mux().register(zh.cgroups)
    handle = env.start_worker()
    slot = handle.client.supervisor.control.pool.confinement.slot(0)
    (first,) = wait_for(lambda: env.child_pids(), 10, "the child")
    capped = env.run_until_complete(env.enqueue(zh.cgroups, {}, memory_limit="4GiB")).step.output
    assert capped["pid"] != first and in_slot(capped, slot.dirs, ["v2", *V1_KEYS]), (slot.dirs, capped)
    assert sorted(path for path, text in writes if text == str(capped["pid"])) == sorted(
        os.path.join(slot.dirs[key], "cgroup.procs") for key in ["v2", *V1_KEYS])


@pytest.mark.skipif(not V1_ON_DEMAND, reason="not a hybrid host (caps in cgroup v1, the tree in v2)")
def test_a_child_entering_while_caps_come_into_use_is_booked_in_what_it_entered_only():
    """A forked child is given its slot's v2 cgroup only; before it says ``entered``, an
    attempt with caps elsewhere makes new children join v1 at birth. The slot books it
    in v2 only, so its first attempt with caps joins (or replaces) it: a cap written
    into a v1 cgroup it is not in would hold nothing."""
    conf = Confinement.detect("entering")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        slot = conf.slot(0)
        assert [key for key, _ in slot.entry()] == ["v2"]
        slot.enter(sleeper.pid, born_in_v2=True, by_child=True)
        conf.v1_at_birth = True  # meanwhile
        assert slot.entered(sleeper.pid, [])
        assert slot.joined == {"v2"} and slot.memory_file is None and not slot.kernel_memory_cap
        assert slot.unjoined(Limits(memory=1 << 30, processes=64)) == V1_KEYS
        assert [key for key, _ in slot.entry()] == ["v2", *V1_KEYS]  # the next child joins them at birth
    finally:
        sleeper.kill()  # our own child, by its pid
        sleeper.wait()
        conf.close()


@pytest.mark.skipif(not V1_ON_DEMAND, reason="not a hybrid host (caps in cgroup v1, the tree in v2)")
def test_a_slot_without_its_own_v2_cgroup_has_children_join_v1_at_birth(monkeypatch):
    """When a slot's v2 directory cannot be made, its v1 cgroups hold its tree: a new
    child enters them at once, caps or not (else it would be in no cgroup of its slot
    and its escaped grandchildren out of every kill's reach)."""
    conf = Confinement.detect("no-v2-slot")
    real_makedirs = os.makedirs

    def makedirs(path, *args, **kwargs):
        if str(path).startswith(conf.v2 + os.sep):
            raise PermissionError(13, "Permission denied", path)
        return real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    try:
        slot = conf.slot(0)
        assert "v2" not in slot.dirs and slot.wanted == V1_KEYS
        assert [key for key, _ in slot.entry()] == V1_KEYS
    finally:
        monkeypatch.undo()
        conf.close()


@pytest.mark.skipif(not V1_ON_DEMAND, reason="not a hybrid host (caps in cgroup v1, the tree in v2)")
def test_children_join_their_v1_cgroups_at_birth_when_the_handlers_declare_caps(cyclone_env_factory, monkeypatch):
    """A mux with a step that declares ``memory_limit`` or ``max_processes``: every child
    moves itself into its slot's v1 cgroups at birth, before any attempt (no wait on
    process control's thread when such a step starts)."""
    writes = recorded_moves(monkeypatch)
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.cgroups).register(zh.cgroups_capped)
    handle = env.start_worker()
    slot = handle.client.supervisor.control.pool.confinement.slot(0)
    out = env.run_until_complete(env.enqueue(zh.cgroups, {})).step.output  # a step without caps, first
    assert in_slot(out, slot.dirs, ["v2", *V1_KEYS]), (slot.dirs, out)
    assert env.run_until_complete(env.enqueue(zh.cgroups_capped, {})).step.output["pid"] == out["pid"]
    assert writes == []


def test_a_forked_child_holds_no_connection_no_extra_thread_and_no_password(cyclone_env_factory, monkeypatch):
    """The supervisor here is a thread of this test process, which holds database
    connections and threads; a child (and the zygote) hold only their own socket to the
    supervisor, one thread (a child: plus its cancel watcher), and no password anywhere
    in their environment (issue 18's scrubbing holds through the zygote)."""
    secret = "pw-" + secrets.token_hex(8)
    monkeypatch.setenv("CYCLONE_DSN", f"postgresql://someone:{secret}@db.invalid/app")
    monkeypatch.setenv("PGPASSWORD", secret)
    monkeypatch.setenv("APP_DB", f"host=db.invalid password={secret}")
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.holdings)
    env.start_worker()
    out = env.run_until_complete(env.enqueue(zh.holdings, {})).step.output
    assert [s["family"] for s in out["sockets"]] == [int(socket.AF_UNIX)], out["sockets"]  # its control socket only
    assert out["threads"] == 2  # the runner and its cancel watcher
    assert secret not in json.dumps(out)
    assert not {"CYCLONE_DSN", "PGPASSWORD", "APP_DB"} & set(out["environ"])
    (zygote,) = env.zygote_pids()
    assert len(os.listdir(f"/proc/{zygote}/task")) == 1  # single-threaded when it forks
    with open(f"/proc/{zygote}/environ", "rb") as fh:
        assert secret.encode() not in fh.read()
    zsockets = [fd for fd in os.listdir(f"/proc/{zygote}/fd") if os.readlink(f"/proc/{zygote}/fd/{fd}").startswith("socket:")]
    assert len(zsockets) == 1  # its socket to the supervisor, no connection


def test_the_zygote_dies_and_the_supervisor_goes_on_then_dies_with_everything(cyclone_env_factory, tmp_path):
    """SIGKILL the zygote while a child runs a step: the child and its step go on, a new
    zygote starts, a killed child is replaced from it, steps complete. Then the
    supervisor is SIGKILLed: the new zygote and every child (forked before and after the
    zygote's death) die within about a second (SPEC 1)."""
    env = cyclone_env_factory(worker="process", workers=2, lease_ttl=2.0)
    env.mux().register(zh.block)
    env.mux().register(zh.whoami)
    pids_file = tmp_path / "pids"
    env.start_worker()
    long_run = env.enqueue(zh.block, {"pids": str(pids_file), "seconds": 300})
    env.wait_for_state(long_run, None, "running")
    runner = int(wait_for(lambda: pids_file.exists() and pids_file.read_text().split(), 10, "the step's pid")[0])
    (old_zygote,) = wait_for(env.zygote_pids, 10, "a zygote")
    os.kill(old_zygote, signal.SIGKILL)
    new_zygote = wait_for(lambda: [z for z in env.zygote_pids() if z != old_zygote], 10, "a new zygote")[0]
    assert alive(runner) and env.status(long_run).step.state == "running"
    idle = wait_for(lambda: [p for p in env.child_pids() if p != runner], 10, "the idle child")[0]
    os.kill(idle, signal.SIGKILL)
    replacement = wait_for(lambda: [p for p in env.child_pids() if p not in (runner, idle)], 10, "a replacement")[0]
    assert psutil.Process(replacement).ppid() == env.workers[-1].pid
    out = env.run_until_complete(env.enqueue(zh.whoami, {}), timeout=20).step.output
    assert out["pid"] not in (runner, idle) and out["ppid"] == env.workers[-1].pid  # a child made since (another may have come and gone)
    assert alive(runner) and env.status(long_run).step.state == "running"
    everything = [runner, replacement, new_zygote]
    env.crash_worker()
    deadline = time.monotonic() + 1.5
    while any(alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in everything if alive(p)], "a child or the zygote outlived the SIGKILLed supervisor"


def test_a_sigkilled_supervisor_takes_its_forked_children_and_their_trees_within_a_second(
        cyclone_env_factory, tmp_path):
    """Two children forked from the zygote run steps that started grandchildren (one in
    the child's group, one in a session of its own); the supervisor is SIGKILLed: the
    children, the grandchildren and the zygote are gone within about a second."""
    env = cyclone_env_factory(worker="process", workers=2, lease_ttl=2.0)
    env.mux().register(h.spawner)
    files = [tmp_path / f"pids-{i}" for i in range(2)]
    env.start_worker()
    for f in files:
        env.enqueue(h.spawner, {"pids": str(f)})
    pids = [int(p) for f in files for p in wait_for(lambda f=f: f.exists() and f.read_text().endswith("\n")
                                                     and f.read_text().split(), 20, "the step's pids")]
    zygotes = env.zygote_pids()
    assert len(zygotes) == 1
    env.crash_worker()
    everything = pids + zygotes
    deadline = time.monotonic() + 1.5
    while any(alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in everything if alive(p)], "outlived the SIGKILLed supervisor"


def test_a_module_that_starts_a_thread_at_import_is_imported_after_the_fork(cyclone_env_factory, monkeypatch,
                                                                           tmp_path, caplog):
    """A zygote that a module leaves with a thread cannot fork safely (a lock the thread
    holds would stay held in every child): the module is left to the children, which
    import it after the fork, and the zygote runs single-threaded without it."""
    counter = tmp_path / "imports"
    monkeypatch.setenv("ZYGOTE_IMPORTS", str(counter))
    monkeypatch.setenv("ZYGOTE_THREAD_AT_IMPORT", "1")
    caplog.set_level(logging.WARNING, logger="cyclone_mp.supervisor")
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.holdings)
    handle = env.start_worker()
    out = env.run_until_complete(env.enqueue(zh.holdings, {})).step.output
    assert out["threads"] == 3  # the runner, its cancel watcher and the module's own thread
    (zygote,) = env.zygote_pids()
    assert len(os.listdir(f"/proc/{zygote}/task")) == 1
    assert out["pid"] in imports(counter)  # the child imported it itself
    assert zygote not in imports(counter)  # the running zygote did not (the first one did, and stopped)
    assert handle.client.supervisor.stats["children_forked"] >= 1
    assert any("cannot be imported before the fork" in r.getMessage() for r in caplog.records)


def test_a_zygote_that_keeps_dying_is_given_up_and_children_are_spawned(cyclone_env_factory, caplog):
    """Three deaths of the zygote within a minute: the supervisor says so once and spawns
    its children as with ``start_method="spawn"``; steps run on."""
    caplog.set_level(logging.WARNING, logger="cyclone_mp.supervisor")
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.whoami)
    handle = env.start_worker()
    seen = set()
    for _ in range(3):
        zygote = wait_for(lambda: [z for z in env.zygote_pids() if z not in seen], 10, "a zygote")[0]
        seen.add(zygote)
        os.kill(zygote, signal.SIGKILL)
    wait_for(lambda: any("from now on" in r.getMessage() for r in caplog.records), 10, "the warning")
    assert env.zygote_pids() == []
    stats = handle.client.supervisor.stats
    forked = stats["children_forked"]
    (child,) = env.child_pids()
    os.kill(child, signal.SIGKILL)
    # its replacement first: a step handed to the dying child would fail (max_attempts=1)
    wait_for(lambda: [p for p in env.child_pids() if p != child], 20, "a spawned replacement")
    out = env.run_until_complete(env.enqueue(zh.whoami, {}), timeout=20).step.output
    assert out["pid"] != child and out["ppid"] == os.getpid()
    assert stats["children_forked"] == forked and stats["children_spawned"] >= 2
    assert env.zygote_pids() == []


def test_a_zygote_killed_while_it_imports_counts_toward_giving_it_up(cyclone_env_factory, monkeypatch, caplog):
    """Every death of the zygote counts toward the three a minute, whatever it was doing:
    one killed while it imports a handlers' module (which that module is then left out
    of, as a possible culprit) too. It once did not, and a zygote killed at the wrong
    moments was never given up."""
    monkeypatch.setenv("ZYGOTE_SLOW_IMPORT", "1")  # each zygote spends 1 s importing zygote_handlers
    caplog.set_level(logging.WARNING, logger="cyclone_mp.supervisor")
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(zh.whoami)
    handle = env.start_worker()  # (waits for the first zygote's imports)
    pool = handle.client.supervisor.control.pool
    seen = set()
    for n in range(3):
        zygote = wait_for(lambda: [z for z in env.zygote_pids() if z not in seen], 10, "a zygote")[0]
        seen.add(zygote)
        if n == 1:  # the second one while it imports
            wait_for(lambda: pool.zygote.pid == zygote and pool.zygote.preloading is not None, 10, "its import")
        os.kill(zygote, signal.SIGKILL)
    wait_for(lambda: any("from now on" in r.getMessage() for r in caplog.records), 10, "the warning")
    assert any("while importing zygote_handlers" in r.getMessage() for r in caplog.records)
    assert env.zygote_pids() == []


def test_start_method_is_checked():
    with pytest.raises(cy.ConfigurationError, match="start_method"):
        cy.Client("postgresql://localhost/x", start_method="fork")
    assert cy.Client("postgresql://localhost/x", start_method="spawn").config.start_method == "spawn"
    assert cy.Client("postgresql://localhost/x").config.start_method == "zygote"
