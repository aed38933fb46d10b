"""A support agent on Pydantic AI whose refunds happen exactly once.

    pip install 'durably[pydantic-ai]'
    python examples/pydantic_ai_refund.py

Offline: Pydantic AI's ``FunctionModel`` stands in for the LLM, and durably's demo shop
(started here, a real HTTP service) is the payment and mail service. Pydantic AI runs its
own loop; the ``DurablyDurability`` capability records each model request, and each tool
call is an effect keyed by the model's tool call id. The refund service does not
deduplicate, so ``refund`` is reconciled: after a crash it asks the service what happened
instead of refunding again. Starting the same run id again (below) returns the recorded run
and sends nothing.
"""

from __future__ import annotations

import tempfile
import urllib.parse
import uuid
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

import durably
from durably.demo.shop import ShopService, get_json, post_json
from durably.integrations.pydantic_ai import DurablyDurability, durable_tool

app = durably.App("sqlite:///refunds.db")  # main() points it at a temporary directory
shop = {"url": ""}


def find_refund(op: durably.Operation) -> durably.Reconciliation:
    """What the refund service knows about this refund (its credit note for the order)."""
    query = urllib.parse.urlencode(
        {"customer": op.arguments["customer"], "campaign": f"refund-{op.arguments['order']}"}
    )
    found = get_json(f"{shop['url']}/coupons?{query}")["coupons"]
    if found:
        return durably.Reconciliation.succeeded(found[0])
    return durably.Reconciliation.not_executed()


@app.tool(reconcile=find_refund, external_id=lambda r: r["coupon_id"])
def refund(customer: str, order: str) -> dict[str, Any]:
    """Refund the customer's order as a credit note."""
    body = {"customer": customer, "campaign": f"refund-{order}"}
    return post_json(f"{shop['url']}/coupons", body)


@app.tool(idempotent=True)
def email_customer(customer: str, text: str) -> dict[str, Any]:
    """Email the customer."""
    body = {"to": customer, "subject": "Your refund", "body": text}
    key = durably.idempotency_key()
    return post_json(f"{shop['url']}/emails", body, idempotency_key=key)


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Stands in for the LLM: decides from the conversation alone, fresh call ids each time."""
    done = [
        p
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    parts: list[Any]
    if not done:  # both refunds at once: Pydantic AI runs them concurrently
        parts = [
            ToolCallPart("refund", {"customer": "ann", "order": o}, tool_call_id=_new_id())
            for o in ("A-1", "A-2")
        ]
    elif len(done) == 2:
        text = "Both of your orders are refunded."
        args = {"customer": "ann", "text": text}
        parts = [ToolCallPart("email_customer", args, tool_call_id=_new_id())]
    else:
        parts = [TextPart("Refunded A-1 and A-2 and told Ann.")]
    return ModelResponse(parts=parts, usage=RequestUsage(input_tokens=50, output_tokens=20))


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


agent = Agent(
    FunctionModel(scripted, model_name="scripted"),
    name="support",
    instructions="Refund what the customer asks for, then tell them.",
    tools=[durable_tool(refund), durable_tool(email_customer)],
    capabilities=[DurablyDurability(app)],  # each model request: one recorded step
)


@app.workflow()
async def support(request: str) -> str:
    result = await agent.run(request)
    return result.output


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir, ShopService() as service:
        shop["url"] = service.url
        app.database_url = f"sqlite:///{workdir}/refunds.db"
        request = "Please refund my orders A-1 and A-2. Ann"
        run = app.run(support, request)
        print(f"run {run.run_id}: {run.status.value}: {run.result}")
        for effect in app.describe(run.run_id)["effects"]:
            print(f"  {effect['tool']:15} at step {effect['step_id']}: {effect['status']}")
        again = app.run(support, request, run_id=run.run_id)  # the same run: nothing re-sent
        effects = service.effects()
        print(
            f"again: {again.status.value}; at the shop: {len(effects['coupons'])} refunds, "
            f"{len(effects['emails'])} email"
        )
        app.close()


if __name__ == "__main__":
    main()
