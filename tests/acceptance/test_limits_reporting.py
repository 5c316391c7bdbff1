"""How a cause of death reaches people: the poison quarantine's discard names the
repeated cause; ``cyclone-mp workers`` and ``status`` (and their ``--json``) show the
mechanism and the cause; the dashboard's recent kills list causes of death."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cyclone_mp.limits.declared import MIB

import limit_handlers as lh
from limits_support import HOST

pytestmark = pytest.mark.usefixtures("no_cgroup_left_behind")


# -- poison quarantine ----------------------------------------------------------------------------------------------


def test_the_poison_quarantine_names_the_cause_in_the_discard(cyclone_env_factory, tmp_path):
    """A step whose attempts keep dying of the same cause is discarded with that cause:
    "killed 3 times: memory_limit 64 MiB, peak 64 MiB": no log needed."""
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    single = env.enqueue(lh.hog_retried, {"total": 512 * MIB, "chunk": 16 * MIB, "log": str(tmp_path / "a")},
                         memory_limit="64MiB")
    flow = env.enqueue(lh.poison_flow, {"total": 512 * MIB, "chunk": 16 * MIB, "log": str(tmp_path / "b")}, memory_limit="64MiB")
    for run_id in (single, flow):
        step = env.run_until_complete(run_id, timeout=60).step
        assert [e["kind"] for e in step.errors] == ["memory_limit"] * 3
        assert step.error.startswith("killed 3 times: memory_limit 64 MiB, peak "), step.error
        assert step.errors[-1]["message"] != step.error  # the attempt's own message is kept in its entry


# -- what operators see ---------------------------------------------------------------------------------------------


def test_workers_status_and_json_show_the_mechanism_and_the_cause(cyclone_env_factory, tmp_path):
    from click.testing import CliRunner

    from cyclone_mp_cli.main import cli

    env = cyclone_env_factory(workers=1, lease_ttl=2)
    run_id = env.enqueue(lh.hog, {"total": 512 * MIB, "chunk": 16 * MIB, "log": str(tmp_path / "log")},
                         memory_limit="64MiB")
    env.run_until_complete(run_id, timeout=60)
    runner = CliRunner()
    out = runner.invoke(cli, ["--dsn", env.dsn, "workers", "--wide"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    mech = HOST.mechanism
    assert f"limits: memory {mech.memory} · processes {mech.processes}" in out.output
    assert f"OOM evidence {mech.oom}" in out.output
    rows = json.loads(runner.invoke(cli, ["--dsn", env.dsn, "workers", "--json"]).output)
    assert rows[0]["info"]["limits"]["memory"] == mech.memory and rows[0]["info"]["limits"]["oom"] == mech.oom
    out = runner.invoke(cli, ["--dsn", env.dsn, "status", run_id, "--wide"], env={"COLUMNS": "250"})
    assert "memory_limit" in out.output and "limits of lim_hog: memory 64 MiB" in out.output
    # a kernel cap holds the tree at 64 MiB exactly; sampling sees it somewhere past the cap
    kernel_cap = mech.memory in ("cgroup v1", "cgroup v2")
    assert "tree" in out.output and ("peak 64 MiB" if kernel_cap else "peak ") in out.output
    data = json.loads(runner.invoke(cli, ["--dsn", env.dsn, "status", run_id, "--json"]).output)
    entry = data["steps"]["lim_hog"]["errors"][-1]
    assert data["steps"]["lim_hog"]["error_kind"] == "memory_limit" and entry["tree"]["peak_memory_kb"] > 0
    app = str(Path(__file__).resolve().parents[1] / "support" / "cli_app.py") + ":mux"
    out = runner.invoke(cli, ["--dsn", env.dsn, "enqueue", app, "echo", "--memory-limit", "64M", "--cpu-limit", "2.5",
                              "--max-processes", "5", "--max-open-files", "30", "--json"])
    assert out.exit_code == 0, out.output
    step = env.status(json.loads(out.output)["run_id"]).step
    assert (step.memory_limit, step.cpu_limit, step.max_processes, step.max_open_files) == (64 * MIB, 2.5, 5, 30)
    out = runner.invoke(cli, ["--dsn", env.dsn, "enqueue", app, "echo", "--memory-limit", "1K"])
    assert out.exit_code == 2 and "memory_limit must be from 1 MiB" in out.output, out.output


def test_the_dashboards_recent_kills_list_causes_of_death(cyclone_env_factory, tmp_path):
    """The dashboard's "recent kills" query (and its index, migration 0013) include the
    causes of death."""
    env = cyclone_env_factory(workers=1, lease_ttl=2)
    run_id = env.enqueue(lh.hog, {"total": 512 * MIB, "chunk": 16 * MIB, "log": str(tmp_path / "log")},
                         memory_limit="64MiB")
    env.run_until_complete(run_id, timeout=60)
    from cyclone_mp.dashboard_queries import DashboardReads
    from cyclone_mp.store import Store

    store = Store.open(env.dsn)
    try:
        kills = DashboardReads(store).recent_kills(10)
    finally:
        store.close()
    assert [k["entry"]["kind"] for k in kills] == ["memory_limit"]
