"""Functions workflow code calls on its own run."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import Any

from durably import context, effect
from durably.calls import PATCH, Scope
from durably.errors import InvalidInput
from durably.keys import sha256_hex
from durably.status import StepStatus
from durably.store.base import EventWrite, StepWrite, Transition
from durably.values import check_text


async def charge(*, tokens: int = 0, cost: float = 0.0) -> None:
    """Report what the run spent (a model call's tokens, an API's cost) against its budget.

    Call it with recorded values (a step's output), so a replay charges the same amounts;
    over the budget the run pauses here with reason ``budget_exceeded``.
    """
    ctx = context.active()
    for what, amount in (("tokens", tokens), ("cost", cost)):
        # NaN compares false with every limit: one such charge would switch the budget off.
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise InvalidInput(f"charge({what}=...) takes a number, not {amount!r}")
        if not math.isfinite(amount) or amount < 0:
            raise InvalidInput(f"charge({what}={amount!r}): charge a finite amount, 0 or more")
    ctx.count("tokens", tokens)
    ctx.count("cost", cost)
    await ctx.check_budget()


async def compensate(*step_ids: str) -> list[str]:
    """Undo succeeded effects with their tools' ``compensate=`` functions, newest first.

    With no arguments every compensable effect of the run is undone; otherwise only those
    at ``step_ids``. Each compensation is itself an effect in the ledger: it runs once, even
    across crashes. Returns the step ids compensated.

    Example::

        try:
            await charge_card(order)
        except durably.StepFailed:
            await durably.compensate("create_order#1")
            raise
    """
    return await effect.compensate(context.active(), step_ids)


async def gather(*branches: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """``asyncio.gather`` for workflow code whose branches each make several durable calls.

    A step or tool call without an explicit step id is numbered in the order the workflow
    makes its calls; branches running concurrently would reach their calls in an order that
    depends on latency, and a replay in another order would pause as non-determinism. Each
    branch here numbers its calls on its own (``gather#<n>.<branch>/<name>#<k>``), so the
    ids, and the idempotency keys derived from them, are the same however the branches
    interleave.

    Example::

        async def review(doc: str) -> str:
            summary = await summarize(doc)
            return await critique(summary)

        reviews = await durably.gather(*(review(d) for d in docs))
    """
    ctx = context.active()
    scopes = ctx.branches(len(branches))
    return await asyncio.gather(
        *(_in_scope(scope, branch) for scope, branch in zip(scopes, branches, strict=True)),
        return_exceptions=return_exceptions,
    )


async def _in_scope(scope: Scope, branch: Awaitable[Any]) -> Any:
    scope.enter()  # this branch's task has its own copy of the context
    return await branch


async def patched(name: str) -> bool:
    """Whether this run takes the code path introduced by the change ``name``.

    For a workflow registered with ``migrates_from=[...]``, taking over runs that older code
    started: a run that had already recorded calls past this point (it started before the
    change) gets ``False`` and replays the old path; a run that reaches this point at the
    edge of its history gets ``True``, and the choice is recorded, so every later replay of
    it takes the new path too. Once no run of the old version is left, remove the branch.

    Example::

        @app.workflow(version="2", migrates_from=["1"])
        async def order(customer: str) -> dict:
            plan = await make_plan(customer)
            if await durably.patched("fraud-check"):
                await check_fraud(customer)
            return await place_order(plan)
    """
    check_text(name, "patch name")
    if "|" in name:
        raise InvalidInput(f"patch name {name!r} contains '|'")
    ctx = context.active()
    ctx.check_running()
    step_id = f"{PATCH}:{name}"
    if step_id in ctx.steps:
        return True
    if step_id in ctx.patches:
        return ctx.patches[step_id]
    replaying = any(s not in ctx.reached and s.partition(":")[0] != PATCH for s in ctx.steps)
    ctx.patches[step_id] = not replaying
    if not replaying:
        await ctx.commit(
            lambda: Transition(
                events=[EventWrite("patch_applied", step_id, {"name": name})],
                step=StepWrite(
                    step_id,
                    0,
                    "step",
                    PATCH,
                    StepStatus.SUCCEEDED,
                    sha256_hex(name),
                    output_json="true",
                    settle=True,
                    new_row=True,
                ),
                checkpoint=ctx.journal.periodic(current_step=step_id),
            ),
            settle=(step_id, sha256_hex("true")),
        )
    return not replaying
