"""Starting runs and looking at them: ``start``, ``runs list`` and ``runs show``."""

from __future__ import annotations

import json
from typing import Any

import click

from durably.app import START_OPTIONS
from durably.cli.base import Config, cli, parse_json, pass_config, run_coro
from durably.cli.render import echo, echo_json, error_text, expiry, format_time, run_json, table
from durably.status import RunStatus
from durably.values import MAX_LIST


@cli.command()
@click.argument("workflow")
@click.option(
    "--input",
    "input_",
    callback=parse_json,
    metavar="JSON",
    help="The workflow's input as JSON: an object gives keyword arguments, an array "
    "positional arguments, any other value one positional argument.",
)
@click.option("--run-id", help="Run id; starting the same id again returns the existing run.")
@click.option("--tenant", default="default", show_default=True, help="Tenant of the run.")
@pass_config
def start(config: Config, workflow: str, input_: Any, run_id: str | None, tenant: str) -> None:
    """Queue a run of WORKFLOW for a worker and print its run id."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if isinstance(input_, dict):
        kwargs = input_
        clash = sorted(START_OPTIONS & kwargs.keys())
        if clash:
            raise click.BadParameter(
                f"keys {clash} name start's own options (--run-id, --tenant), not the "
                "workflow's input: pass the input as a JSON array of positional arguments",
                param_hint="'--input'",
            )
    elif isinstance(input_, list):
        args = input_
    elif input_ is not None:
        args = [input_]
    app = config.app()
    rid = run_coro(
        app, lambda: app.start_async(workflow, *args, run_id=run_id, tenant=tenant, **kwargs)
    )
    echo(rid)


@cli.group()
def runs() -> None:
    """Inspect runs."""


@runs.command("list")
@click.option(
    "--status", type=click.Choice([s.value for s in RunStatus]), help="Only runs in this status."
)
@click.option("--workflow", help="Only runs of this workflow.")
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_LIST),
    default=100,
    show_default=True,
    help="How many runs at most.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of runs.")
@pass_config
def list_runs(
    config: Config, status: str | None, workflow: str | None, limit: int, as_json: bool
) -> None:
    """List runs, newest first."""
    app = config.app()
    wanted = RunStatus(status) if status else None
    found = run_coro(
        app, lambda: app.list_runs_async(status=wanted, workflow=workflow, limit=limit)
    )
    if as_json:
        echo_json([run_json(r) for r in found])
        return
    rows = [
        [r.run_id, r.workflow, r.status.value, r.status_reason or "-", format_time(r.updated_at)]
        for r in found
    ]
    table(["RUN ID", "WORKFLOW", "STATUS", "REASON", "UPDATED"], rows, empty="no runs")


@runs.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run document as JSON.")
@pass_config
def show_run(config: Config, run_id: str, as_json: bool) -> None:
    """Show a run with its steps, effects and approvals."""
    app = config.app()
    doc = run_coro(app, lambda: app.describe_async(run_id))
    if as_json:
        echo_json(doc)
        return
    reason = f" ({doc['status_reason']})" if doc["status_reason"] else ""
    echo(f"run       {doc['run_id']}")
    echo(f"workflow  {doc['workflow']} v{doc['workflow_version']}  tenant {doc['tenant']}")
    echo(f"status    {doc['status']}{reason}")
    echo(f"updated   {format_time(doc['updated_at'])}")
    if doc["status"] == RunStatus.COMPLETED.value:
        echo(f"result    {json.dumps(doc['result'], ensure_ascii=False)}")
    if doc["error"]:
        echo(f"error     {error_text(doc['error'])}")
    waiting = doc["waiting_for"] or {}
    if doc["status"] == RunStatus.WAITING_APPROVAL.value and waiting.get("approval_id"):
        echo(
            f"waiting   approval {waiting['approval_id']}: `durably approve {doc['run_id']}` "
            f"or `durably reject {doc['run_id']}`"
        )
    echo()
    echo("steps:")
    steps = [
        [s["step_id"], s["kind"], s["status"], str(s["attempts"]), error_text(s["error"])]
        for s in doc["steps"]
    ]
    table(["STEP", "KIND", "STATUS", "ATTEMPTS", "ERROR"], steps)
    echo()
    echo("effects:")
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
    table(["STEP", "TOOL", "STATUS", "KEY", "EXTERNAL ID"], effects)
    if doc["model_calls"]:
        echo()
        echo("model calls:")
        calls = [
            [
                c["step_id"],
                c["model"],
                c["model_profile"],
                _tokens(c["usage"]),
                f"{c['latency_ms']:.0f} ms",
                ", ".join(c["tool_call_ids"]),
            ]
            for c in doc["model_calls"]
        ]
        table(["STEP", "MODEL", "PROFILE", "TOKENS IN/OUT", "LATENCY", "TOOL CALLS"], calls)
    echo()
    echo("approvals:")
    # How long is left matters only while the approval can still be decided or used.
    live = ("requested", "approved")
    approvals = [
        [
            a["approval_id"],
            a["step_id"],
            a["status"],
            (expiry if a["status"] in live else format_time)(a["expires_at"]),
            a["decided_by"],
        ]
        for a in doc["approvals"]
    ]
    table(["APPROVAL", "STEP", "STATUS", "EXPIRES", "DECIDED BY"], approvals)


def _tokens(usage: dict[str, float]) -> str:
    if not usage:
        return ""
    return f"{usage.get('input_tokens', 0):g}/{usage.get('output_tokens', 0):g}"
