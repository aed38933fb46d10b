"""Running durably itself: ``worker`` processes, the schema (``migrate``), the console
(``serve``) and the ``demo``."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from pathlib import Path

import click

from durably.app import App
from durably.cli.base import Config, cli, pass_config, run_coro


@cli.command()
@click.option("--until-idle", is_flag=True, help="Exit once no run is runnable now.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Runs executed at the same time.",
)
@click.option(
    "--lease-ttl",
    type=click.FloatRange(min=0, min_open=True),
    envvar="DURABLY_LEASE_TTL",
    metavar="SECONDS",
    help="Lease length; a dead worker's runs are recovered after it "
    "(env: DURABLY_LEASE_TTL; default: the app's lease_ttl).",
)
@pass_config
def worker(config: Config, until_idle: bool, concurrency: int, lease_ttl: float | None) -> None:
    """Execute runnable runs. Runs until SIGINT/SIGTERM, or until idle with --until-idle;
    several workers may share one database."""
    app = config.app()
    ttl = app.lease_ttl if lease_ttl is None else timedelta(seconds=lease_ttl)
    w = app.worker(concurrency=concurrency, lease_ttl=ttl)
    executed = run_coro(app, lambda: w.run_async(until_idle=until_idle))
    click.echo(f"durably worker {w.worker_id}: executed {executed} run(s)", err=True)


@cli.command()
@pass_config
def migrate(config: Config) -> None:
    """Apply pending schema migrations. The database is --db, else the app's; --app is
    optional."""
    from durably.store import open_store

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
        click.echo(f"{url}: applied migration(s) {', '.join(map(str, applied))}")
    else:
        click.echo(f"{url}: schema up to date, nothing to apply")


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port."
)
@pass_config
def serve(config: Config, host: str, port: int) -> None:
    """Serve the console: JSON API (/api, OpenAPI at /docs), signed webhooks
    (/webhooks/events), web UI (/) and Prometheus metrics (/metrics).

    Mutating requests need `Authorization: Bearer $DURABLY_API_TOKEN`; without a token the
    server listens on 127.0.0.1 only. Webhooks are verified with the comma-separated
    secrets in $DURABLY_WEBHOOK_SECRETS (several during a rotation)."""
    import uvicorn

    from durably.server import create_server

    token = os.environ.get("DURABLY_API_TOKEN") or None
    secrets = [
        s.strip() for s in os.environ.get("DURABLY_WEBHOOK_SECRETS", "").split(",") if s.strip()
    ]
    if token is None and host not in _LOOPBACK:
        raise click.UsageError(
            f"refusing to listen on {host} without an API token: anyone who can reach it could "
            "approve, resolve and cancel runs. Set $DURABLY_API_TOKEN, or omit --host: without "
            "a token durably serve listens on 127.0.0.1 only"
        )
    app = config.app()
    if token is None:
        click.echo(
            "durably serve: no $DURABLY_API_TOKEN, so listening on 127.0.0.1 only "
            "(local callers may change runs)",
            err=True,
        )
    if not secrets:
        click.echo(
            "durably serve: no $DURABLY_WEBHOOK_SECRETS; /webhooks/events answers 503", err=True
        )
    server = create_server(app, api_token=token, webhook_secrets=secrets)
    uvicorn.run(server, host=host, port=port)


@cli.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the demo keeps its database and files (default: a temporary directory).",
)
@click.pass_context
def demo(ctx: click.Context, workdir: Path | None) -> None:
    """Run the demo. A crash-and-recover scenario against the bundled example shop."""
    from durably.examples.demo import run_demo

    ctx.exit(run_demo(workdir=workdir))
