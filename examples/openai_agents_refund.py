"""A support agent on the OpenAI Agents SDK whose refunds happen exactly once.

    pip install 'durably[openai-agents]'
    python examples/openai_agents_refund.py

Offline: a scripted model stands in for the LLM, and durably's demo shop (started here, a
real HTTP service) is the payment and mail service. The SDK runs its own loop; durably
records each model turn, and each tool call is an effect keyed by the model's tool call id.
The refund service does not deduplicate, so ``refund`` is reconciled: after a crash it asks
the service what happened instead of refunding again. A recovery replays the recorded
turns and tool calls instead of repeating them; starting the same run id again (below)
returns the recorded run and sends nothing.
"""

from __future__ import annotations

import tempfile
import urllib.parse
import uuid
from typing import Any

from agents import Agent, Model, ModelResponse, RunConfig, Usage
from agents.testing import assistant_message, function_call

import durably
from durably.demo.shop import ShopService, get_json, post_json
from durably.integrations import openai_agents
from durably.integrations.openai_agents import DurableModel, durable_tool

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


class ScriptedModel(Model):
    """Stands in for the LLM: decides from the conversation alone, fresh call ids each time."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        done = [i for i in input if isinstance(i, dict) and i.get("type") == "function_call_output"]
        if not done:  # both refunds at once: the SDK runs them in parallel
            output = [
                function_call("refund", {"customer": "ann", "order": o}, call_id=_new_id())
                for o in ("A-1", "A-2")
            ]
        elif len(done) == 2:
            text = "Both of your orders are refunded."
            output = [
                function_call(
                    "email_customer", {"customer": "ann", "text": text}, call_id=_new_id()
                )
            ]
        else:
            output = [assistant_message("Refunded A-1 and A-2 and told Ann.")]
        usage = Usage(requests=1, input_tokens=50, output_tokens=20, total_tokens=70)
        return ModelResponse(output=output, usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


agent = Agent(
    name="support",
    instructions="Refund what the customer asks for, then tell them.",
    model=DurableModel(app, ScriptedModel()),  # each turn: one recorded step
    tools=[durable_tool(refund), durable_tool(email_customer)],
)


@app.workflow()
async def support(request: str) -> str:
    config = RunConfig(tracing_disabled=True)  # offline: no trace export
    result = await openai_agents.run(app, agent, request, run_config=config)
    return str(result.final_output)


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
