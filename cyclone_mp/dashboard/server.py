"""Serving the dashboard: the bind check and the uvicorn server (``cyclone-mp dashboard``)."""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable

from ..errors import ConfigurationError, CycloneError
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
          on_ready: Callable[[str], None] | None = None, log_level: str = "warning") -> None:
    """Serve the dashboard until SIGINT/SIGTERM (blocking).

    Raises:
        ConfigurationError: non-loopback ``host`` without ``token``. CycloneError: the port cannot be bound.
    """
    import uvicorn

    from .app import create_app

    check_bind(host, token)
    sock = listen(host, port)
    app = create_app(client, token=token)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, server_header=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if on_ready is not None:
        on_ready(url_of(sock))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
