"""Serving the dashboard: the bind check and the uvicorn server (``cyclone-mp dashboard``)."""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn
import socket
from typing import Any, Callable

from ..errors import ConfigurationError, CycloneError
from .app import create_app
from .params import REFRESH_SECONDS
from .security import check_token, is_loopback

log = logging.getLogger("cyclone_mp.dashboard")


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback address without a strong token, and with any
    token that cannot protect it (:func:`~cyclone_mp.dashboard.security.check_token`).

    Raises:
        ConfigurationError: ``host`` is not loopback and ``token`` is missing or weak,
            or ``token`` is blank.
    """
    check_token(token, public=not is_loopback(host))
    if not token and not is_loopback(host):
        raise ConfigurationError(
            f"refusing to serve the dashboard on {host} without a token: anyone who can reach it could cancel "
            "runs; pass --token (or set CYCLONE_DASHBOARD_TOKEN), or bind to 127.0.0.1"
        )


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port).

    Raises:
        CycloneError: the address cannot be bound (in use, not local, unknown name).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CycloneError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    # proto must be IPPROTO_TCP (as getaddrinfo says), not 0: asyncio sets TCP_NODELAY on
    # accepted connections only then, and without it every keep-alive response waits
    # ~40 ms for a delayed ACK (Nagle between the header and the body writes).
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise CycloneError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port/`` of a listening socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def serve(client: Any, *, host: str = "127.0.0.1", port: int = 8777, token: str | None = None,
          on_ready: Callable[[str], None] | None = None, log_level: str = "warning",
          refresh: float | None = None) -> None:
    """Serve the dashboard until SIGINT/SIGTERM (blocking), then return (``on_ready`` is
    called with the URL once a signal would stop it cleanly).

    A signal stops it gracefully whenever it comes: this function's own handler (set
    before ``on_ready``) asks the server to exit, so a Ctrl-C during the server's start
    is not lost or turned into a cancelled event loop, and one after it (uvicorn's
    handler, which gives the signal back to ours when it is done) ends the same way.
    ``refresh``: seconds between a page's refreshes from its API (0: none; None: 2).

    Raises:
        ConfigurationError: non-loopback ``host`` without ``token``. CycloneError: the port cannot be bound.
    """
    check_bind(host, token)
    sock = listen(host, port)
    app = create_app(client, token=token, refresh=REFRESH_SECONDS if refresh is None else refresh)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, server_header=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def stop(signum: int, frame: Any) -> None:
        server.should_exit = True

    own = threading.current_thread() is threading.main_thread()  # (signals are the main thread's)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)} if own else {}
    try:
        if on_ready is not None:
            on_ready(url_of(sock))
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
