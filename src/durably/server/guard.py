"""The console's front door: what is decided from the request line and headers alone, before
any route runs or any byte of the body is read.

* **Host** — only configured names are served, on every route: a page on an attacker's
  domain that resolves to 127.0.0.1 (DNS rebinding) is same-origin with the console in the
  browser's eyes, but its requests carry the attacker's Host and are refused here.
* **Token** — every request that is not a read needs ``Authorization: Bearer``; reads need
  it too unless the console reads openly (no token, or ``--public-read``). Refused before the
  body is read, so an unauthenticated client cannot make the server buffer anything.
* **Cross-site** — a foreign ``Origin`` or a body that is not ``application/json`` is
  refused (a page elsewhere can make the browser send "simple" requests without a preflight).
* **Size and time** — a declared ``Content-Length`` over the limit is refused at once; a
  streamed body is cut off at the limit (413) or when it does not arrive in time (408).
* **Headers** — every response carries a CSP (no inline script, no framing), ``X-Frame-
  Options: DENY``, ``nosniff`` and ``Referrer-Policy: no-referrer``.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from urllib.parse import unquote

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from durably.server.errors import ApiError, error_response
from durably.server.settings import ServerSettings

TOKEN_COOKIE = "durably_token"
"""Where the UI keeps the token for page loads (a browser cannot add a header to those).
Accepted for reads only: a cookie rides along on cross-site requests, a header does not."""

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
_HEADER_NAMES = frozenset(name for name, _ in SECURITY_HEADERS)

_OPEN_PATHS = frozenset({"/api/health", "/openapi.json"})
_OPEN_PREFIX = "/ui/static/"
_SIGNED_PATH = "/webhooks/events"  # authenticated by its signature, not by the token
_DIGITS = re.compile(r"[0-9]{1,15}")


def host_name(header: str) -> str:
    """The name in a Host header, without port, brackets or a trailing dot, lowercased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, sep, port = header.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        header = name
    return header.rstrip(".")


class GuardedFastAPI(FastAPI):
    """FastAPI with :class:`Guard` outside everything (``state.settings`` configures it),
    so that even a 500 carries the security headers and no middleware of FastAPI's touches
    a request the guard refuses."""

    def build_middleware_stack(self) -> ASGIApp:
        return Guard(super().build_middleware_stack(), self.state.settings)


class Guard:
    """ASGI middleware around the whole console (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        if scope["method"] == "HEAD":
            # Answered as GET without its body (uptime checks probe with HEAD): the routes
            # are declared for GET alone.
            scope, send = {**scope, "method": "GET"}, _without_body(send)
        refusal = self._refusal(scope, Headers(scope=scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope: Scope, headers: Headers) -> Response | None:
        s = self.settings
        host = headers.get("host", "")
        if host_name(host) not in s.allowed_hosts:
            return error_response(
                400,
                "HostNotAllowed",
                f"this console does not answer to Host {host[:100]!a}; if clients reach "
                "it under that name, start durably serve with --allowed-host NAME (or "
                "$DURABLY_ALLOWED_HOSTS). Unknown names are refused against DNS rebinding",
            )
        path: str = scope["path"]
        if scope["method"] == "GET":
            if (
                s.reads_need_token
                and path not in _OPEN_PATHS
                and not path.startswith(_OPEN_PREFIX)
                and not self._bearer_ok(headers)
                and not self._cookie_ok(headers)
            ):
                return _unauthorized(s, path, reads=True)
        elif path != _SIGNED_PATH:
            if s.api_token is not None and not self._bearer_ok(headers):
                return _unauthorized(s, path, reads=False)
            origin = headers.get("origin")
            if origin is not None and origin.split("://", 1)[-1] != host:
                return error_response(
                    403, "CrossOrigin", f"cross-origin request from {origin[:100]!a} refused"
                )
            content_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if _has_body(headers) and content_type != "application/json":
                return error_response(
                    415, "UnsupportedMediaType", "send the request body as application/json"
                )
        declared = headers.get("content-length")
        if declared is not None and (
            not _DIGITS.fullmatch(declared) or int(declared) > s.max_body_bytes
        ):
            return error_response(413, "PayloadTooLarge", _too_large(s.max_body_bytes))
        return None

    def _bearer_ok(self, headers: Headers) -> bool:
        token = self.settings.api_token
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return (
            token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), token.encode())
        )

    def _cookie_ok(self, headers: Headers) -> bool:
        token = self.settings.api_token
        given = cookie_parser(headers.get("cookie", "")).get(TOKEN_COOKIE)
        return (
            token is not None
            and given is not None
            and hmac.compare_digest(unquote(given).encode(), token.encode())
        )

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that stops the body at the size limit or the read deadline."""
        limit, timeout = self.settings.max_body_bytes, self.settings.read_timeout
        received = 0
        deadline: float | None = None
        complete = False

        async def limited() -> Message:
            nonlocal received, deadline, complete
            if complete:  # later calls wait for a disconnect: no deadline on those
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + timeout
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise ApiError(
                    408,
                    "RequestTimeout",
                    f"the request body did not arrive within {timeout:g}s; send it at once",
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, "PayloadTooLarge", _too_large(limit))
                complete = not message.get("more_body", False)
            return message

        return limited


def _has_body(headers: Headers) -> bool:
    return headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers


def _too_large(limit: int) -> str:
    return (
        f"request body over {limit} bytes, the console's limit (durably serve "
        "--max-body-bytes); store large data elsewhere and send a reference"
    )


def _unauthorized(settings: ServerSettings, path: str, *, reads: bool) -> Response:
    what = "reading this console" if reads else "this request"
    message = (
        f"missing or wrong bearer token: {what} needs Authorization: Bearer $DURABLY_API_TOKEN"
    )
    challenge = {"WWW-Authenticate": "Bearer"}
    if reads and not (path.startswith("/api/") or path == "/metrics"):
        from durably.server.ui import token_page

        return token_page(settings, message, challenge)
    return error_response(401, "Unauthorized", message, challenge)


def _without_body(send: Send) -> Send:
    async def send_headers_only(message: Message) -> None:
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b""}
        await send(message)

    return send_headers_only


def _with_security_headers(send: Send) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [h for h in message.get("headers", []) if h[0].lower() not in _HEADER_NAMES]
            message = {**message, "headers": [*kept, *SECURITY_HEADERS]}
        await send(message)

    return send_with_headers
