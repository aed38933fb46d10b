"""A support agent on LangGraph whose refunds happen exactly once.

    pip install 'durably[langgraph]'
    python examples/langgraph_refund.py

Offline: a scripted LangChain chat model stands in for the LLM, and durably's demo shop
(started here, a real HTTP service) is the payment and mail service. LangGraph runs its own
graph (the model, then ``ToolNode``, until the model answers); durably records each
generation, and each tool call is an effect keyed by the model's tool call id. The refund
service does not deduplicate, so ``refund`` is reconciled: after a crash it asks the
service what happened instead of refunding again. A recovery replays the recorded turns
and tool calls instead of repeating them; starting the same run id again (below) returns
the recorded run and sends nothing.
"""

from __future__ import annotations

import tempfile
import urllib.parse
import uuid
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import durably
from durably.demo.shop import ShopService, get_json, post_json
from durably.integrations.langgraph import DurableChatModel, durable_tool

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


class ScriptedChatModel(BaseChatModel):
    """Stands in for the LLM: decides from the conversation alone, fresh call ids each time."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self.bind(tools=[t.name for t in tools], **kwargs)

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        done = [m for m in messages if isinstance(m, ToolMessage)]
        if not done:  # both refunds at once: ToolNode runs them concurrently
            message = AIMessage(
                "",
                tool_calls=[
                    {"name": "refund", "args": {"customer": "ann", "order": o}, "id": _new_id()}
                    for o in ("A-1", "A-2")
                ],
            )
        elif len(done) == 2:
            email = {"customer": "ann", "text": "Both of your orders are refunded."}
            message = AIMessage(
                "", tool_calls=[{"name": "email_customer", "args": email, "id": _new_id()}]
            )
        else:
            message = AIMessage("Refunded A-1 and A-2 and told Ann.")
        message.usage_metadata = {"input_tokens": 50, "output_tokens": 20, "total_tokens": 70}
        return ChatResult(generations=[ChatGeneration(message=message)])


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


tools = [durable_tool(refund), durable_tool(email_customer)]
model = DurableChatModel(app, ScriptedChatModel()).bind_tools(tools)  # each turn: one step


async def call_model(state: MessagesState) -> dict[str, Any]:
    return {"messages": [await model.ainvoke(state["messages"])]}


builder = StateGraph(MessagesState)
builder.add_node("agent", call_model)
builder.add_node("tools", ToolNode(tools))
builder.add_edge(START, "agent")
builder.add_conditional_edges("agent", tools_condition)
builder.add_edge("tools", "agent")
graph = builder.compile()  # no checkpointer: durably's journal is the run's memory


@app.workflow()
async def support(request: str) -> str:
    state = await graph.ainvoke({"messages": [HumanMessage(request)]})
    return str(state["messages"][-1].content)


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
