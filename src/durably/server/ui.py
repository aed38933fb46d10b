"""The web console: server-rendered pages over the App; every action goes through the JSON API.

* ``/`` — runs, newest first, filtered by status and workflow; the table refreshes itself
  (``/?partial=1`` returns just the table);
* ``/runs/{run_id}`` — one run: header, UNKNOWN-effect banner, approvals to decide, effects to
  resolve, steps, the event timeline and checkpoints.

The pages only read. Buttons call ``/api/...`` with ``fetch()`` (sending the bearer token the
operator saved in the header field) after a confirmation, and reload, so the UI needs nothing
the API doesn't offer. Where reads need the token, the page loads carry it in a cookie the
header field sets (accepted for reads only). No inline script: the CSP forbids it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from importlib import resources
from typing import Annotated, Any
from urllib.parse import quote

import jinja2
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute

from durably.app import App
from durably.errors import DurablyError, RunNotFound
from durably.server.api import clip_deep
from durably.server.errors import status_of
from durably.server.settings import ServerSettings, durably_app, settings
from durably.status import RunStatus

ATTENTION = frozenset({"waiting_approval", "waiting_external", "paused", "reconciling"})
"""Run statuses a person should look at; highlighted in the list."""

_STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}


def _time(value: float | None) -> str:
    if value is None:
        return ""
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _short(value: str | None, n: int = 12) -> str:
    if not value:
        return ""
    return value if len(value) <= n + 1 else value[:n] + "…"


def _pretty(value: Any) -> str:
    return json.dumps(clip_deep(value), indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _compact(value: Any) -> str:
    return json.dumps(clip_deep(value), sort_keys=True, ensure_ascii=False, default=str)


def _segment(value: str) -> str:
    """``value`` as one URL path segment: a ``/``, ``?`` or ``#`` in an id stays in the id."""
    return quote(value, safe="")


_env = jinja2.Environment(
    loader=jinja2.PackageLoader("durably.server", "templates"),
    autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
)
_env.filters.update(time=_time, short=_short, pretty=_pretty, compact=_compact, segment=_segment)


def _page(
    name: str,
    config: ServerSettings,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> HTMLResponse:
    html = _env.get_template(name).render(
        scope_label=config.scope_label, has_token=config.api_token is not None, **context
    )
    return HTMLResponse(html, status_code=status_code, headers=headers)


def token_page(config: ServerSettings, message: str, headers: dict[str, str]) -> HTMLResponse:
    """The 401 page of a console whose reads need the token: paste it in the header."""
    return _page(
        "error.html",
        config,
        401,
        headers,
        heading="API token needed",
        message=message + " — paste it in the header field above and press Save",
        needs_token=True,
    )


class _UIRoute(APIRoute):
    """A page route whose durably errors become an error page with the API's status."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except DurablyError as exc:
                config = settings(request)
                heading = "Run not found" if isinstance(exc, RunNotFound) else "Cannot show this"
                return _page(
                    "error.html", config, status_of(exc), heading=heading, message=str(exc)
                )

        return route


router = APIRouter(include_in_schema=False, route_class=_UIRoute)
AppDep = Annotated[App, Depends(durably_app)]
SettingsDep = Annotated[ServerSettings, Depends(settings)]


@router.get("/ui/static/{name}")
def static(name: str) -> Response:
    if name not in _STATIC:
        raise HTTPException(status_code=404)
    body = resources.files("durably.server").joinpath("static", name).read_bytes()
    return Response(body, media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})


@router.get("/", response_class=HTMLResponse)
async def runs_page(
    app: AppDep,
    config: SettingsDep,
    status: str = "",
    workflow: str = "",
    partial: bool = False,
) -> HTMLResponse:
    try:
        status_filter = RunStatus(status) if status else None
    except ValueError:
        status_filter = None
        status = ""
    runs = await app.list_runs_async(status=status_filter, workflow=workflow or None, limit=200)
    context: dict[str, Any] = {
        "runs": runs,
        "attention": ATTENTION,
        "status": status,
        "workflow": workflow,
        "statuses": [s.value for s in RunStatus],
        "workflows": sorted({w.split("|")[0] for w in app.workflows} | {r.workflow for r in runs}),
        "now": _time(datetime.now(UTC).timestamp()),
    }
    return _page("_runs_table.html" if partial else "runs.html", config, **context)


# ``path``: an old run id with a ``/`` (ids are validated now) still opens its page.
@router.get("/runs/{run_id:path}", response_class=HTMLResponse)
async def run_page(app: AppDep, config: SettingsDep, run_id: str) -> HTMLResponse:
    run = await app.describe_async(run_id)
    events = await app.events_async(run_id)
    checkpoints = await app.checkpoints_async(run_id)
    unknown = [e for e in run["effects"] if e["status"] == "unknown"]
    pending = [a for a in run["approvals"] if a["status"] == "requested"]
    return _page(
        "run.html",
        config,
        run=run,
        events=events,
        checkpoints=checkpoints[:10],
        unknown=unknown,
        pending=pending,
        now=time.time(),
        final=run["status"] in {"completed", "failed", "cancelled"},
        live=run["status"] in {"queued", "running", "reconciling"},
    )
