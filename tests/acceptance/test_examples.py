"""The FastAPI and Django examples of issue 24 (acceptance 6), each with a real supervisor:
a request enqueues in its own transaction and answers with the run's result; a request
that fails after its enqueue leaves neither its row nor its run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cyclone_mp.store import connect


def count(dsn: str, sql: str) -> int:
    with connect(dsn) as conn:
        return conn.execute(sql).fetchone()["n"]


def test_fastapi_example(cyclone_env, monkeypatch):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from examples import fastapi_app

    monkeypatch.setenv("CYCLONE_DSN", cyclone_env.dsn)
    cyclone_env.mux().register(fastapi_app.thumbnail)
    cyclone_env.start_worker()
    with TestClient(fastapi_app.app) as http:
        answer = http.post("/thumbnails", json={"path": "cat.png", "size": 64})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["thumbnail"], body["size"]) == ("cat.png.thumb.png", 64)
        assert http.get(f"/thumbnails/{body['run_id']}").json()["state"] == "completed"

        rejected = http.post("/thumbnails", json={"path": "dog.png", "reject": True})
        assert rejected.status_code == 422
        slow = http.post("/thumbnails", json={"path": "slow.png", "seconds": 8})
        assert slow.status_code == 202 and slow.json()["state"] == "running"
    assert count(cyclone_env.dsn, "SELECT count(*) AS n FROM example_uploads") == 2  # cat and slow, not dog
    assert count(cyclone_env.dsn, "SELECT count(*) AS n FROM cyclone_runs") == 2  # the rejected run rolled back
    assert count(cyclone_env.dsn, "SELECT count(*) AS n FROM example_uploads u JOIN cyclone_runs r ON r.id = u.run_id") == 2
    cyclone_env.crash_worker()  # the slow step's 8 s need not be drained: what it shows was seen


def test_django_example(cyclone_env, tmp_path):
    """In a process of its own: Django's settings are made once per process."""
    pytest.importorskip("django")
    from examples import django_app

    cyclone_env.mux().register(django_app.report)
    cyclone_env.start_worker()
    script = tmp_path / "django_requests.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = {[p for p in sys.path if p]!r}
        from examples import django_app
        django_app.configure({cyclone_env.dsn!r})
        from django.test import Client
        http = Client()
        ok = http.post("/reports/", {{"name": "sales"}})
        rejected = http.post("/reports/", {{"name": "costs", "reject": "1"}})
        print(json.dumps({{"ok": [ok.status_code, ok.json()], "rejected": rejected.status_code}}))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    status, body = out["ok"]
    assert status == 200 and (body["report"], body["pages"]) == ("sales.pdf", 5)
    assert out["rejected"] == 422
    assert count(cyclone_env.dsn, "SELECT count(*) AS n FROM example_reports") == 1
    assert count(cyclone_env.dsn, "SELECT count(*) AS n FROM cyclone_runs") == 1
