"""What a console needs besides the App, and the request dependencies that read it."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import HTTPException, Request

from durably.app import App


@dataclass(frozen=True)
class ServerSettings:
    api_token: str | None
    """Bearer token for mutating requests; None: the server only listens on 127.0.0.1."""
    webhook_secrets: tuple[str, ...]
    """Standard Webhooks secrets (several during a rotation); empty: webhooks refused."""


def durably_app(request: Request) -> App:
    app: App = request.app.state.durably
    return app


def settings(request: Request) -> ServerSettings:
    value: ServerSettings = request.app.state.settings
    return value


def require_token(request: Request) -> None:
    """Dependency of every mutating endpoint: ``Authorization: Bearer <token>``.

    Without a configured token the server is bound to 127.0.0.1 (see ``durably serve``)
    and local callers are trusted — but never a browser page of another origin.
    """
    token = settings(request).api_token
    if token is not None:
        _check_bearer(request, token)
    # Cross-site requests: a page elsewhere can make the operator's browser POST a "simple"
    # request (a form, text/plain) to a local console without a preflight. Browsers always
    # send Origin on such requests, so a foreign Origin is refused; and a body must be JSON.
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
        raise HTTPException(status_code=403, detail=f"cross-origin request from {origin} refused")
    has_body = request.headers.get("content-length", "0") not in ("", "0")
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if has_body and content_type != "application/json":
        raise HTTPException(status_code=415, detail="send the request body as application/json")


def _check_bearer(request: Request, token: str) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send Authorization: Bearer $DURABLY_API_TOKEN",
            headers={"WWW-Authenticate": "Bearer"},
        )
