"""An OpenAI Agents SDK agent in a durably workflow, executed in real processes by the tests.

The SDK's own ``Runner.run`` loop drives :class:`ScriptedModel`, an offline model that
decides from the conversation alone (like a model at temperature 0) and, like a real one,
stamps fresh random tool call ids and item ids on every answer: a turn asked twice would
call its tools under new ids. Its tools make one real effect each at the shop
(``$SHOP_URL``):

* ``place_order``: ``idempotent=True``, POST /orders with ``durably.idempotency_key()``;
* ``issue_coupon``: POST /coupons (no deduplication), ``reconcile=`` asks GET /coupons.

The user message is a JSON plan ``{customer, campaign, tool, mode}``. ``sequential``: one
tool call per turn, campaigns ``<campaign>-0`` .. ``-2``, then a final answer (4 turns);
``parallel``: the three calls in one turn, then the answer (2 turns). Each tool first
sleeps a latency drawn from ``$AGENT_SEED``, ``$CRASH_ROLE`` and its campaign, so the SDK
finishes the calls of a turn in an order that differs between seeds and between the dead
process and the recovering one.

``python -m tests.integrations.agentapp serve`` is a fork server: importing the SDK takes
seconds, so one process imports everything once and forks a child per command line on its
stdin (``{"id", "argv", "env", "stdout", "stderr"}``). A child shares nothing with the
crashed process it recovers from: its own pid, connections and memory, copied from a
parent that only imported modules and never ran a workflow. The server answers
``{"id", "code"}`` when the child exits (77: crashed at ``$DURABLY_CRASH_AT``). A child's
argv is ``start|recover RUN_ID WORKFLOW INPUT_JSON`` (as ``tests.crash.runner``); it prints
the run as JSON, with ``model_calls`` (how often this process asked the model), last.
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
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

from agents import (
    Agent,
    AgentOutputSchemaBase,
    Handoff,
    Model,
    ModelProvider,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    RunConfig,
    Tool,
    Usage,
    set_tracing_disabled,
)
from agents.items import TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
from agents.testing import assistant_message, function_call
from openai.types.responses.response_prompt_param import ResponsePromptParam

import durably
from durably.demo.shop import get_json, post_json
from durably.integrations import openai_agents
from durably.integrations.openai_agents import durable_tool

set_tracing_disabled(True)  # offline: no trace export

LEASE_TTL_S = 1.0
"""Short, so a recovery waits little for the dead process's lease; long enough for a
heartbeat on a busy machine running several of these at once."""
CALLS = 3
TURNS = {"sequential": CALLS + 1, "parallel": 2}
MODEL_CALLS: Counter[str] = Counter()
"""Model calls this process made, by run id."""

app = durably.App(
    "sqlite:///unused.db",  # execute() sets the command's own before the first use
    lease_ttl=timedelta(seconds=LEASE_TTL_S),
    reconcile_grace=timedelta(seconds=0.5),
)


# -- the model ----------------------------------------------------------------------------


def plan_of(items: str | list[TResponseInputItem]) -> dict[str, Any]:
    """The JSON plan in the conversation's first user message."""
    if isinstance(items, str):
        return dict(json.loads(items))
    first = next(i for i in items if isinstance(i, dict) and i.get("role") == "user")
    content = first["content"]  # type: ignore[typeddict-item]
    return dict(json.loads(content if isinstance(content, str) else content[0]["text"]))


def tool_outputs(items: str | list[TResponseInputItem]) -> list[str]:
    if isinstance(items, str):
        return []
    return [
        str(i["output"])  # type: ignore[typeddict-item]
        for i in items
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]


def tool_call(name: str, arguments: dict[str, Any]) -> TResponseOutputItem:
    # Fresh ids, as a real model's: a repeated turn would be seen as new tool calls.
    return function_call(
        name, arguments, call_id=f"call_{uuid.uuid4().hex}", item_id=f"fc_{uuid.uuid4().hex}"
    )


def answer(items: str | list[TResponseInputItem]) -> list[TResponseOutputItem]:
    """What a model at temperature 0 answers to this conversation."""
    plan, outputs = plan_of(items), tool_outputs(items)
    args = [
        {"customer": plan["customer"], "campaign": f"{plan['campaign']}-{i}"} for i in range(CALLS)
    ]
    if plan["mode"] == "parallel" and not outputs:
        return [tool_call(plan["tool"], a) for a in args]
    if plan["mode"] == "sequential" and len(outputs) < CALLS:
        return [tool_call(plan["tool"], args[len(outputs)])]
    text = "done: " + " | ".join(outputs)
    return [assistant_message(text, item_id=f"msg_{uuid.uuid4().hex}")]


class ScriptedModel(Model):
    """An offline model: :func:`answer`, with usage, counted in :data:`MODEL_CALLS`."""

    model = "scripted-1"

    def __init__(self, decide: Callable[[Any], list[TResponseOutputItem]] = answer) -> None:
        self.decide = decide

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        MODEL_CALLS[durably.current_run().run_id] += 1
        items = 1 if isinstance(input, str) else len(input)
        usage = Usage(requests=1, input_tokens=10 * items, output_tokens=7)
        usage.total_tokens = usage.input_tokens + usage.output_tokens
        return ModelResponse(
            output=self.decide(input), usage=usage, response_id=f"resp_{uuid.uuid4().hex}"
        )

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("scripted: no streaming")

    def _supports_default_prompt_cache_key(self) -> bool:
        # As OpenAI's models do: the SDK then stamps a new prompt cache key on every run.
        return True


class ScriptedProvider(ModelProvider):
    def get_model(self, model_name: str | None) -> Model:
        return ScriptedModel()


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

AGENT: Agent[Any] = Agent(
    name="shop-agent",
    instructions="Carry out the plan in the user's message with the tools, then report.",
    model="scripted-1",  # resolved by the run's provider, which openai_agents.run wraps
    tools=[durable_tool(place_order), durable_tool(issue_coupon)],
)


@app.workflow()
async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
    plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
    config = RunConfig(model_provider=ScriptedProvider(), tracing_disabled=True)
    result = await openai_agents.run(app, AGENT, json.dumps(plan), run_config=config)
    return {"answer": result.final_output}


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
