"""Running durably itself: ``worker`` processes, the schema (``migrate``), the console
(``serve``) and the ``demo``."""

from __future__ import annotations

import asyncio
import math
import os
from datetime import timedelta
from pathlib import Path

import click

from durably.app import App
from durably.cli.base import Config, cli, pass_config, run_coro
from durably.cli.render import echo
from durably.server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    MAX_READ_TIMEOUT,
)

MAX_CONCURRENCY = 1000
"""Runs one worker process executes at once, at most; beyond, run more processes."""

MAX_LEASE_TTL_S = 86400.0
"""The longest lease, a day: a dead worker's runs wait that long before recovery."""

MAX_RECHECK_S = 30 * 86400.0
"""A month: a longer recheck interval means none; say --no-recheck."""


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    # FloatRange lets NaN through: it compares false with both bounds.
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds")
    return value


@cli.command()
@click.option("--until-idle", is_flag=True, help="Exit once no run is runnable now.")
@click.option(
    "--concurrency",
    type=click.IntRange(1, MAX_CONCURRENCY),
    default=1,
    show_default=True,
    help="Runs executed at the same time.",
)
@click.option(
    "--lease-ttl",
    type=click.FloatRange(min=0, max=MAX_LEASE_TTL_S, min_open=True),
    callback=_finite,
    envvar="DURABLY_LEASE_TTL",
    metavar="SECONDS",
    help="Lease length; a dead worker's runs are recovered after it "
    "(env: DURABLY_LEASE_TTL; default: the app's lease_ttl).",
)
@click.option(
    "--recheck-paused",
    type=click.FloatRange(min=0, max=MAX_RECHECK_S),
    callback=_finite,
    default=600,
    show_default=True,
    metavar="SECONDS",
    help="Queue again a run paused effect_state_unknown at a tool that can reconcile once it "
    "has been paused this long, so the service is asked again (0: at once).",
)
@click.option("--no-recheck", is_flag=True, help="Leave every paused run to a person (no recheck).")
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    envvar="DURABLY_METRICS_PORT",
    help="Serve this worker's Prometheus metrics at http://HOST:PORT/metrics while it runs "
    "(env: DURABLY_METRICS_PORT; default: not served).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics listen on (0.0.0.0 for a Prometheus on another machine: they "
    "show counts and tool names, no run data, and have no token).",
)
@pass_config
def worker(
    config: Config,
    until_idle: bool,
    concurrency: int,
    lease_ttl: float | None,
    recheck_paused: float,
    no_recheck: bool,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Execute runnable runs. Runs until SIGINT/SIGTERM, or until idle with --until-idle;
    several workers may share one database. With --metrics-port each worker process is a
    Prometheus scrape target of its own."""
    app = config.app()
    ttl = app.lease_ttl if lease_ttl is None else timedelta(seconds=lease_ttl)
    recheck = None if no_recheck else timedelta(seconds=recheck_paused)
    w = app.worker(
        concurrency=concurrency,
        lease_ttl=ttl,
        recheck_paused=recheck,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
    )

    async def work() -> int:
        running = asyncio.ensure_future(w.run_async(until_idle=until_idle))
        # Said once it is true: bound (the port it got, if 0 was asked), not before a failure.
        while metrics_port is not None and w.metrics_url is None and not running.done():
            await asyncio.sleep(0.01)
        if w.metrics_url is not None:
            echo(f"durably worker {w.worker_id}: metrics at {w.metrics_url}", err=True)
        return await running

    executed = run_coro(app, work)
    echo(f"durably worker {w.worker_id}: executed {executed} run(s)", err=True)


@cli.command()
@pass_config
def migrate(config: Config) -> None:
    """Apply pending schema migrations. The database is --db, else the app's; --app is
    optional."""
    from durably.store import open_store
    from durably.store.base import shown_url

    # Works without --app: operators migrate before any app code is deployed.
    url = config.app().database_url if config.app_spec else App(config.db).database_url

    async def apply() -> list[int]:
        # App.open() discards which versions it applied, so the store is opened directly.
        store = open_store(url)
        try:
            return await store.migrate()
        finally:
            await store.close()

    applied = asyncio.run(apply())
    if applied:
        echo(f"{shown_url(url)}: applied migration(s) {', '.join(map(str, applied))}")
    else:
        echo(f"{shown_url(url)}: schema up to date, nothing to apply")


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_WILDCARD = frozenset({"0.0.0.0", "::", ""})


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port."
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A Host name clients use to reach the console (repeatable; also the comma-separated "
    "$DURABLY_ALLOWED_HOSTS). Always allowed: the --host address, localhost, 127.0.0.1, ::1; "
    "any other Host is refused (DNS rebinding).",
)
@click.option(
    "--public-read",
    is_flag=True,
    help="With $DURABLY_API_TOKEN: let anyone who can connect read runs, inputs and results "
    "without the token (by default the token guards reads too).",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    help="Largest request body accepted (413 beyond; refused before it is read).",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0, max=MAX_READ_TIMEOUT, min_open=True),
    callback=_finite,
    default=DEFAULT_READ_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="Time a client has to send its request headers, and then its body.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    help="Connections served at once; requests beyond get 503.",
)
@pass_config
def serve(
    config: Config,
    host: str,
    port: int,
    allowed_hosts: tuple[str, ...],
    public_read: bool,
    max_body_bytes: int,
    read_timeout: float,
    max_connections: int,
) -> None:
    """Serve the console: JSON API (/api, OpenAPI at /openapi.json), signed webhooks
    (/webhooks/events), web UI (/) and Prometheus metrics (/metrics).

    With $DURABLY_API_TOKEN every request but /api/health needs `Authorization: Bearer
    $DURABLY_API_TOKEN` (reads too, unless --public-read); without a token the server listens
    on loopback only and local callers may read and act. Webhooks are verified with the
    comma-separated secrets in $DURABLY_WEBHOOK_SECRETS (several during a rotation; each at
    least 24 bytes)."""
    from durably.server import create_server
    from durably.server.listener import serve as listen

    token = os.environ.get("DURABLY_API_TOKEN") or None
    secrets = _split(os.environ.get("DURABLY_WEBHOOK_SECRETS", ""))
    if token is None and host not in _LOOPBACK:
        raise click.UsageError(
            f"refusing to listen on {host} without an API token: anyone who can reach it could "
            "read and approve, resolve and cancel runs. Set $DURABLY_API_TOKEN, or omit --host: "
            "without a token durably serve listens on 127.0.0.1 only"
        )
    names = [*allowed_hosts, *_split(os.environ.get("DURABLY_ALLOWED_HOSTS", ""))]
    if host not in _WILDCARD:
        names.append(host)
    app = config.app()
    server = create_server(
        app,
        api_token=token,
        webhook_secrets=secrets,
        allowed_hosts=names,
        public_read=public_read,
        max_body_bytes=max_body_bytes,
        read_timeout=read_timeout,
    )
    served = server.state.settings
    echo(f"durably serve: {served.scope_label}", err=True)
    echo(
        "durably serve: answering to Host "
        + ", ".join(sorted(served.allowed_hosts))
        + " (add names with --allowed-host)",
        err=True,
    )
    if not secrets:
        echo("durably serve: no $DURABLY_WEBHOOK_SECRETS; /webhooks/events answers 503", err=True)
    listen(server, host=host, port=port, max_connections=max_connections)


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


@cli.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the demo keeps its database and files (default: a temporary directory).",
)
@click.pass_context
def demo(ctx: click.Context, workdir: Path | None) -> None:
    """Run the demo. A crash-and-recover scenario against the bundled example shop."""
    from durably.demo.walkthrough import run_demo

    ctx.exit(run_demo(workdir=workdir))
