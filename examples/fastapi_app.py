"""A FastAPI app that enqueues in its request's transaction and awaits the result (issue 24).

``POST /thumbnails`` records an upload in the app's own table and enqueues the
``thumbnail`` step **in the same transaction** (``AsyncClient.enqueue(..., conn=conn)``):
either both exist or neither does. Once committed, the request awaits the run's result
(``await client.result(run_id, timeout=...)``: woken by LISTEN/NOTIFY, no polling loop)
and answers with it, or with ``202`` and the run id when the step takes longer.

Run it from the repository root. It needs FastAPI and uvicorn (``pip install fastapi
uvicorn``) and uses the PostgreSQL in ``CYCLONE_DSN``, or else the embedded default
server that ``cyclone-mp demo`` uses (started if it is not running)::

    pip install fastapi uvicorn
    cyclone-mp migrate
    cyclone-mp worker examples.fastapi_app:mux          # the supervisor, in one terminal
    uvicorn examples.fastapi_app:app                     # the web app, in another
    curl -X POST localhost:8000/thumbnails -H 'content-type: application/json' -d '{"path": "cat.png"}'

``tests/acceptance/test_examples.py`` runs it under Starlette's test client with a real supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import cyclone_mp as cy
from cyclone_mp.embedded import ensure_default_dsn


@cy.step("thumbnail", timeout=30, max_attempts=3)
async def thumbnail(ctx: cy.Context, inp: dict) -> dict:
    """An ``async def`` step: runs on its child's event loop; a cancel cancels it."""
    await asyncio.sleep(inp.get("seconds", 0))
    return {"thumbnail": f"{inp['path']}.thumb.png", "size": inp.get("size", 128)}


mux = cy.Mux().register(thumbnail)


class ThumbnailRequest(BaseModel):
    path: str
    size: int = 128
    seconds: float = 0.0  # how long the step takes (to see the 202 answer)
    reject: bool = False  # fail the request after the enqueue: its transaction rolls back


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    dsn = os.environ.get("CYCLONE_DSN") or ensure_default_dsn()  # as the CLI does
    async with AsyncConnectionPool(dsn, open=False) as pool, cy.AsyncClient(dsn, mux) as client:
        async with pool.connection() as conn:
            await conn.execute("CREATE TABLE IF NOT EXISTS example_uploads (path text PRIMARY KEY, run_id uuid)")
        app.state.pool, app.state.client = pool, client
        yield


app = FastAPI(lifespan=lifespan)


@app.post("/thumbnails")
async def create_thumbnail(request: ThumbnailRequest) -> Any:
    client: cy.AsyncClient = app.state.client
    async with app.state.pool.connection() as conn, conn.transaction():
        run_id = await client.enqueue(thumbnail, {"path": request.path, "size": request.size,
                                                   "seconds": request.seconds}, conn=conn)
        await conn.execute("INSERT INTO example_uploads (path, run_id) VALUES (%s, %s)", (request.path, run_id))
        if request.reject:  # e.g. a check that fails after the enqueue: nothing of it is kept
            raise HTTPException(422, "rejected: the upload and its run were rolled back")
    # Committed: a worker can claim the run now.
    try:
        output = await client.result(run_id, timeout=5)
    except cy.WaitTimeout:
        return JSONResponse({"run_id": run_id, "state": "running"}, status_code=202)
    except cy.RunFailed as exc:
        raise HTTPException(502, str(exc)) from None
    return {"run_id": run_id, **output}


@app.get("/thumbnails/{run_id}")
async def thumbnail_status(run_id: str) -> Any:
    try:
        status = await app.state.client.status(run_id)
    except cy.RunNotFound:
        raise HTTPException(404, "no such run") from None
    return {"run_id": status.id, "state": status.state, "output": status.step.output}
