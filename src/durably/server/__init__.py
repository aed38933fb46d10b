"""``durably serve``: the operator's console — JSON API, signed webhooks, web UI, metrics.

One ASGI application (FastAPI, served by uvicorn) over one :class:`durably.App`:

* ``/api/...`` — the JSON API (OpenAPI at ``/openapi.json``); mutating endpoints need
  ``Authorization: Bearer $DURABLY_API_TOKEN``;
* ``/webhooks/events`` — external events signed per the Standard Webhooks scheme;
* ``/`` and ``/runs/...`` — the web UI;
* ``/metrics`` — Prometheus.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from durably.app import App
from durably.server.settings import ServerSettings


def create_server(
    app: App, *, api_token: str | None = None, webhook_secrets: Sequence[str] = ()
) -> FastAPI:
    """The console's ASGI application for ``app``."""
    from durably.server import api, ui, webhooks

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await app.close_async()  # the store's connections belong to the server's loop

    server = FastAPI(
        lifespan=lifespan,
        title="durably",
        summary="Durable agent runs with exactly-once effects: runs, approvals, effects.",
        version="0.1.0",
    )
    server.state.durably = app
    server.state.settings = ServerSettings(
        api_token=api_token, webhook_secrets=tuple(webhook_secrets)
    )
    server.include_router(api.router)
    server.include_router(webhooks.router)
    server.include_router(ui.router)
    return server
