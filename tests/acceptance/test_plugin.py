"""A user's project gets the fixtures by installing cyclone_mp: no conftest code (issue 4)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_user_project_uses_cyclone_env_without_conftest(tmp_path, cyclone_server):
    project = tmp_path / "userproj"
    project.mkdir()
    (project / "mysteps.py").write_text(textwrap.dedent('''
        import os
        import time
        import cyclone_mp as cy

        @cy.step("double", timeout=5)
        def double(ctx, inp):
            return {"value": inp["value"] * 2}

        @cy.step("slow_once", max_attempts=3)
        def slow_once(ctx, inp):
            time.sleep(1.0)
            return {"attempt": ctx.attempt}
    '''))
    (project / "test_mysteps.py").write_text(textwrap.dedent('''
        from mysteps import double, slow_once

        def test_double(cyclone_env):
            run_id = cyclone_env.enqueue(double, {"value": 21})
            run = cyclone_env.run_until_complete(run_id)
            assert run.state == "completed" and run.step.output == {"value": 42}

        def test_survives_a_crash(cyclone_env_factory):
            env = cyclone_env_factory(lease_ttl=0.5)
            run_id = env.enqueue(slow_once, {})
            env.start_worker()
            env.wait_for_state(run_id, None, "running")
            env.crash_worker()
            handle = env.start_worker()
            run = env.run_until_complete(run_id)
            assert run.state == "completed" and run.step.reclaims == 1 and run.step.attempt == 1
    '''))
    env = {**os.environ, "CYCLONE_TEST_DSN": cyclone_server.admin_dsn, "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project)],
        cwd=project, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout
