"""A LangGraph agent in a durably workflow, executed in real processes by the tests.

A LangGraph ``StateGraph`` (a model node, then ``ToolNode``, until the model answers) drives
:class:`ScriptedChatModel`: an offline LangChain chat model that decides from the
conversation alone (like a model at temperature 0) and, like a real one, stamps fresh
random tool call ids on every answer, so a turn asked twice would call its tools under new
ids. It is wrapped in ``DurableChatModel``. Its tools make one real effect each at the shop
(``$SHOP_URL``), as in :mod:`tests.integrations.agentapp`:

* ``place_order``: ``idempotent=True``, POST /orders with ``durably.idempotency_key()``;
* ``issue_coupon``: POST /coupons (no deduplication), ``reconcile=`` asks GET /coupons.

The user message is a JSON plan ``{customer, campaign, tool, mode}``. ``sequential``: one
tool call per turn, campaigns ``<campaign>-0`` .. ``-2``, then a final answer (4 turns);
``parallel``: the three calls in one turn, which ``ToolNode`` runs concurrently, then the
answer (2 turns). Each tool first sleeps a latency drawn from ``$AGENT_SEED``,
``$CRASH_ROLE`` and its campaign, so the calls of a turn finish in an order that differs
between the dead process and the recovering one.

``python -m tests.integrations.langgraph_agentapp serve`` is a fork server, as agentapp's:
one process imports everything once and forks a fresh child per command line on its stdin
(``{"id", "argv", "env", "stdout", "stderr"}``) and answers ``{"id", "code"}`` when it
exits (77: crashed at ``$DURABLY_CRASH_AT``). A child's argv is ``start|recover RUN_ID
WORKFLOW INPUT_JSON``; it prints the run as JSON, with ``model_calls`` (how often this
process asked the model), last.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import sys
import time
import traceback
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import durably
from durably.demo.shop import get_json, post_json
from durably.integrations.langgraph import DurableChatModel, durable_tool

LEASE_TTL_S = 1.0
CALLS = 3
TURNS = {"sequential": CALLS + 1, "parallel": 2}
MODEL_CALLS: Counter[str] = Counter()
"""Model calls this process made, by durably run id."""

app = durably.App(
    "sqlite:///unused.db",  # execute() sets the command's own before the first use
    lease_ttl=timedelta(seconds=LEASE_TTL_S),
    reconcile_grace=timedelta(seconds=0.5),
)


# -- the model ----------------------------------------------------------------------------


def plan_of(messages: Sequence[BaseMessage]) -> dict[str, Any]:
    """The JSON plan in the conversation's first user message."""
    first = next(m for m in messages if isinstance(m, HumanMessage))
    return dict(json.loads(str(first.content)))


def tool_results(messages: Sequence[BaseMessage]) -> list[ToolMessage]:
    return [m for m in messages if isinstance(m, ToolMessage)]


def tool_outputs(messages: Sequence[BaseMessage]) -> list[str]:
    """What the tools returned; an error ``ToolNode`` handed the model is not an output."""
    return [str(m.content) for m in tool_results(messages) if m.status == "success"]


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    # A fresh id, as a real model's: a repeated turn would be seen as new tool calls.
    return {"name": name, "args": arguments, "id": f"call_{uuid.uuid4().hex}", "type": "tool_call"}


def answer(messages: Sequence[BaseMessage]) -> AIMessage:
    """What a model at temperature 0 answers to this conversation."""
    plan, outputs = plan_of(messages), tool_outputs(messages)
    args = [
        {"customer": plan["customer"], "campaign": f"{plan['campaign']}-{i}"} for i in range(CALLS)
    ]
    if plan["mode"] == "parallel" and not outputs:
        return AIMessage("", tool_calls=[tool_call(plan["tool"], a) for a in args])
    if plan["mode"] == "sequential" and len(outputs) < CALLS:
        return AIMessage("", tool_calls=[tool_call(plan["tool"], args[len(outputs)])])
    return AIMessage("done: " + " | ".join(outputs))


class ScriptedChatModel(BaseChatModel):
    """An offline chat model: ``decide``, with usage, counted in :data:`MODEL_CALLS`."""

    decide: Callable[[Sequence[BaseMessage]], AIMessage] = answer
    model_name: str = "scripted-1"

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(
        self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        raise NotImplementedError("scripted: async only")

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        MODEL_CALLS[durably.current_run().run_id] += 1
        message = self.decide(messages)
        message.usage_metadata = {
            "input_tokens": 10 * len(messages),
            "output_tokens": 7,
            "total_tokens": 10 * len(messages) + 7,
        }
        return ChatResult(generations=[ChatGeneration(message=message)])


def agent_graph(
    model: BaseChatModel,
    tools: Sequence[BaseTool],
    *,
    checkpointer: Any = None,
    **tool_node: Any,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The usual LangGraph agent: the model, then ``ToolNode`` for its calls, until it answers.
    ``tool_node`` goes to ``ToolNode`` (``handle_tool_errors``, ...)."""
    bound = model.bind_tools(tools)

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode(tools, **tool_node))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


# -- tools --------------------------------------------------------------------------------


def _shop() -> str:
    return os.environ["SHOP_URL"].rstrip("/")


def latency(campaign: str) -> None:
    draw = random.Random(
        f"{os.environ.get('AGENT_SEED')}:{os.environ.get('CRASH_ROLE')}:{campaign}"
    )
    time.sleep(draw.random() * 0.05)


@app.tool(idempotent=True, external_id=lambda r: r["order_id"])
def place_order(customer: str, campaign: str) -> dict[str, Any]:
    """Place the campaign's one-item order for the customer."""
    latency(campaign)
    body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
    return post_json(f"{_shop()}/orders", body, idempotency_key=durably.idempotency_key())


def coupon_view(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("coupon_id", "customer", "campaign", "code")}


def find_coupon(op: durably.Operation) -> durably.Reconciliation:
    query = urllib.parse.urlencode(
        {"customer": op.arguments["customer"], "campaign": op.arguments["campaign"]}
    )
    found = get_json(f"{_shop()}/coupons?{query}")["coupons"]
    if found:
        return durably.Reconciliation.succeeded(coupon_view(found[0]), duplicates=len(found) - 1)
    return durably.Reconciliation.not_executed()


@app.tool(reconcile=find_coupon, external_id=lambda r: r["coupon_id"])
def issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
    """Issue the customer a coupon for the campaign."""
    latency(campaign)
    body = {"customer": customer, "campaign": campaign}
    return coupon_view(post_json(f"{_shop()}/coupons", body))


# -- the agent and its workflow -------------------------------------------------------------

GRAPH = agent_graph(
    DurableChatModel(app, ScriptedChatModel()),
    [durable_tool(place_order), durable_tool(issue_coupon)],
)


@app.workflow()
async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
    plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
    state = await GRAPH.ainvoke({"messages": [HumanMessage(json.dumps(plan))]})
    return {"answer": state["messages"][-1].content}


# -- one run in this process ----------------------------------------------------------------

LEASE_WAIT_S = 15.0


async def wait_for_lease(run_id: str) -> None:
    """Return once nobody holds a live lease on the run (judged by the store's clock)."""
    store = await app.open()
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        run = await store.get_run(run_id)
        if run is None or run.lease_owner is None or run.lease_until is None:
            return
        if run.lease_until < await store.now():
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the lease on {run_id} did not expire within {LEASE_WAIT_S} s")
        await asyncio.sleep(0.02)


async def execute(argv: list[str]) -> dict[str, Any]:
    mode, run_id, workflow, run_input = argv[0], argv[1], argv[2], json.loads(argv[3])
    app.database_url = os.environ["DURABLY_DATABASE_URL"]
    try:
        if mode == "recover":
            await wait_for_lease(run_id)
        elif mode != "start":
            raise SystemExit(f"unknown mode {mode!r}")
        run = await app.run_async(workflow, run_id=run_id, **run_input)
    finally:
        await app.close_async()
    return {
        "run_id": run.run_id,
        "status": run.status.value,
        "status_reason": run.status_reason,
        "result": run.result,
        "error": run.error,
        "model_calls": MODEL_CALLS[run_id],
    }


# -- the fork server ------------------------------------------------------------------------


def child(command: dict[str, Any]) -> None:
    """In the forked child: redirect output, take the command's environment, run, exit."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's commands are not ours
        for fd, path in ((1, command["stdout"]), (2, command["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.pop("DURABLY_CRASH_AT", None)
        os.environ.update(command["env"])
        print(json.dumps(asyncio.run(execute(command["argv"]))), flush=True)
        code = 0
    except SystemExit as exc:
        print(exc, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    children: dict[int, Any] = {}
    pending = b""
    closed = False
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while not closed or children:
        readable, _, _ = select.select([] if closed else [0], [], [], 0.01)
        if readable:
            chunk = os.read(0, 1 << 16)
            closed = not chunk
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                command = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(command)
                children[pid] = command["id"]
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            done = {"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)}
            print(json.dumps(done), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        print(json.dumps(asyncio.run(execute(sys.argv[1:]))), flush=True)
