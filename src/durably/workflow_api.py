"""Functions workflow code calls on its own run."""

from __future__ import annotations

from durably import context, effects


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
    return await effects.compensate(context.active(), step_ids)
