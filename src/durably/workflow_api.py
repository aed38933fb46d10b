"""Functions workflow code calls on its own run."""

from __future__ import annotations

from durably import context, effect


async def charge(*, tokens: int = 0, cost: float = 0.0) -> None:
    """Report what the run spent (a model call's tokens, an API's cost) against its budget.

    Call it with recorded values (a step's output), so a replay charges the same amounts;
    over the budget the run pauses here with reason ``budget_exceeded``.
    """
    ctx = context.active()
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
