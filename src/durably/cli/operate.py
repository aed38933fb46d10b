"""An operator acting on one run: ``approve``/``reject`` its pending approval, ``resolve``
an unknown effect by hand, ``resume`` it, send it an ``event``, ``pause``/``unpause`` it,
``cancel`` it, ``fork`` it, or ``replay`` it what-if with the code deployed now."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Literal

import click

from durably.cli.base import (
    OPERATOR_DEFAULT,
    Config,
    cli,
    operator,
    parse_json,
    pass_config,
    run_coro,
)
from durably.cli.render import echo, echo_decision, echo_json, echo_replay, echo_run
from durably.status import PauseReason, ReplayMode, RunStatus

Outcome = Literal["succeeded", "not_executed", "failed"]


def by_option(did: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--by``: who ``did`` it (recorded), the operator by default."""
    return click.option("--by", default=operator, show_default=OPERATOR_DEFAULT, help=f"Who {did}.")


Decision = Literal["approved", "rejected"]


def _decision_command(decision: Decision) -> Callable[..., None]:
    """``approve`` or ``reject``: one command each, the same arguments and output."""

    @click.argument("run_id")
    @click.argument("approval_id", required=False)
    @by_option("decided (recorded with the approval and in the run's history)")
    @click.option("--comment", metavar="TEXT", help="Why; recorded with the decision.")
    @click.option("--json", "as_json", is_flag=True, help="Print the decided approval as JSON.")
    @pass_config
    def command(
        config: Config,
        run_id: str,
        approval_id: str | None,
        by: str,
        comment: str | None,
        as_json: bool,
    ) -> None:
        app = config.app()
        approval = run_coro(
            app, lambda: app.decide_async(run_id, approval_id, decision, by=by, comment=comment)
        )
        echo_decision(approval, as_json)

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
    callback=parse_json,
    metavar="JSON",
    help="With --succeeded: the tool's result as JSON.",
)
@by_option("resolved it (recorded in the run's history)")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def resolve(
    config: Config,
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
    or a worker continues it. On a cancelled run the outcome is only recorded."""
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
    run = run_coro(
        app, lambda: app.resolve_effect_async(run_id, step_id, chosen[0], result=result, by=by)
    )
    echo_run(run, as_json)


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def resume(config: Config, run_id: str, as_json: bool) -> None:
    """Resume a paused run. It is executed here until it completes, fails or stops."""
    app = config.app()
    run = run_coro(app, lambda: app.resume_async(run_id))
    echo_run(run, as_json)


@cli.command()
@click.argument("run_id")
@click.argument("name")
@click.option("--payload", callback=parse_json, metavar="JSON", help="The event's payload as JSON.")
@click.option(
    "--event-id",
    metavar="ID",
    help="The sender's id for this event; sending the same id again changes nothing "
    "(default: a new id, shown with --json).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the delivery as JSON.")
@pass_config
def event(
    config: Config, run_id: str, name: str, payload: Any, event_id: str | None, as_json: bool
) -> None:
    """Send event NAME to run RUN_ID, once per event id. A run waiting in
    wait_for_event(NAME) becomes due and a worker continues it; an event sent earlier is
    kept for that wait. Prints `delivered` or `duplicate ignored`."""
    # Chosen here, not by the app, so --json can show it and a caller can re-send it. An
    # empty --event-id is the caller's mistake, refused by the app, not a request for one.
    eid = uuid.uuid4().hex if event_id is None else event_id
    app = config.app()
    result = run_coro(app, lambda: app.send_event_async(run_id, name, payload, event_id=eid))
    if as_json:
        echo_json({"run_id": run_id, "name": name, "event_id": eid, "result": result})
    else:
        echo(result)


@cli.command()
@click.argument("run_id")
@click.option(
    "--compensate",
    is_flag=True,
    help="First run the compensations of the effects the run made, newest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def cancel(config: Config, run_id: str, compensate: bool, as_json: bool) -> None:
    """Cancel run RUN_ID at its next call boundary, never in the middle of an effect.
    Cancelled is final. A run held by a live worker is stopped by that worker, so it may
    still show running here."""
    app = config.app()
    run = run_coro(app, lambda: app.cancel_async(run_id, compensate=compensate))
    echo_run(run, as_json)
    if not as_json and not run.status.is_final:
        echo(
            f"note: a worker holds {run.run_id}; it cancels the run at its next call boundary "
            f"(check with `durably runs show {run.run_id}`)"
        )


@cli.command()
@click.argument("run_id")
@click.option("--reason", metavar="TEXT", help="Why; shown with the paused run.")
@by_option("paused it (recorded in the run's history)")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def pause(config: Config, run_id: str, reason: str | None, by: str, as_json: bool) -> None:
    """Pause run RUN_ID at its next call boundary, never in the middle of an effect: a call
    in flight lands and is recorded first. A queued or waiting run pauses at once (its wait
    is kept). `durably unpause` continues it."""
    app = config.app()
    run = run_coro(app, lambda: app.pause_async(run_id, reason=reason, by=by))
    echo_run(run, as_json)
    if not as_json and run.status is not RunStatus.PAUSED:
        echo(
            f"note: a worker holds {run.run_id}; it pauses the run at its next call boundary "
            f"(check with `durably runs show {run.run_id}`)"
        )
    elif not as_json and run.status_reason != PauseReason.OPERATOR:
        echo(
            f"note: {run.run_id} is paused for {run.status_reason}; settle that first, and it "
            "then stays paused until `durably unpause`"
        )


@cli.command()
@click.argument("run_id")
@by_option("unpaused it (recorded in the run's history)")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_config
def unpause(config: Config, run_id: str, by: str, as_json: bool) -> None:
    """Continue run RUN_ID, paused by `durably pause`: it is queued for a worker, and a run
    paused while waiting waits again for the same approval, event or timer. A pause its
    worker has not reached yet is withdrawn."""
    app = config.app()
    run = run_coro(app, lambda: app.unpause_async(run_id, by=by))
    echo_run(run, as_json)


@cli.command()
@click.argument("run_id")
@click.option("--at", metavar="STEP_ID", help="Fork after this step (or checkpoint) of RUN_ID.")
@click.option(
    "--replay",
    type=click.Choice([m.value for m in ReplayMode], case_sensitive=False),
    default=ReplayMode.DISABLED.value,
    show_default=True,
    help="What a new tool call past the fork point does: DISABLED pauses before sending, "
    "RECORDED answers from RUN_ID's ledger, SANDBOX calls the tool's sandbox, "
    "LIVE_WITH_NEW_APPROVAL sends after a fresh approval.",
)
@click.option("--run-id", "new_run_id", metavar="ID", help="The fork's run id (default: new).")
@click.option("--json", "as_json", is_flag=True, help="Print the fork as JSON.")
@pass_config
def fork(
    config: Config, run_id: str, at: str | None, replay: str, new_run_id: str | None, as_json: bool
) -> None:
    """Fork RUN_ID: a new queued run of this code whose history, up to --at, is RUN_ID's.
    A worker executes it; nothing real is sent past the fork point unless --replay says so."""
    app = config.app()
    mode = ReplayMode(replay.upper())
    run = run_coro(app, lambda: app.fork_async(run_id, at=at, replay=mode, new_run_id=new_run_id))
    echo_run(run, as_json)


DIVERGED_EXIT = 3
"""``durably replay``'s exit code when the new code does not reproduce the run (1 is an
error, 2 a usage error)."""


@cli.command()
@click.argument("run_id")
@click.option(
    "--mode",
    default=ReplayMode.RECORDED.value.lower(),
    show_default=True,
    help="How calls are answered; only recorded (from RUN_ID's own record) is supported.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def replay(ctx: click.Context, run_id: str, mode: str, as_json: bool) -> None:
    """What-if: replay completed run RUN_ID with the code of --app, every call answered from
    RUN_ID's record (nothing real runs), and report whether the code reproduces it or where
    it first diverges. Exit code 0: reproduced; 3: diverged."""
    config = ctx.find_object(Config)
    assert config is not None
    app = config.app()
    report = run_coro(app, lambda: app.replay_async(run_id, mode=mode))
    if as_json:
        echo_json(report.to_dict())
    else:
        echo_replay(report)
    ctx.exit(0 if report.reproduced else DIVERGED_EXIT)
