"""``durably serve``: the operator's console — JSON API, signed webhooks, web UI, metrics.

One ASGI application (FastAPI, served by uvicorn) over one :class:`durably.App`:

* ``/api/...`` — the JSON API (OpenAPI at ``/openapi.json``); every request but a read needs
  ``Authorization: Bearer $DURABLY_API_TOKEN``, reads too unless ``public_read``;
* ``/webhooks/events`` — external events signed per the Standard Webhooks scheme;
* ``/`` and ``/runs/...`` — the web UI;
* ``/metrics`` — Prometheus.

Everything passes :class:`~durably.server.guard.Guard` first (Host allow-list, token, size,
security headers). ``/docs`` and ``/redoc`` are off: they load their scripts from a CDN into
the origin that holds the token; load ``/openapi.json`` into a viewer of your own instead.
The web stack is imported by :func:`create_server`, not here: the CLI imports this package.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from durably.app import App
from durably.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT, LOCAL_HOSTS

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_server(
    app: App,
    *,
    api_token: str | None = None,
    webhook_secrets: Sequence[str] = (),
    allowed_hosts: Iterable[str] = (),
    public_read: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
) -> FastAPI:
    """The console's ASGI application for ``app``.

    It answers to the Host names ``allowed_hosts`` plus localhost, 127.0.0.1 and ::1. With
    an ``api_token`` every request but ``/api/health`` needs it, unless ``public_read`` opens
    the reads. Webhook secrets under 24 bytes raise :class:`durably.ConfigurationError`.
    """
    from durably.server import api, ui, webhooks
    from durably.server.errors import install_handlers
    from durably.server.guard import GuardedFastAPI, host_name
    from durably.server.settings import ServerSettings

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await app.close_async()  # the store's connections belong to the server's loop

    server = GuardedFastAPI(
        lifespan=lifespan,
        title="durably",
        summary="Durable agent runs with exactly-once effects: runs, approvals, effects.",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
    )
    server.state.durably = app
    server.state.settings = ServerSettings(
        api_token=api_token,
        webhook_secrets=webhooks.check_secrets(webhook_secrets),
        allowed_hosts=LOCAL_HOSTS | {host_name(h) for h in allowed_hosts},
        public_read=public_read,
        max_body_bytes=max_body_bytes,
        read_timeout=read_timeout,
    )
    install_handlers(server)
    server.include_router(api.router)
    server.include_router(webhooks.router)
    server.include_router(ui.router)
    return server
