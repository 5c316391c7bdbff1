"""A fault-injecting TCP proxy between a supervisor and PostgreSQL.

``FaultProxy(upstream)`` listens on ``127.0.0.1:<port>`` and forwards every connection to
``upstream`` (a ``(host, port)`` pair, or a Unix socket's path). Between the two it injects
the faults a supervisor on another host meets: :meth:`~FaultProxy.partition` (a black hole:
nothing forwarded, new connections accepted but never answered, no RST),
:meth:`~FaultProxy.freeze` (the open connections stop answering, new ones pass: a wedged
PgBouncer or backend), :meth:`~FaultProxy.add_latency` (``seconds`` of added round trip)
and :meth:`~FaultProxy.reset` (an RST on every open connection); :meth:`~FaultProxy.heal`
ends a partition or a freeze.

The pytest plugin's ``Env(proxy=True)`` puts one proxy in front of each supervisor it
starts (``env.partition()``, ``env.add_latency(seconds)``). It runs on one daemon thread.
"""

from __future__ import annotations

import collections
import contextlib
import selectors
import socket
import struct
import threading
import time
from typing import Any


class _Link:
    """One proxied connection: the client side, the upstream side, and what is in transit."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        # (due time, bytes) per direction, in order
        self.to_upstream: collections.deque[tuple[float, bytes]] = collections.deque()
        self.to_client: collections.deque[tuple[float, bytes]] = collections.deque()
        self.frozen = False  # nothing is read or forwarded (freeze)


class FaultProxy:
    """See the module docstring.

    Args:
        upstream: ``(host, port)`` or a Unix socket path.
        listen: the address to listen on (default ``("127.0.0.1", 0)``: any free port).
    """

    def __init__(self, upstream: tuple[str, int] | str, listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.upstream = upstream
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(listen)
        self.host: str = listen[0]
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._blackhole = False
        self._delay = 0.0
        self._reset = False
        self._frozen_now: bool | None = None  # what freeze/heal asked the open links to become
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="cyclone-fault-proxy", daemon=True)
        self._thread.start()

    # -- faults -----------------------------------------------------------------------------

    def partition(self) -> None:
        """Black-hole every connection, old and new, until :meth:`heal`."""
        with self._lock:
            self._blackhole = True
        self._wake()

    def heal(self) -> None:
        """End a partition or a freeze (held connections go on; what was sent meanwhile is delivered)."""
        with self._lock:
            self._blackhole = False
            self._frozen_now = False
        self._wake()

    def freeze(self) -> None:
        """Black-hole the connections open now, until :meth:`heal`; connections opened
        later are forwarded as usual."""
        with self._lock:
            self._frozen_now = True
        self._wake()

    def add_latency(self, seconds: float) -> None:
        """Add ``seconds`` of round-trip time (half each way); 0 removes it."""
        with self._lock:
            self._delay = max(0.0, float(seconds)) / 2
        self._wake()

    def reset(self) -> None:
        """Close every open connection with an RST."""
        with self._lock:
            self._reset = True
        self._wake()

    @property
    def partitioned(self) -> bool:
        return self._blackhole

    def dsn_options(self) -> dict[str, Any]:
        """What to change in a DSN to go through this proxy: ``host`` and ``port``."""
        return {"host": self.host, "port": self.port}

    def close(self) -> None:
        """Stop the proxy and close every connection."""
        self._closed = True
        self._wake()
        self._thread.join(5)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    # -- the thread ---------------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect(self.upstream)
        sock.setblocking(False)
        return sock

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, ("accept", None))
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        while not self._closed:
            with self._lock:
                blackhole, delay, reset = self._blackhole, self._delay, self._reset
                frozen_now, self._frozen_now = self._frozen_now, None
                self._reset = False
            if reset:
                for link in list(self._links):
                    self._drop(sel, link, rst=True)
            if frozen_now is not None:
                for link in self._links:
                    link.frozen = frozen_now
            now = time.monotonic()
            if not blackhole:
                for link in list(self._links):
                    if link.frozen or link.upstream is None and not self._open(sel, link):
                        continue
                    self._flush(sel, link, now)
            self._update_interest(sel, blackhole)
            due = [q[0][0] for link in self._links if not link.frozen for q in (link.to_upstream, link.to_client) if q]
            timeout = None if blackhole or not due else max(0.0, min(due) - time.monotonic())
            for key, _ in sel.select(timeout):
                kind, link = key.data
                if kind == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif kind == "accept":
                    self._accept(sel)
                else:
                    self._read(sel, link, kind, delay)
        for link in list(self._links):
            self._drop(sel, link, rst=False)
        sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client)
            self._links.append(link)
            sel.register(client, selectors.EVENT_READ, ("client", link))

    def _open(self, sel: selectors.BaseSelector, link: _Link) -> bool:
        try:
            link.upstream = self._connect_upstream()
        except OSError:
            self._drop(sel, link, rst=True)
            return False
        sel.register(link.upstream, selectors.EVENT_READ, ("upstream", link))
        return True

    def _read(self, sel: selectors.BaseSelector, link: _Link, side: str, delay: float) -> None:
        sock = link.client if side == "client" else link.upstream
        if sock is None:
            return
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, link, rst=False)
            return
        queue = link.to_upstream if side == "client" else link.to_client
        queue.append((time.monotonic() + delay, data))

    def _flush(self, sel: selectors.BaseSelector, link: _Link, now: float) -> None:
        for queue, sock in ((link.to_upstream, link.upstream), (link.to_client, link.client)):
            while queue and queue[0][0] <= now and sock is not None:
                data = queue[0][1]
                try:
                    sent = sock.send(data)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self._drop(sel, link, rst=False)
                    return
                if sent < len(data):
                    queue[0] = (queue[0][0], data[sent:])
                    break
                queue.popleft()

    def _update_interest(self, sel: selectors.BaseSelector, blackhole: bool) -> None:
        """During a partition nothing is read (so nothing is forwarded or answered), nor
        from a frozen link."""
        for link in self._links:
            for sock, side in ((link.client, "client"), (link.upstream, "upstream")):
                if sock is None:
                    continue
                try:
                    key = sel.get_key(sock)
                except (KeyError, ValueError):
                    continue
                want = 0 if blackhole or link.frozen else selectors.EVENT_READ
                if want and key.events != want:
                    sel.modify(sock, want, (side, link))
                elif not want:
                    with contextlib.suppress(KeyError, ValueError):
                        sel.unregister(sock)
            if not blackhole and not link.frozen:
                for sock, side in ((link.client, "client"), (link.upstream, "upstream")):
                    if sock is not None and sock.fileno() >= 0:
                        try:
                            sel.get_key(sock)
                        except KeyError:
                            sel.register(sock, selectors.EVENT_READ, (side, link))

    def _drop(self, sel: selectors.BaseSelector, link: _Link, *, rst: bool) -> None:
        for sock in (link.client, link.upstream):
            if sock is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(sock)
            with contextlib.suppress(OSError):
                if rst:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
        if link in self._links:
            self._links.remove(link)
