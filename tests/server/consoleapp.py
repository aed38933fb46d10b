"""The app behind the console tests, importable by a ``durably serve`` subprocess
(``--app tests.server.consoleapp:app --db URL``) and built again by the tests themselves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import durably


def build_app(url: str) -> durably.App:
    """The same definitions in the server's App and the driver's."""
    app = durably.App(url, lease_ttl=timedelta(seconds=5))

    @app.step()
    def add(a: int, b: int) -> int:
        return a + b

    @app.tool()
    def charge(amount: int) -> dict[str, Any]:
        raise TimeoutError("gateway timed out")

    @app.tool(idempotent=True, requires_approval=True)
    def place_order(customer: str) -> dict[str, Any]:
        return {"customer": customer}

    @app.model("scripted-mini", profile="v1")
    def answer(question: str) -> dict[str, Any]:
        return {"text": question.upper(), "usage": {"input_tokens": 3, "output_tokens": 2}}

    @app.workflow()
    async def asking(question: str) -> Any:
        return await answer(question)

    @app.workflow()
    async def summing(a: int, b: int = 0) -> int:
        return await add(a, b)

    @app.workflow()
    async def billing(amount: int) -> dict[str, Any]:
        return await charge(amount)

    @app.workflow()
    async def ordering(customer: str) -> dict[str, Any]:
        try:
            return await place_order(customer=customer)
        except durably.ApprovalRejected as exc:
            return {"rejected_by": exc.by}

    @app.workflow()
    async def waiter() -> Any:
        return await durably.wait_for_event("go", timeout=600)

    return app


# `durably serve --db URL` replaces this URL before the store is opened.
app = build_app("sqlite:///consoleapp-unused.db")
