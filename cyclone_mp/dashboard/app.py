"""The dashboard's ASGI app: pages (Jinja2), the JSON API under ``/api/``, static assets.

``create_app(client, token=None)`` builds it. Pages and API render the same dicts
from :class:`~cyclone_mp.dashboard.views.Dashboard`; every page names the API URL
behind it (``data-api``), which its script fetches to refresh itself. Operator actions
are ``POST`` only, CSRF-checked, confirmed on a page of their own and reported with a
flash message. Malformed parameters are 400, unknown runs 404, a run in the wrong state
for an action 409, an unreachable database 503; never a 500 for bad input.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.schemas import SchemaGenerator
from starlette.staticfiles import StaticFiles

from ..errors import (ConfigurationError, CycloneError, DatabaseError, InvalidTransition, PayloadError,
                      RunNotFound)
from . import params as P
from .charts import chart
from .security import CSRF_FIELD, CSRF_HEADER, Guard, csrf_cookie, csrf_problem, csrf_token, wants_json
from .views import Dashboard, parse_payload

log = logging.getLogger("cyclone_mp.dashboard")

HERE = Path(__file__).resolve().parent
FLASH_COOKIE = "cyclone_flash"
MAX_BODY = 256 * 1024
SCHEMA = SchemaGenerator({
    "openapi": "3.0.3",
    "info": {
        "title": "cyclone-mp dashboard API",
        "version": "1",
        "description": (
            "The JSON behind every dashboard page. Times are ISO 8601 in UTC, read from the database "
            "clock. Errors are {\"error\": code, \"message\": text}: 400 malformed parameter, 401 missing "
            "token, 403 CSRF, 404 unknown run, 409 action not allowed in the run's state, 503 database "
            "unavailable. POST needs 'Authorization: Bearer <token>', or the X-CSRF-Token header equal to "
            "the cyclone_csrf cookie (GET /api/csrf returns both)."
        ),
    },
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
})


def create_app(client: Any, token: str | None = None, *, allowed_hosts: list[str] | None = None,
               refresh: float = P.REFRESH_SECONDS) -> Starlette:
    """The dashboard app over ``client`` (a :class:`cyclone_mp.Client`).

    Args:
        client: where runs are read and actions applied (its pool; no supervisor needed).
        token: when set, every request needs it (header, or the cookie ``?token=`` sets).
        allowed_hosts: without a token, Host names accepted besides loopback ones.
        refresh: seconds between a page's refreshes (0: no auto-refresh).
    """
    board = Dashboard(client)
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(when=_when, secs=_secs, mib=_mib, kib=_kib, pct=_pct, tojson_pretty=_pretty, short=_short)
    env.globals.update(step_states=P.STEP_STATES, run_states=P.RUN_STATES, chart=chart, urlencode=urlencode)

    def page(request: Request, template: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
        csrf, new = csrf_token(request)
        flash = _read_flash(request)
        html = env.get_template(template).render(
            request=request, csrf=csrf, flash=flash, refresh=refresh, **context,
        )
        response = HTMLResponse(html, status_code=status, headers={"cache-control": "no-store"})
        if new:
            response.headers.append("set-cookie", csrf_cookie(csrf))
        if flash is not None:
            response.delete_cookie(FLASH_COOKIE, path="/")
        return response

    async def read(fn: Callable[..., Any], *args: Any) -> Any:
        return await run_in_threadpool(fn, *args)

    # -- pages -----------------------------------------------------------------------------------

    async def overview_page(request: Request) -> Response:
        minutes = P.integer(request.query_params, "minutes", default=30, lo=1, hi=P.MAX_MINUTES)
        data = await read(board.overview, minutes)
        return page(request, "overview.html", {
            "page": "overview", "api": f"/api/overview?minutes={minutes}", "data": data, "minutes": minutes,
        })

    async def runs_page(request: Request) -> Response:
        query = P.RunQuery.parse(request.query_params)
        data = await read(board.runs, query)
        api = "/api/runs" + (f"?{urlencode(query.params())}" if query.params() else "")
        return page(request, "runs.html", {"page": "runs", "api": api, "data": data, "query": query})

    async def run_page(request: Request) -> Response:
        run_id = P.run_id(request.path_params["run_id"])
        data = await read(board.run, run_id)
        return page(request, "run.html", {"page": "run", "api": f"/api/runs/{run_id}", "data": data})

    async def action_page(request: Request) -> Response:
        run_id = P.run_id(request.path_params["run_id"])
        action = P.action(request.path_params["action"])
        if request.method == "GET":  # the confirm step
            data = await read(board.run, run_id)
            return page(request, "confirm.html", {"page": "confirm", "api": "", "data": data, "action": action})
        form = await _form(request)
        problem = csrf_problem(request, form.get(CSRF_FIELD))
        if problem:
            raise _Forbidden(problem)
        if form.get("confirmed") != "yes":
            return RedirectResponse(f"/runs/{run_id}/{action}", status_code=303)
        target = f"/runs/{run_id}"
        try:
            payload = parse_payload(form.get("payload")) if action == "signal" else None
            result = await read(board.act, run_id, action, (form.get("name") or "").strip() or None, payload)
            flash = {"kind": "ok", "text": result["message"]}
        except RunNotFound:
            raise  # no run page to go back to: a 404 page
        except CycloneError as exc:  # refused transition, bad payload, database error: reported
            flash = {"kind": "error", "text": f"{action} failed: {exc}"}
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(FLASH_COOKIE, _encode_flash(flash), max_age=60, path="/", httponly=True,
                            samesite="strict")
        return response

    # -- API -------------------------------------------------------------------------------------

    async def api_overview(request: Request) -> Response:
        """
        ---
        summary: Overview counts, throughput, live supervisors and recent kills
        description: >
          runs.by_state and steps.by_state count every row of the hot tables; archived.by_state
          counts the archived runs (exact up to 10,000 per state, estimated past that: archived.exact
          says which); steps.by_name splits the steps by step
          name (signal and timer nodes as "(signal)"/"(timer)") and queue; throughput.per_minute
          counts task steps finished per minute (finished_at, DB clock) over the last `minutes`;
          workers are supervisors seen in the last 15 s with their children (pid, step, elapsed s,
          cpu_percent, rss bytes), the maintenance tasks each reports failing (failing: [{task,
          failures, error, for}]) and the age of the last successful sweep (last_sweep_age, s); kills are steps whose latest error entry is a timeout, a child
          exit or a reclaim limit, with the entry's forensics.
        parameters:
          - {name: minutes, in: query, required: false, schema: {type: integer, minimum: 1, maximum: 1440, default: 30}}
        responses:
          200: {description: "{now, runs, archived, steps, throughput, workers, kills}"}
          400: {description: malformed parameter}
        """
        minutes = P.integer(request.query_params, "minutes", default=30, lo=1, hi=P.MAX_MINUTES)
        return _json(await read(board.overview, minutes))

    async def api_runs(request: Request) -> Response:
        """
        ---
        summary: A page of runs, newest first
        description: >
          Filters combine. `name` is the run's name (the step name of a single-step run, the
          workflow name otherwise). `since`/`until` bound created_at (ISO 8601; no offset means
          UTC). Page with `offset`, or with `cursor` = the `next_cursor` of the previous page
          (keyset: cheap at any depth). `total` counts matching runs up to 10,000
          (`total_capped` is then true).
        parameters:
          - {name: state, in: query, schema: {type: string, enum: [running, paused, completed, discarded, cancelled]}}
          - {name: name, in: query, schema: {type: string, maxLength: 200}}
          - {name: since, in: query, schema: {type: string, format: date-time}}
          - {name: until, in: query, schema: {type: string, format: date-time}}
          - {name: cursor, in: query, schema: {type: string}}
          - {name: limit, in: query, schema: {type: integer, minimum: 1, maximum: 500, default: 50}}
          - {name: offset, in: query, schema: {type: integer, minimum: 0, maximum: 1000000, default: 0}}
        responses:
          200: {description: "{now, filters, limit, offset, cursor, total, total_capped, next_cursor, runs, names}"}
          400: {description: malformed parameter}
        """
        return _json(await read(board.runs, P.RunQuery.parse(request.query_params)))

    async def api_run(request: Request) -> Response:
        """
        ---
        summary: One run
        description: >
          The run, its steps (state, attempt, reclaims, DB-clock timestamps, lease, progress,
          output, last error), every attempt with its forensics (exit code or signal,
          killed_by_supervisor, trigger, cpu_seconds, peak_rss_kb, elapsed) and traceback, the
          step graph layout, the signals received, and which actions apply now.
        parameters:
          - {name: run_id, in: path, required: true, schema: {type: string, format: uuid}}
        responses:
          200: {description: "{now, id, name, kind, state, input, created_at, updated_at, finished_at, steps, attempts, outputs, outputs_note, graph, signals, signal_names, actions}"}
          400: {description: malformed run id}
          404: {description: no such run}
        """
        run_id = P.run_id(request.path_params["run_id"])
        return _json(await read(board.run, run_id))

    async def api_action(request: Request) -> Response:
        """
        ---
        summary: Cancel, retry, pause, resume or signal a run
        description: >
          cancel: the run and its unfinished steps, in one transaction (a running handler is
          cancelled at its next heartbeat, killed after kill_grace). retry: reopen discarded steps.
          pause/resume. signal: JSON body {"name": ..., "payload": ...}; the first signal of a
          name is kept (kept=false for a repeat). Needs the Bearer token or the X-CSRF-Token header.
        parameters:
          - {name: run_id, in: path, required: true, schema: {type: string, format: uuid}}
          - {name: action, in: path, required: true, schema: {type: string, enum: [cancel, retry, pause, resume, signal]}}
        requestBody:
          required: false
          content:
            application/json:
              schema: {type: object, properties: {name: {type: string}, payload: {}}}
        responses:
          200: {description: "{action, run_id, message, count | name, kept}"}
          400: {description: malformed run id, action or body}
          403: {description: CSRF check failed}
          404: {description: no such run}
          409: {description: the run's state does not allow this action}
        """
        run_id = P.run_id(request.path_params["run_id"])
        action = P.action(request.path_params["action"])
        problem = csrf_problem(request, request.headers.get(CSRF_HEADER))
        if problem:
            raise _Forbidden(problem)
        body = await _json_body(request)
        name = body.get("name") if isinstance(body, dict) else None
        if name is not None and not isinstance(name, str):
            raise P.BadRequest("name must be a string")
        payload = body.get("payload") if isinstance(body, dict) else None
        return _json({"ok": True, **await read(board.act, run_id, action, name, payload)})

    async def api_csrf(request: Request) -> Response:
        """
        ---
        summary: This client's CSRF token (also set as the cyclone_csrf cookie)
        responses:
          200: {description: "{csrf_token, header}"}
        """
        csrf, new = csrf_token(request)
        response = _json({"csrf_token": csrf, "header": "X-CSRF-Token"})
        if new:
            response.headers.append("set-cookie", csrf_cookie(csrf))
        return response

    async def openapi(request: Request) -> Response:
        return _json(SCHEMA.get_schema(routes=app.routes))

    # -- errors ----------------------------------------------------------------------------------

    def error(request: Request, status: int, code: str, message: str) -> Response:
        if wants_json(request.url.path, request.headers.get("accept", "")):
            return JSONResponse({"error": code, "message": message}, status_code=status,
                                headers={"cache-control": "no-store"})
        return page(request, "error.html", {"page": "error", "api": "", "status": status, "message": message},
                    status=status)

    async def on_bad_request(request: Request, exc: Exception) -> Response:
        return error(request, 400, "bad_request", str(exc))

    async def on_not_found(request: Request, exc: Exception) -> Response:
        return error(request, 404, "not_found", str(exc))

    async def on_conflict(request: Request, exc: Exception) -> Response:
        return error(request, 409, "conflict", str(exc))

    async def on_forbidden(request: Request, exc: Exception) -> Response:
        return error(request, 403, "forbidden", str(exc))

    async def on_database(request: Request, exc: Exception) -> Response:
        log.warning("database error: %s", exc)
        return error(request, 503, "database_unavailable", str(exc))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        messages = {404: "no such page", 405: "method not allowed"}
        return error(request, exc.status_code, {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error"),
                     messages.get(exc.status_code, str(exc.detail)))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error serving %s", request.url.path)
        return error(request, 500, "internal_error", f"unexpected {type(exc).__name__}; see the dashboard's log")

    routes = [
        Route("/", overview_page, include_in_schema=False),
        Route("/runs", runs_page, include_in_schema=False),
        Route("/runs/{run_id}", run_page, include_in_schema=False),
        Route("/runs/{run_id}/{action}", action_page, methods=["GET", "POST"], include_in_schema=False),
        Route("/api/overview", api_overview),
        Route("/api/runs", api_runs),
        Route("/api/runs/{run_id}", api_run),
        Route("/api/runs/{run_id}/{action}", api_action, methods=["POST"]),
        Route("/api/csrf", api_csrf),
        Route("/api/openapi.json", openapi, include_in_schema=False),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={
        P.BadRequest: on_bad_request, PayloadError: on_bad_request, ConfigurationError: on_bad_request,
        RunNotFound: on_not_found, InvalidTransition: on_conflict, _Forbidden: on_forbidden,
        DatabaseError: on_database, HTTPException: on_http, Exception: on_unexpected,
    })
    # Without a token: loopback Host names only (plus allowed_hosts); with one: any Host.
    app.add_middleware(Guard, token=token, allowed_hosts=list(allowed_hosts or []) if not token else None)
    app.state.dashboard = board
    return app


class _Forbidden(CycloneError):
    """The request failed the CSRF check."""


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers={"cache-control": "no-store"})


async def _body(request: Request) -> bytes:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY:
        raise P.BadRequest(f"request body over {MAX_BODY} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise P.BadRequest(f"request body over {MAX_BODY} bytes")
    return body


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the only kind the pages send)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise P.BadRequest("the form must be sent as application/x-www-form-urlencoded")
    try:
        return dict(parse_qsl((await _body(request)).decode(), keep_blank_values=True))
    except UnicodeDecodeError:
        raise P.BadRequest("the form is not UTF-8") from None


async def _json_body(request: Request) -> Any:
    raw = await _body(request)
    if not raw.strip():
        return {}
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise P.BadRequest("the body must be application/json")
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise P.BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise P.BadRequest("the body must be a JSON object")
    return value


def _encode_flash(flash: dict[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(flash).encode()).decode().rstrip("=")


def _read_flash(request: Request) -> dict[str, str] | None:
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("kind") not in ("ok", "error"):
        return None
    return {"kind": value["kind"], "text": str(value.get("text", ""))[:2000]}


# -- template filters ------------------------------------------------------------------------------


def _parse(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value
    if isinstance(value, str) and value:
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    return None


def _when(value: Any) -> str:
    """UTC ``YYYY-MM-DD HH:MM:SS.mmm`` (what the page's script also prints)."""
    parsed = _parse(value)
    if parsed is None:
        return "-"
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _secs(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}s"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{float(value) / 1024 / 1024:.1f} MiB"


def _kib(value: Any) -> str:
    return "-" if value is None else f"{float(value) / 1024:.1f} MiB"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0f}%"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _short(value: Any, limit: int = 80) -> str:
    if value is None:
        return ""
    flat = " ".join(str(value).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
