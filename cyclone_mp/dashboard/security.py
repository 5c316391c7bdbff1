"""Who may talk to the dashboard: the token, the Host guard, CSRF, and response headers.

* **Token.** With a token every request (pages, API, static files) needs it: an
  ``Authorization: Bearer <token>`` header, or the cookie that ``?token=<token>`` sets
  (a page opened that way is redirected to the same URL without the token). Anything
  else gets 401.
* **Host guard.** Without a token the dashboard is bound to loopback, and it also
  refuses requests whose ``Host`` is not a loopback name, so a web page cannot reach it
  through DNS rebinding.
* **CSRF** (double submit): a random per-browser token lives in a cookie; every form
  carries it in a hidden field, every API ``POST`` in an ``X-CSRF-Token`` header, and
  both must match. A request authenticated by a Bearer header is exempt (a browser
  never adds that header on its own). A ``POST`` whose ``Origin`` is another site is
  refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import secrets
from collections import Counter
from html import escape
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection, Request

from ..errors import ConfigurationError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

AUTH_COOKIE = "cyclone_dashboard"
CSRF_COOKIE = "cyclone_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
LOOPBACK_NAMES = ("localhost",)
HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",  # "no-referrer" would make browsers send "Origin: null" on POST
}


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ``::1`` (a host name other than localhost is
    not trusted to be loopback)."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: A token for a dashboard bound beyond loopback: at least this many characters...
MIN_TOKEN_LENGTH = 16
#: ...and at least this many bits by :func:`token_bits` (``secrets.token_urlsafe(32)``
#: has about 200, 16 random letters and digits 50 or more; "passwordpassword" 44).
MIN_TOKEN_BITS = 48
TOKEN_ADVICE = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def token_bits(token: str) -> float:
    """An estimate of a token's entropy in bits: its length times the Shannon entropy of
    its own characters (repeats and small alphabets score low: ``"a" * 40`` is 0), capped
    by the length times log2 of the alphabet its character classes span."""
    if not token:
        return 0.0
    n = len(token)
    shannon = -sum(c / n * math.log2(c / n) for c in Counter(token).values())
    classes = [any(ch.islower() for ch in token) * 26, any(ch.isupper() for ch in token) * 26,
               any(ch.isdigit() for ch in token) * 10, any(not ch.isalnum() for ch in token) * 33]
    return n * min(max(shannon, 0.0), math.log2(max(2, sum(classes))))


def check_token(token: str | None, public: bool) -> None:
    """Refuse a token that cannot protect the dashboard.

    Every token: not empty or white space only, and without white space at either end
    (a Bearer header is stripped, so such a token could only ever match ``?token=``).
    A ``public`` bind (not loopback): at least :data:`MIN_TOKEN_LENGTH` characters and
    :data:`MIN_TOKEN_BITS` bits by :func:`token_bits`.

    Raises:
        ConfigurationError: saying which rule, never the token.
    """
    if token is None:
        return
    if not token.strip():
        raise ConfigurationError("the dashboard token is empty or only white space; " + TOKEN_ADVICE)
    if token != token.strip():
        raise ConfigurationError("the dashboard token starts or ends with white space; " + TOKEN_ADVICE)
    if not token.isprintable():
        raise ConfigurationError("the dashboard token holds control characters; " + TOKEN_ADVICE)
    if not public:
        return
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"the dashboard token is {len(token)} characters; a dashboard bound beyond loopback needs at least "
            f"{MIN_TOKEN_LENGTH}; " + TOKEN_ADVICE)
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise ConfigurationError(
            f"the dashboard token is too easy to guess (about {bits:.0f} bits; a dashboard bound beyond loopback "
            f"needs {MIN_TOKEN_BITS}); " + TOKEN_ADVICE)


def _host_name(host_header: str) -> str:
    """``Host`` header without its port (``[::1]:8777`` -> ``::1``)."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def cookie_value(token: str) -> str:
    """What the auth cookie holds: a digest of the token, not the token itself."""
    return hmac.new(token.encode(), b"cyclone-mp dashboard session", hashlib.sha256).hexdigest()


def wants_json(path: str, accept: str = "") -> bool:
    """API paths, and requests that ask for JSON, get JSON errors."""
    return path.startswith("/api/") or path == "/api" or "application/json" in accept


class Guard:
    """ASGI middleware: the Host guard (``allowed_hosts`` None: off), the token (None: off),
    and the security headers of every response."""

    def __init__(self, app: ASGIApp, *, token: str | None, allowed_hosts: Iterable[str] | None) -> None:
        self.app = app
        self.token = token or None
        self.cookie = cookie_value(self.token) if self.token else None
        self.allowed = {h.lower() for h in allowed_hosts} if allowed_hosts is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        send = _with_headers(send, HEADERS)
        path = scope.get("path", "")
        json_errors = wants_json(path, conn.headers.get("accept", ""))
        if self.allowed is not None:
            host = _host_name(conn.headers.get("host", "")).lower()
            if not (is_loopback(host) or host in self.allowed):
                await _error(send, 400, json_errors, "bad_host",
                             f"Host {host or '(none)'!r} is not allowed: without a token this dashboard answers "
                             "only to loopback names (127.0.0.1, localhost, [::1])")
                return
        state = scope.setdefault("state", {})
        state["bearer"] = False
        if self.token is not None:
            how = self._authenticate(conn)
            if how is None:
                await _error(send, 401, json_errors, "unauthorized",
                             "this dashboard needs its token: send 'Authorization: Bearer <token>' or open it "
                             "once with ?token=<token>", {"www-authenticate": 'Bearer realm="cyclone-mp"'})
                return
            state["bearer"] = how == "bearer"
            if how == "query":
                set_cookie = _cookie_header(AUTH_COOKIE, self.cookie or "", same_site="Lax")
                if scope["method"] in ("GET", "HEAD") and not json_errors:
                    # Keep the token out of the address bar, the history and any Referer.
                    rest = [(k, v) for k, v in parse_qsl(conn.url.query, keep_blank_values=True) if k != "token"]
                    target = path + (f"?{urlencode(rest)}" if rest else "")
                    await send({"type": "http.response.start", "status": 303, "headers": [
                        (b"location", target.encode()), (b"set-cookie", set_cookie.encode()),
                        (b"content-length", b"0")]})
                    await send({"type": "http.response.body", "body": b""})
                    return
                send = _with_headers(send, {"set-cookie": set_cookie})
        await self.app(scope, receive, send)

    def _authenticate(self, conn: HTTPConnection) -> str | None:
        assert self.token is not None and self.cookie is not None
        auth = conn.headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode()):
            return "bearer"
        query = conn.query_params.get("token")
        if query is not None and hmac.compare_digest(query.encode(), self.token.encode()):
            return "query"
        cookie = conn.cookies.get(AUTH_COOKIE)
        if cookie is not None and hmac.compare_digest(cookie.encode(), self.cookie.encode()):
            return "cookie"
        return None


def _with_headers(send: Send, headers: dict[str, str]) -> Send:
    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            mutable = MutableHeaders(scope=message)
            for key, value in headers.items():
                if key == "set-cookie":
                    mutable.append(key, value)
                elif key not in mutable:
                    mutable[key] = value
        await send(message)

    return wrapped


async def _error(send: Send, status: int, as_json: bool, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
    if as_json:
        body = json.dumps({"error": code, "message": message}).encode()
        ctype = b"application/json"
    else:
        body = (f"<!doctype html><meta charset=utf-8><title>{status}</title>"
                f"<h1>{status}</h1><p>{escape(message)}</p>").encode()
        ctype = b"text/html; charset=utf-8"
    raw = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _cookie_header(name: str, value: str, *, same_site: str = "Strict", max_age: int | None = None) -> str:
    parts = [f"{name}={value}", "Path=/", "HttpOnly", f"SameSite={same_site}"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    return "; ".join(parts)


# -- CSRF -----------------------------------------------------------------------------------------


def csrf_token(request: Request) -> tuple[str, bool]:
    """This browser's CSRF token and whether it is new (then the response must set it)."""
    current = request.cookies.get(CSRF_COOKIE)
    if current and 20 <= len(current) <= 100 and current.replace("-", "").replace("_", "").isalnum():
        return current, False
    return secrets.token_urlsafe(32), True


def csrf_cookie(token: str) -> str:
    """The ``Set-Cookie`` value that stores a new CSRF token."""
    return _cookie_header(CSRF_COOKIE, token, same_site="Strict")


def csrf_problem(request: Request, submitted: str | None) -> str | None:
    """Why a POST fails the CSRF check (None when it passes)."""
    origin = request.headers.get("origin")
    if origin and origin != "null":
        origin_host = origin.split("://", 1)[-1].rstrip("/").lower()
        if origin_host != request.headers.get("host", "").lower():
            return f"cross-site request refused (Origin {origin})"
    elif origin == "null":
        return "cross-site request refused (Origin null)"
    if request.scope.get("state", {}).get("bearer"):
        return None  # a Bearer header is never added by a browser on its own
    cookie = request.cookies.get(CSRF_COOKIE)
    if not cookie:
        return "missing CSRF cookie: load a dashboard page (or GET /api/csrf) first"
    if not submitted:
        return "missing CSRF token (form field csrf_token or header X-CSRF-Token)"
    if not hmac.compare_digest(cookie.encode(), submitted.encode()):
        return "CSRF token does not match the cookie"
    return None
