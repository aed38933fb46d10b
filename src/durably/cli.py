"""The ``durably`` command line: start runs, run workers, inspect runs, decide their
approvals, send them events, cancel them and settle them by hand.

The app comes from ``--app module:attr`` (or ``$DURABLY_APP``), the database from ``--db``
(or ``$DURABLY_DATABASE_URL``), else the app's own URL. ``--json`` output is JSON on stdout
only, so scripts can pipe it; every durably error is one ``error: ...`` line and exit code 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import click

from durably.app import App, Run
from durably.errors import DurablyError
from durably.status import RunStatus
from durably.store.base import Approval

T = TypeVar("T")
Outcome = Literal["succeeded", "not_executed", "failed"]
Decision = Literal["approved", "rejected"]


class _Failure(click.ClickException):
    """A durably error, shown as ``error: <message>`` (the message already says what to do)."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DurablyError as exc:
            raise _Failure(str(exc)) from exc


def _parse_json(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}): {value!r}") from exc


class _Config:
    """The global options; the app is imported only by the commands that need it."""

    def __init__(self, app_spec: str | None, db: str | None) -> None:
        self.app_spec = app_spec
        self.db = db
        self._app: App | None = None

    def app(self) -> App:
        if self._app is None:
            if not self.app_spec:
                raise click.UsageError("no app given: pass --app module:attr or set $DURABLY_APP")
            self._app = load_app(self.app_spec)
            if self.db:
                self._app.database_url = self.db
        return self._app


def load_app(spec: str) -> App:
    """Import ``module:attr`` and check that it names a :class:`durably.App`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise click.UsageError(f"--app {spec!r} must look like module:attr (e.g. myagent:app)")
    # The console script does not put the working directory on sys.path (python -m does);
    # without it `--app myagent:app` would not find ./myagent.py.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise click.UsageError(
            f"--app {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        found = "nothing" if app is None else f"a {type(app).__name__}"
        raise click.UsageError(
            f"--app {spec!r}: {module_name}.{attr} is {found}, not a durably.App instance"
        )
    return app


def _run(app: App, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run one command's coroutine in one event loop, and close the store in that loop."""

    async def main() -> T:
        try:
            return await make()
        finally:
            await app.close_async()

    return asyncio.run(main())


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _span(seconds: float) -> str:
    """``2d 3h``, ``5h 12m``, ``4m 10s``, ``9s``: a duration for people, two units at most."""
    s = int(seconds)
    days, hours, minutes = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s % 60}s"
    return f"{s}s"


def _expiry(ts: float) -> str:
    """The absolute time and how far off it is, judged by this machine's clock."""
    left = ts - time.time()
    return f"{_time(ts)} ({'in ' + _span(left) if left > 0 else 'passed'})"


def _run_json(run: Run) -> dict[str, Any]:
    return {**dataclasses.asdict(run), "status": run.status.value}


def _table(headers: list[str], rows: list[list[Any]], empty: str = "(none)") -> None:
    if not rows:
        click.echo(empty)
        return
    rows = [["-" if cell is None else str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _error_text(error: dict[str, Any] | None) -> str:
    if not error:
        return "-"
    return f"{error.get('type', 'Error')}: {error.get('message', '')}"


def _labelled(label: str, value: str) -> None:
    click.echo(f"{label:<10} {value}")


def _approval_subject(approval: Approval) -> tuple[str, str]:
    """What was approved: a tool call as ``tool(arg=value, ...)``, or a plan's payload."""
    payload = approval.payload
    if approval.kind == "tool" and isinstance(payload, dict):
        arguments = payload.get("arguments")
        if isinstance(arguments, dict):
            shown = ", ".join(
                f"{name}={json.dumps(value, ensure_ascii=False)}"
                for name, value in arguments.items()
            )
            return "tool call", f"{payload.get('tool', approval.name)}({shown})"
    return "plan", f"{approval.name}: {json.dumps(payload, ensure_ascii=False)}"


def _echo_decision(approval: Approval, as_json: bool) -> None:
    if as_json:
        _echo_json(dataclasses.asdict(approval))
        return
    _labelled(
        approval.status,
        f"approval {approval.approval_id} of run {approval.run_id}, step {approval.step_id}",
    )
    _labelled(*_approval_subject(approval))
    _labelled("expires", _expiry(approval.expires_at))
    by = approval.decided_by or "-"
    _labelled("by", f"{by}: {approval.comment}" if approval.comment else by)
    if approval.status == "approved":
        nxt = "a worker continues the run; the approved call may run once, before it expires"
    else:
        nxt = "a worker continues the run; the workflow sees ApprovalRejected"
    _labelled("next", f"{nxt} (`durably worker`, or `durably resume {approval.run_id}`)")


def _echo_run(run: Run, as_json: bool) -> None:
    if as_json:
        _echo_json(_run_json(run))
        return
    shown = run.status_reason and run.status_reason != run.status.value
    reason = f" ({run.status_reason})" if shown else ""
    click.echo(f"{run.run_id}: {run.status.value}{reason}")
    if run.status is RunStatus.COMPLETED:
        click.echo(f"result: {json.dumps(run.result, ensure_ascii=False)}")
    elif run.error:
        click.echo(f"error: {_error_text(run.error)}")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--app",
    "app_spec",
    envvar="DURABLY_APP",
    metavar="MOD:ATTR",
    help="The durably.App to use, as module:attribute (env: DURABLY_APP).",
)
@click.option(
    "--db",
    envvar="DURABLY_DATABASE_URL",
    metavar="URL",
    help="Database URL, overriding the app's (env: DURABLY_DATABASE_URL).",
)
@click.pass_context
def cli(ctx: click.Context, app_spec: str | None, db: str | None) -> None:
    """durably: durable execution for AI agents whose tools have real side effects."""
    ctx.obj = _Config(app_spec, db)


pass_config = click.make_pass_decorator(_Config)


@cli.command()
@click.argument("workflow")
@click.option(
    "--input",
    "input_",
    callback=_parse_json,
    metavar="JSON",
    help="The workflow's input as JSON: an object gives keyword arguments, an array "
    "positional arguments, any other value one positional argument.",
)
@click.option("--run-id", help="Run id; starting the same id again returns the existing run.")
@click.option("--tenant", default="default", show_default=True, help="Tenant of the run.")
@pass_config
def start(config: _Config, workflow: str, input_: Any, run_id: str | None, tenant: str) -> None:
    """Queue a run of WORKFLOW for a worker and print its run id."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if isinstance(input_, dict):
        kwargs = input_
    elif isinstance(input_, list):
        args = input_
    elif input_ is not None:
        args = [input_]
    app = config.app()
    rid = _run(
        app, lambda: app.start_async(workflow, *args, run_id=run_id, tenant=tenant, **kwargs)
    )
    click.echo(rid)


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
def worker(config: _Config, until_idle: bool, concurrency: int, lease_ttl: float | None) -> None:
    """Execute runnable runs. Runs until SIGINT/SIGTERM, or until idle with --until-idle;
    several workers may share one database."""
    app = config.app()
    ttl = app.lease_ttl if lease_ttl is None else timedelta(seconds=lease_ttl)
    w = app.worker(concurrency=concurrency, lease_ttl=ttl)
    executed = _run(app, lambda: w.run_async(until_idle=until_idle))
    click.echo(f"durably worker {w.worker_id}: executed {executed} run(s)", err=True)


@cli.group()
def runs() -> None:
    """Inspect runs."""


@runs.command("list")
@click.option(
    "--status", type=click.Choice([s.value for s in RunStatus]), help="Only runs in this status."
)
@click.option("--workflow", help="Only runs of this workflow.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of runs.")
@pass_config
def list_runs(
    config: _Config, status: str | None, workflow: str | None, limit: int, as_json: bool
) -> None:
    """List runs, newest first."""
    app = config.app()
    wanted = RunStatus(status) if status else None
    found = _run(app, lambda: app.list_runs_async(status=wanted, workflow=workflow, limit=limit))
    if as_json:
        _echo_json([_run_json(r) for r in found])
        return
    rows = [
        [r.run_id, r.workflow, r.status.value, r.status_reason or "-", _time(r.updated_at)]
        for r in found
    ]
    _table(["RUN ID", "WORKFLOW", "STATUS", "REASON", "UPDATED"], rows, empty="no runs")


@runs.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run document as JSON.")
@pass_config
def show_run(config: _Config, run_id: str, as_json: bool) -> None:
    """Show a run with its steps, effects and approvals."""
    app = config.app()
    doc = _run(app, lambda: app.describe_async(run_id))
    if as_json:
        _echo_json(doc)
        return
    reason = f" ({doc['status_reason']})" if doc["status_reason"] else ""
    click.echo(f"run       {doc['run_id']}")
    click.echo(f"workflow  {doc['workflow']} v{doc['workflow_version']}  tenant {doc['tenant']}")
    click.echo(f"status    {doc['status']}{reason}")
    click.echo(f"updated   {_time(doc['updated_at'])}")
    if doc["status"] == RunStatus.COMPLETED.value:
        click.echo(f"result    {json.dumps(doc['result'], ensure_ascii=False)}")
    if doc["error"]:
        click.echo(f"error     {_error_text(doc['error'])}")
    waiting = doc["waiting_for"] or {}
    if doc["status"] == RunStatus.WAITING_APPROVAL.value and waiting.get("approval_id"):
        click.echo(
            f"waiting   approval {waiting['approval_id']}: `durably approve {doc['run_id']}` "
            f"or `durably reject {doc['run_id']}`"
        )
    click.echo("\nsteps:")
    steps = [
        [s["step_id"], s["kind"], s["status"], str(s["attempts"]), _error_text(s["error"])]
        for s in doc["steps"]
    ]
    _table(["STEP", "KIND", "STATUS", "ATTEMPTS", "ERROR"], steps)
    click.echo("\neffects:")
    effects = [
        [
            e["step_id"],
            e["tool"],
            e["status"],
            e["idempotency_key"][:12],
            e["external_operation_id"],
        ]
        for e in doc["effects"]
    ]
    _table(["STEP", "TOOL", "STATUS", "KEY", "EXTERNAL ID"], effects)
    click.echo("\napprovals:")
    # How long is left matters only while the approval can still be decided or used.
    live = ("requested", "approved")
    approvals = [
        [
            a["approval_id"],
            a["step_id"],
            a["status"],
            (_expiry if a["status"] in live else _time)(a["expires_at"]),
            a["decided_by"],
        ]
        for a in doc["approvals"]
    ]
    _table(["APPROVAL", "STEP", "STATUS", "EXPIRES", "DECIDED BY"], approvals)


def _operator() -> str:
    return os.environ.get("USER") or "operator"


_OPERATOR_DEFAULT = "$USER, else operator"


def _decision_command(decision: Decision) -> Callable[..., None]:
    """``approve`` or ``reject``: one command each, the same arguments and output."""

    @click.argument("run_id")
    @click.argument("approval_id", required=False)
    @click.option(
        "--by",
        default=_operator,
        show_default=_OPERATOR_DEFAULT,
        help="Who decided (recorded with the approval and in the run's history).",
    )
    @click.option("--comment", metavar="TEXT", help="Why; recorded with the decision.")
    @click.option("--json", "as_json", is_flag=True, help="Print the decided approval as JSON.")
    @pass_config
    def command(
        config: _Config,
        run_id: str,
        approval_id: str | None,
        by: str,
        comment: str | None,
        as_json: bool,
    ) -> None:
        app = config.app()
        approval = _run(
            app, lambda: app.decide_async(run_id, approval_id, decision, by=by, comment=comment)
        )
        _echo_decision(approval, as_json)

    return command


approve = cli.command(
    "approve",
    help="Approve the pending approval APPROVAL_ID of run RUN_ID (it may be omitted when the "
    "run has exactly one pending). The approval is usable once, by exactly the call or plan "
    "it was requested for, until it expires; a worker then continues the run. A decision is "
    "recorded once: deciding again is an error.",
)(_decision_command("approved"))

reject = cli.command(
    "reject",
    help="Reject the pending approval APPROVAL_ID of run RUN_ID (it may be omitted when the "
    "run has exactly one pending). The call does not run: when a worker continues the run, "
    "the workflow sees ApprovalRejected. A decision is recorded once: deciding again is an "
    "error.",
)(_decision_command("rejected"))


@cli.command()
@click.argument("run_id")
@click.argument("step_id")
@click.option("--succeeded", is_flag=True, help="It took effect; --result is what it returned.")
@click.option("--not-executed", is_flag=True, help="It did not happen; the run sends it again.")
@click.option("--failed", is_flag=True, help="It failed; the workflow sees StepFailed.")
@click.option(
    "--result",
    callback=_parse_json,
    metavar="JSON",
    help="With --succeeded: the tool's result as JSON.",
)
@click.option(
    "--by",
    default=_operator,
    show_default=_OPERATOR_DEFAULT,
    help="Who resolved it (recorded in the run's history).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def resolve(
    config: _Config,
    run_id: str,
    step_id: str,
    succeeded: bool,
    not_executed: bool,
    failed: bool,
    result: Any,
    by: str,
    as_json: bool,
) -> None:
    """Settle an unknown effect by hand. Check the external system first: did the call
    at STEP_ID of paused run RUN_ID take effect? The run becomes queued; `durably resume`
    or a worker continues it."""
    flags: dict[Outcome, bool] = {
        "succeeded": succeeded,
        "not_executed": not_executed,
        "failed": failed,
    }
    chosen = [outcome for outcome, given in flags.items() if given]
    if len(chosen) != 1:
        raise click.UsageError("pass exactly one of --succeeded, --not-executed, --failed")
    if result is not None and chosen[0] != "succeeded":
        raise click.UsageError("--result goes only with --succeeded")
    app = config.app()
    run = _run(
        app, lambda: app.resolve_effect_async(run_id, step_id, chosen[0], result=result, by=by)
    )
    _echo_run(run, as_json)


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def resume(config: _Config, run_id: str, as_json: bool) -> None:
    """Resume a paused run. It is executed here until it completes, fails or stops."""
    app = config.app()
    run = _run(app, lambda: app.resume_async(run_id))
    _echo_run(run, as_json)


@cli.command()
@click.argument("run_id")
@click.argument("name")
@click.option(
    "--payload", callback=_parse_json, metavar="JSON", help="The event's payload as JSON."
)
@click.option(
    "--event-id",
    metavar="ID",
    help="The sender's id for this event; sending the same id again changes nothing "
    "(default: a new id, shown with --json).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the delivery as JSON.")
@pass_config
def event(
    config: _Config, run_id: str, name: str, payload: Any, event_id: str | None, as_json: bool
) -> None:
    """Send event NAME to run RUN_ID, once per event id. A run waiting in
    wait_for_event(NAME) becomes due and a worker continues it; an event sent earlier is
    kept for that wait. Prints `delivered` or `duplicate ignored`."""
    # Chosen here, not by the app, so --json can show it and a caller can re-send it.
    eid = event_id or uuid.uuid4().hex
    app = config.app()
    result = _run(app, lambda: app.send_event_async(run_id, name, payload, event_id=eid))
    if as_json:
        _echo_json({"run_id": run_id, "name": name, "event_id": eid, "result": result})
    else:
        click.echo(result)


@cli.command()
@click.argument("run_id")
@click.option(
    "--compensate",
    is_flag=True,
    help="First run the compensations of the effects the run made, newest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def cancel(config: _Config, run_id: str, compensate: bool, as_json: bool) -> None:
    """Cancel run RUN_ID at its next call boundary, never in the middle of an effect.
    Cancelled is final. A run held by a live worker is stopped by that worker, so it may
    still show running here."""
    app = config.app()
    run = _run(app, lambda: app.cancel_async(run_id, compensate=compensate))
    _echo_run(run, as_json)
    if not as_json and not run.status.is_final:
        click.echo(
            f"note: a worker holds {run.run_id}; it cancels the run at its next call boundary "
            f"(check with `durably runs show {run.run_id}`)"
        )


@cli.command()
@pass_config
def migrate(config: _Config) -> None:
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
def serve(config: _Config, host: str, port: int) -> None:
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


def main() -> None:
    cli(prog_name="durably")
