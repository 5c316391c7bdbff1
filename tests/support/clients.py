"""Both clients behind one interface, so a behavioural test runs once with each (issue 24).

``SyncOverAsync`` wraps a :class:`cyclone_mp.AsyncClient` so that calling it looks like
calling a :class:`cyclone_mp.Client`: each method's coroutine runs on an event loop of
the facade's own (a thread), and the test waits for its result. The ``api_env`` fixture
(conftest.py) gives a test an Env whose every client call (``env.enqueue``,
``env.client().cancel``, ``env.status``, ``env.run_until_complete``...) goes through
one client or the other.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import cyclone_mp as cy


class SyncOverAsync:
    """An AsyncClient called like a Client."""

    def __init__(self, client: cy.AsyncClient) -> None:
        self.async_client = client
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="async-client-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.async_client, name)
        if not callable(attr) or not asyncio.iscoroutinefunction(attr):
            return attr

        def method(*args: Any, **kwargs: Any) -> Any:
            return self.call(attr(*args, **kwargs))

        return method

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self.async_client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def use_async_client(env: Any) -> SyncOverAsync:
    """Route every client call of ``env`` through an AsyncClient on its database and mux."""
    options = {k: v for k, v in env.options.items() if k not in ("registry_interval",)}
    facade = SyncOverAsync(cy.AsyncClient(env.dsn, env.mux(), **options))
    env._client.close()
    env._client = facade
    return facade
