"""What the three framework apps share: the shop's tools, the plan their scripted models
follow, one run in a process and the fork server (:mod:`tests.integrations.harness` drives
them).

* :func:`shop_tools` registers one tool per kind of effect (:data:`KINDS`), each one real
  POST at the shop (``$SHOP_URL``) after a latency drawn from ``$AGENT_SEED``,
  ``$CRASH_ROLE`` and its campaign:

  - ``idempotent``: ``place_order``, POST /orders with ``durably.idempotency_key()``;
  - ``reconciled``: ``issue_coupon``, POST /coupons (no deduplication), ``reconcile=`` asks
    GET /coupons;
  - ``neither``: ``send_coupon``, POST /coupons, no key and no reconcile: an unknown outcome
    pauses the run for a person;
  - ``approval``: ``approved_order``, idempotent like ``place_order`` and
    ``requires_approval=True``: the run waits for a person before each call.

* :func:`next_calls` is what a model at temperature 0 asks next for a plan
  ``{customer, campaign, tool, mode}``: ``sequential``, one call per turn for campaigns
  ``<campaign>-0`` .. ``-2``, then the answer (4 turns); ``parallel``, the three calls in one
  turn, then the answer (2 turns).
* :func:`main` runs one command line, or with ``serve`` a fork server: importing a framework
  takes seconds, so one process imports everything once and forks a child per command line
  on its stdin (``{"id", "argv", "env", "stdout", "stderr"}``), answering ``{"id", "code"}``
  when the child exits (77: crashed at ``$DURABLY_CRASH_AT``). A child shares nothing with
  the crashed process it recovers from. Its argv is ``start|recover RUN_ID WORKFLOW
  INPUT_JSON``; it prints the run as JSON, with ``model_calls`` (how often this process
  asked the model), last.
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
from collections import Counter
from datetime import timedelta
from typing import Any

import durably
from durably.cli.render import run_json
from durably.demo.shop import ShopService, get_json, post_json
from tests.leases import wait_for_lease

CALLS = 3
TURNS = {"sequential": CALLS + 1, "parallel": 2}
CAMPAIGN = "spring"
CAMPAIGNS = [f"{CAMPAIGN}-{i}" for i in range(CALLS)]
KINDS = {
    "idempotent": "place_order",
    "reconciled": "issue_coupon",
    "neither": "send_coupon",
    "approval": "approved_order",
}
LEASE_TTL_S = 1.0
"""Short, so a recovery waits little for the dead process's lease; long enough for a
heartbeat on a busy machine running several of these at once."""
MODEL_CALLS: Counter[str] = Counter()
"""Model calls this process made, by run id (the scripted models count themselves here)."""


# -- the app side: tools, plan, one run, the fork server -------------------------------------


def crash_app() -> durably.App:
    """The app of a fork server; :func:`execute` sets each command's database."""
    return durably.App(
        "sqlite:///unused.db",
        lease_ttl=timedelta(seconds=LEASE_TTL_S),
        reconcile_grace=timedelta(seconds=0.5),
    )


def latency(campaign: str) -> None:
    draw = random.Random(
        f"{os.environ.get('AGENT_SEED')}:{os.environ.get('CRASH_ROLE')}:{campaign}"
    )
    time.sleep(draw.random() * 0.05)


def coupon_view(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("coupon_id", "customer", "campaign", "code")}


def shop_tools(app: durably.App, url: str | None = None) -> dict[str, durably.Durable[..., Any]]:
    """The tools of :data:`KINDS` on ``app``, by name, at the shop at ``url`` (else
    ``$SHOP_URL`` when called)."""

    def shop() -> str:
        return (url or os.environ["SHOP_URL"]).rstrip("/")

    def order(customer: str, campaign: str) -> dict[str, Any]:
        latency(campaign)
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
        return post_json(f"{shop()}/orders", body, idempotency_key=durably.idempotency_key())

    def coupon(customer: str, campaign: str) -> dict[str, Any]:
        latency(campaign)
        body = {"customer": customer, "campaign": campaign}
        return coupon_view(post_json(f"{shop()}/coupons", body))

    def find_coupon(op: durably.Operation) -> durably.Reconciliation:
        query = urllib.parse.urlencode(
            {"customer": op.arguments["customer"], "campaign": op.arguments["campaign"]}
        )
        found = get_json(f"{shop()}/coupons?{query}")["coupons"]
        if found:
            view = coupon_view(found[0])
            return durably.Reconciliation.succeeded(view, duplicates=len(found) - 1)
        return durably.Reconciliation.not_executed()

    @app.tool(idempotent=True, external_id=lambda r: r["order_id"])
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        return order(customer, campaign)

    @app.tool(reconcile=find_coupon, external_id=lambda r: r["coupon_id"])
    def issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
        """Issue the customer a coupon for the campaign."""
        return coupon(customer, campaign)

    @app.tool(external_id=lambda r: r["coupon_id"])
    def send_coupon(customer: str, campaign: str) -> dict[str, Any]:
        """Send the customer a coupon for the campaign."""
        return coupon(customer, campaign)

    @app.tool(idempotent=True, requires_approval=True, external_id=lambda r: r["order_id"])
    def approved_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer, once a person approves."""
        return order(customer, campaign)

    return {t.definition.name: t for t in (place_order, issue_coupon, send_coupon, approved_order)}


def plan(customer: str, mode: str, tool: str = "place_order") -> dict[str, str]:
    return {"customer": customer, "campaign": CAMPAIGN, "tool": tool, "mode": mode}


def next_calls(plan: dict[str, Any], outputs: list[str]) -> list[dict[str, Any]] | None:
    """The arguments of the tool calls a model at temperature 0 makes next for ``plan``,
    having seen ``outputs``; None when it answers."""
    args = [
        {"customer": plan["customer"], "campaign": f"{plan['campaign']}-{i}"} for i in range(CALLS)
    ]
    if plan["mode"] == "parallel" and not outputs:
        return args
    if plan["mode"] == "sequential" and len(outputs) < CALLS:
        return [args[len(outputs)]]
    return None


def final_answer(outputs: list[str]) -> str:
    return "done: " + " | ".join(outputs)


async def execute(app: durably.App, argv: list[str]) -> dict[str, Any]:
    mode, run_id, workflow, run_input = argv[0], argv[1], argv[2], json.loads(argv[3])
    app.database_url = os.environ["DURABLY_DATABASE_URL"]
    try:
        if mode == "recover":
            await wait_for_lease(app, run_id)
        elif mode != "start":
            raise SystemExit(f"unknown mode {mode!r}")
        run = await app.run_async(workflow, run_id=run_id, **run_input)
    finally:
        await app.close_async()
    return {**run_json(run), "model_calls": MODEL_CALLS[run_id]}


def _child(app: durably.App, command: dict[str, Any]) -> None:
    """In the forked child: redirect output, take the command's environment, run, exit."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's commands are not ours
        for fd, path in ((1, command["stdout"]), (2, command["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.pop("DURABLY_CRASH_AT", None)
        os.environ.update(command["env"])
        print(json.dumps(asyncio.run(execute(app, command["argv"]))), flush=True)
        code = 0
    except SystemExit as exc:
        print(exc, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(app: durably.App) -> None:
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
                    _child(app, command)
                children[pid] = command["id"]
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            done = {"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)}
            print(json.dumps(done), flush=True)


def main(app: durably.App, argv: list[str]) -> None:
    """An app module's ``__main__``: ``serve``, or one command line."""
    if argv == ["serve"]:
        _serve(app)
    else:
        print(json.dumps(asyncio.run(execute(app, argv))), flush=True)


def order_tool(app: durably.App, shop: ShopService) -> durably.Durable[..., Any]:
    """The idempotent ``place_order`` of :func:`shop_tools` on ``app``."""
    return shop_tools(app, shop.url)["place_order"]
