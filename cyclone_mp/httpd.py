"""A small HTTP server for the supervisor's metrics (and health) that a neighbour cannot use
to take the supervisor down.

One thread and one selector serve every connection; nothing blocks on a client. At most
:data:`MAX_CONNECTIONS` connections are open at once: a new one beyond that closes the
connection that has waited longest without sending a whole request, so idle or slow
clients (thousands of them) cost at most that many descriptors and never starve a real
scrape. A client gets :data:`REQUEST_TIMEOUT` seconds to send its request line and
headers and as long to read the answer; a request is one ``GET`` (or ``HEAD``), its
headers at most :data:`MAX_REQUEST` bytes. With a token, every request must carry
``Authorization: Bearer <token>`` (compared in constant time), or gets 401.

Routes map a path to a function returning ``(status, content type, body)``; a route that
raises answers 500 and is logged, never ends the server.
"""

from __future__ import annotations

import collections
import hmac
import logging
import selectors
import socket
import threading
import time
from typing import Callable

log = logging.getLogger("cyclone_mp.supervisor")

MAX_CONNECTIONS = 32  #: connections open at once, at most (the oldest waiting one makes room)
REQUEST_TIMEOUT = 2.0  #: seconds a client has to send its request, and to read the answer
MAX_REQUEST = 8192  #: bytes of request line and headers, at most
BACKLOG = 128  #: the listen queue (connections the kernel holds until accepted)

Route = Callable[[], "tuple[int, str, bytes]"]
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _Connection:
    __slots__ = ("sock", "since", "inbox", "outbox", "answered")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.since = now  # when it was accepted, or its answer started
        self.inbox = b""
        self.outbox = b""
        self.answered = False


class BoundedServer:
    """Serve ``routes`` on ``host:port`` (port 0: any free one; see :attr:`port`) from a
    daemon thread of its own, within the bounds of the module docstring.

    Args:
        host: the address to bind (``"127.0.0.1"``: this machine only).
        port: the TCP port.
        routes: path -> function returning ``(status, content type, body)``.
        token: when set, the bearer token every request must carry.

    Raises:
        OSError: the address cannot be bound (in use, not an address of this host).
    """

    def __init__(self, host: str, port: int, routes: dict[str, Route], *, token: str | None = None) -> None:
        self.routes = dict(routes)
        self._token = token.encode() if token else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(BACKLOG)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.host, self.port = host, self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._selector.register(self._waker_r, selectors.EVENT_READ, None)
        self._connections: collections.OrderedDict[socket.socket, _Connection] = collections.OrderedDict()
        self._stopping = False
        self.served = 0  # requests answered (any status)
        self.dropped = 0  # connections closed unanswered (room made, timed out, malformed)
        self._thread = threading.Thread(target=self._run, name="cyclone-metrics-http", daemon=True)
        self._thread.start()

    # -- life -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving and close every descriptor (waits up to a second for the thread)."""
        self._stopping = True
        try:
            self._waker_w.send(b"x")
        except OSError:
            pass
        self._thread.join(1.0)

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._turn()
                except Exception:  # noqa: BLE001 - nothing a client does may end the server
                    log.exception("metrics server: unexpected error; carrying on")
                    time.sleep(0.05)
        finally:
            for conn in list(self._connections.values()):
                self._drop(conn, counted=False)
            for sock in (self._listener, self._waker_r, self._waker_w):
                sock.close()
            self._selector.close()

    def _turn(self) -> None:
        now = time.monotonic()
        oldest = next(iter(self._connections.values()), None)
        wait = 1.0 if oldest is None else max(0.0, min(1.0, oldest.since + REQUEST_TIMEOUT - now))
        for key, events in self._selector.select(wait):
            sock = key.fileobj
            if sock is self._listener:
                self._accept()
            elif sock is self._waker_r:
                try:
                    self._waker_r.recv(64)
                except OSError:
                    pass
            else:
                conn = self._connections.get(sock)  # type: ignore[call-overload]
                if conn is None:
                    continue
                if events & selectors.EVENT_READ and not conn.answered:
                    self._read(conn)
                if events & selectors.EVENT_WRITE and conn.answered and conn.sock in self._connections:
                    self._write(conn)
        deadline = time.monotonic() - REQUEST_TIMEOUT
        for conn in [c for c in self._connections.values() if c.since < deadline]:
            self._drop(conn)

    # -- connections ----------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time; the rest wait in the backlog
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: try again on the next turn
                log.debug("metrics server: accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(self._connections) >= MAX_CONNECTIONS:
                waiting = next((c for c in self._connections.values() if not c.answered), None)
                self._drop(waiting or next(iter(self._connections.values())))
            conn = _Connection(sock, time.monotonic())
            self._connections[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _drop(self, conn: _Connection, counted: bool = True) -> None:
        if self._connections.pop(conn.sock, None) is None:
            return
        self.dropped += counted and not conn.answered
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbox) > MAX_REQUEST:
                self._answer(conn, 400, "text/plain", b"request too large\n")
            return
        self._answer(conn, *self._respond(conn.inbox[:end].decode("latin-1")))

    def _respond(self, head: str) -> tuple[int, str, bytes]:
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", b"bad request\n"
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET\n"
        if self._token is not None:
            given = next((line.split(":", 1)[1].strip() for line in lines[1:]
                          if line.lower().startswith("authorization:")), "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), self._token)):
                return 401, "text/plain", b"a bearer token is required\n"
        route = self.routes.get(target.split("?", 1)[0])
        if route is None:
            return 404, "text/plain", b"not found\n"
        try:
            status, ctype, body = route()
        except Exception:  # noqa: BLE001 - one failing route answers 500
            log.exception("metrics server: %s failed", target)
            return 500, "text/plain", b"internal error\n"
        return status, ctype, b"" if method == "HEAD" else body

    def _answer(self, conn: _Connection, status: int, ctype: str, body: bytes) -> None:
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n"
                + ('WWW-Authenticate: Bearer\r\n' if status == 401 else '') + "\r\n")
        conn.outbox, conn.answered, conn.since = head.encode() + body, True, time.monotonic()
        self.served += 1
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, None)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, counted=False)
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            self._drop(conn, counted=False)
