"""A Django view that enqueues in its request's transaction and waits for the result (issue 24).

``POST /reports/`` records a report request in the app's own table and enqueues the
``report`` step with **Django's own connection** (``client.enqueue(..., conn=connection.connection)``
inside ``transaction.atomic()``): both are written or neither is. Once committed, the
view waits for the result (``client.result(run_id, timeout=...)``, woken by
LISTEN/NOTIFY) and answers with it.

A one-file Django project (the settings are made in :func:`configure`); in a real
project the step lives in an app's ``tasks.py``, the view in ``views.py``, and the
``Client`` is made once (in ``AppConfig.ready``, say). Run it (from the repository
root, with a PostgreSQL in ``CYCLONE_DSN``; Django's PostgreSQL backend uses psycopg 3)::

    cyclone-mp migrate
    cyclone-mp worker examples.django_app:mux                      # the supervisor
    python -m examples.django_app runserver                        # the web app
    curl -X POST localhost:8000/reports/ -d 'name=sales'

``tests/acceptance/test_examples.py`` runs it with Django's test client and a real supervisor.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cyclone_mp as cy


@cy.step("report", timeout=30, max_attempts=3)
def report(ctx: cy.Context, inp: dict) -> dict:
    return {"report": f"{inp['name']}.pdf", "pages": len(inp["name"])}


mux = cy.Mux().register(report)
client: cy.Client | None = None


def configure(dsn: str) -> None:
    """Django settings for a database given as a libpq DSN, then ``django.setup()``."""
    import django
    from django.conf import settings
    from psycopg.conninfo import conninfo_to_dict

    global client
    params = conninfo_to_dict(dsn)
    settings.configure(
        DEBUG=False, SECRET_KEY="example", ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"],
        DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": params.get("dbname", ""),
            "USER": params.get("user", ""), "PASSWORD": params.get("password", ""),
            "HOST": params.get("host", ""), "PORT": params.get("port", ""),
        }},
        INSTALLED_APPS=[], MIDDLEWARE=[],
    )
    django.setup()
    client = cy.Client(dsn, mux)


def create_report(request: Any) -> Any:
    from django.db import connection, transaction
    from django.http import JsonResponse

    if request.method != "POST":
        return JsonResponse({"error": "POST a name"}, status=405)
    name = request.POST.get("name", "report")
    assert client is not None
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("CREATE TABLE IF NOT EXISTS example_reports (name text PRIMARY KEY, run_id uuid)")
                connection.ensure_connection()
                run_id = client.enqueue(report, {"name": name}, conn=connection.connection)
                cursor.execute("INSERT INTO example_reports (name, run_id) VALUES (%s, %s)", [name, run_id])
            if request.POST.get("reject"):  # a failure after the enqueue: the run is rolled back too
                raise ValueError("rejected")
    except ValueError as exc:
        return JsonResponse({"error": str(exc)}, status=422)
    try:
        output = client.result(run_id, timeout=5)  # committed: a worker can claim it now
    except cy.WaitTimeout:
        return JsonResponse({"run_id": run_id, "state": "running"}, status=202)
    return JsonResponse({"run_id": run_id, **output})


def _urls() -> list[Any]:
    from django.urls import path

    return [path("reports/", create_report)]


def __getattr__(name: str) -> Any:
    if name == "urlpatterns":  # Django reads it once its settings name this module
        return _urls()
    raise AttributeError(name)


if __name__ == "__main__":
    configure(os.environ["CYCLONE_DSN"])
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
