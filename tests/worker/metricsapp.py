"""An app whose runs move every kind of metric, for the worker metrics tests."""

from __future__ import annotations

import os

import durably
from durably import Reconciliation

app = durably.App(os.environ.get("DURABLY_DATABASE_URL"))


@app.tool()
def charge(amount: int) -> int:
    return amount


def found_twice(op: durably.Operation) -> Reconciliation:
    # The service holds the coupon twice: an earlier bug, reported as a duplicate.
    return Reconciliation.succeeded({"coupon": op.arguments["customer"]}, duplicates=1)


@app.tool(reconcile=found_twice)
def issue(customer: str) -> dict[str, str]:
    raise TimeoutError("issued, but the answer came too late")


@app.tool()
def ship(order: str) -> None:
    raise TimeoutError("no answer: only a person can tell whether it shipped")


@app.workflow()
async def checkout(customer: str) -> dict[str, str]:
    await charge(10)
    return await issue(customer)


@app.workflow()
async def deliver(order: str) -> None:
    await ship(order)
