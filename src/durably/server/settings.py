"""What a console needs besides the App: who may call it, under which names, how much."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from durably.app import App
from durably.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT, LOCAL_HOSTS


@dataclass(frozen=True)
class ServerSettings:
    api_token: str | None
    """Bearer token; None: the server only listens on loopback and local callers may act."""
    webhook_secrets: tuple[str, ...]
    """Standard Webhooks secrets (several during a rotation); empty: webhooks refused."""
    allowed_hosts: frozenset[str] = LOCAL_HOSTS
    """Host header names served; any other is refused (DNS rebinding)."""
    public_read: bool = False
    """With a token: let anyone who can connect read runs (``--public-read``)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT

    @property
    def reads_need_token(self) -> bool:
        return self.api_token is not None and not self.public_read

    @property
    def scope_label(self) -> str:
        """What the token guards, for the UI header."""
        if self.api_token is None:
            return "no token: local callers read and write"
        return "token: read+write" if self.reads_need_token else "token: write · read open"


def durably_app(request: Request) -> App:
    app: App = request.app.state.durably
    return app


def settings(request: Request) -> ServerSettings:
    value: ServerSettings = request.app.state.settings
    return value
