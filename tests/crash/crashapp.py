"""The app the crash tests execute in a real subprocess (driven by ``tests.crash.runner``).

Every tool makes exactly one real effect at the example shop (``$SHOP_URL``), each of a
different kind of external service:

* ``idem_tool``: ``idempotent=True``, POST /orders with ``durably.idempotency_key()``; the shop
  deduplicates by that key, so an unknown outcome is settled by re-sending it.
* ``reconciled_tool``: POST /coupons (no deduplication) with ``reconcile=`` asking
  GET /coupons?customer=&campaign= what happened.
* ``plain_tool``: POST /coupons with neither: an unknown outcome must go to a person.
* ``idem_tool`` and ``plain_tool`` have a sandbox, ``rehearse``: the shop records an email
  "sandbox <campaign>" per call in place of the effect.
* ``classified_tool``: like ``plain_tool`` but classifies the shop's 503 (answered before any
  effect is written) as ``TRANSIENT_BEFORE_SEND``.

* ``garbled_tool``: ``idem_tool`` whose result holds a lone surrogate (workflow
  ``garbled_once``): it takes effect, but no store can hold what it returns.
* ``approved_tool``: ``idem_tool`` with ``requires_approval=True``: each call waits for a
  person's approval bound to it before it may POST /orders (workflow ``approved_once``;
  ``approved_together`` makes a step, then three calls at once, under step ids ``call_<i>``).

Workflows ``<kind>_once`` run a step, the tool once, a step, and return the tool's result;
``<kind>_twice`` call the tool twice (campaigns ``<campaign>-1`` and ``<campaign>-2``).
``<kind>_parallel`` make a step, then three calls of the tool at once, each under the step id
``call_<i>`` (as an agent framework passes the model's tool call ids; campaigns
``<campaign>-<i>``), each started after a random latency drawn from ``seed`` and the
process's role (``$CRASH_ROLE``), so a recovery reaches them in another order.
``<kind>_race`` start the same three calls, take the first answer and cancel the others:
call_0 is made once the shop holds the others' effects (the test holds their answers back);
in a recovery the others are slower to start, so they are cancelled before they call again.
Configuration: ``$DURABLY_DATABASE_URL``, ``$SHOP_URL``, ``$SHOP_TIMEOUT`` (the tools' HTTP
client timeout, seconds) and ``$CRASH_LEASE_TTL`` (seconds).
"""

from __future__ import annotations

import asyncio
import os
import random
import urllib.parse
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import durably
from durably.demo.shop import ShopHTTPError, get_json, post_json

LEASE_TTL_S = float(os.environ.get("CRASH_LEASE_TTL", "0.5"))

app = durably.App(
    lease_ttl=timedelta(seconds=LEASE_TTL_S), reconcile_grace=timedelta(seconds=LEASE_TTL_S)
)


def _shop() -> str:
    return os.environ["SHOP_URL"].rstrip("/")


def _timeout() -> float:
    return float(os.environ.get("SHOP_TIMEOUT", "5"))


def coupon_view(row: dict[str, Any]) -> dict[str, Any]:
    """A coupon as POST /coupons answers it, from that answer or from a GET /coupons row."""
    return {k: row[k] for k in ("coupon_id", "customer", "campaign", "code")}


def order_body(customer: str, campaign: str) -> dict[str, Any]:
    return {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}


# -- steps ------------------------------------------------------------------------------


@app.step()
def begin(customer: str, campaign: str) -> dict[str, str]:
    return {"customer": customer, "campaign": campaign}


@app.step()
def finish(effect: dict[str, Any]) -> dict[str, Any]:
    return {"recorded": effect.get("order_id") or effect.get("coupon_id")}


# -- tools ------------------------------------------------------------------------------


def withdraw(op: durably.Operation) -> dict[str, Any]:
    """The compensation of every race tool: the shop records a withdrawal notice, one per
    effect undone (the tests count them)."""
    body = {"to": op.arguments["customer"], "subject": f"withdrawn {op.step_id}", "body": ""}
    return post_json(
        f"{_shop()}/emails", body, idempotency_key=durably.idempotency_key(), timeout=_timeout()
    )


def rehearse(customer: str, campaign: str) -> dict[str, Any]:
    """The sandbox of ``idem_tool`` and ``plain_tool`` (a ``SANDBOX`` fork calls it instead):
    the shop records a notice, one per call, in place of the effect (the tests count them)."""
    body = {"to": customer, "subject": f"sandbox {campaign}", "body": ""}
    key = durably.idempotency_key()
    post_json(f"{_shop()}/emails", body, idempotency_key=key, timeout=_timeout())
    return {"sandbox": True, "customer": customer, "campaign": campaign}


def _place_order(customer: str, campaign: str) -> dict[str, Any]:
    return post_json(
        f"{_shop()}/orders",
        order_body(customer, campaign),
        idempotency_key=durably.idempotency_key(),
        timeout=_timeout(),
    )


@app.tool(
    idempotent=True, external_id=lambda r: r["order_id"], compensate=withdraw, sandbox=rehearse
)
def idem_tool(customer: str, campaign: str) -> dict[str, Any]:
    return _place_order(customer, campaign)


@app.tool(idempotent=True)
def garbled_tool(customer: str, campaign: str) -> dict[str, Any]:
    """``idem_tool`` whose answer arrives cut in the middle of a character: the order is
    placed, but the result holds a lone surrogate that no store can hold."""
    return {**_place_order(customer, campaign), "memo": "Thanks \ud83d"}


@app.tool(idempotent=True, requires_approval=True, external_id=lambda r: r["order_id"])
def approved_tool(customer: str, campaign: str) -> dict[str, Any]:
    return _place_order(customer, campaign)


def find_coupon(op: durably.Operation) -> durably.Reconciliation:
    query = urllib.parse.urlencode(
        {"customer": op.arguments["customer"], "campaign": op.arguments["campaign"]}
    )
    found = get_json(f"{_shop()}/coupons?{query}", timeout=_timeout())["coupons"]
    durably.crash_point("find_coupon.answered")  # a tool's own crash point
    if found:
        return durably.Reconciliation.succeeded(coupon_view(found[0]), duplicates=len(found) - 1)
    return durably.Reconciliation.not_executed()


def _issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
    body = {"customer": customer, "campaign": campaign}
    return coupon_view(post_json(f"{_shop()}/coupons", body, timeout=_timeout()))


@app.tool(reconcile=find_coupon, external_id=lambda r: r["coupon_id"], compensate=withdraw)
def reconciled_tool(customer: str, campaign: str) -> dict[str, Any]:
    return _issue_coupon(customer, campaign)


@app.tool(external_id=lambda r: r["coupon_id"], compensate=withdraw, sandbox=rehearse)
def plain_tool(customer: str, campaign: str) -> dict[str, Any]:
    return _issue_coupon(customer, campaign)


def rejected_before_acting(exc: BaseException) -> durably.FailureCategory | None:
    """This shop answers 503 only before it writes anything: nothing took effect."""
    if isinstance(exc, ShopHTTPError) and exc.status == 503:
        return durably.FailureCategory.TRANSIENT_BEFORE_SEND
    return None


@app.tool(classify=rejected_before_acting, external_id=lambda r: r["coupon_id"])
def classified_tool(customer: str, campaign: str) -> dict[str, Any]:
    return _issue_coupon(customer, campaign)


TOOLS: dict[str, durably.Durable[..., dict[str, Any]]] = {
    "idempotent": idem_tool,
    "reconciled": reconciled_tool,
    "neither": plain_tool,
    "classified": classified_tool,
}


# -- workflows --------------------------------------------------------------------------


def _once(tool: durably.Durable[..., dict[str, Any]]) -> Callable[..., Awaitable[Any]]:
    async def once(customer: str, campaign: str) -> dict[str, Any]:
        await begin(customer, campaign)
        effect = await tool(customer=customer, campaign=campaign)
        await finish(effect)
        return effect

    return once


def _twice(tool: durably.Durable[..., dict[str, Any]]) -> Callable[..., Awaitable[Any]]:
    async def twice(customer: str, campaign: str) -> list[dict[str, Any]]:
        await begin(customer, campaign)
        first = await tool(customer=customer, campaign=f"{campaign}-1")
        second = await tool(customer=customer, campaign=f"{campaign}-2")
        await finish(second)
        return [first, second]

    return twice


def _parallel(tool: durably.Durable[..., dict[str, Any]]) -> Callable[..., Awaitable[Any]]:
    async def parallel(customer: str, campaign: str, seed: int) -> list[dict[str, Any]]:
        await begin(customer, campaign)
        latency = random.Random(f"{seed}:{os.environ.get('CRASH_ROLE')}")
        delays = [latency.random() * 0.05 for _ in range(PARALLEL_CALLS)]

        async def one(i: int) -> dict[str, Any]:
            await asyncio.sleep(delays[i])
            call = tool.with_step_id(f"call_{i}")
            return await call(customer=customer, campaign=f"{campaign}-{i}")

        effects = await asyncio.gather(*(one(i) for i in range(PARALLEL_CALLS)))
        await finish(effects[0])
        return effects

    return parallel


async def _until_the_shop_holds(customer: str, effects: int) -> None:
    """Wait until the shop has committed ``effects`` effects for ``customer``."""
    for _ in range(500):
        shown = await asyncio.to_thread(get_json, f"{_shop()}/effects", timeout=_timeout())
        rows = shown["orders"] + shown["coupons"]
        if sum(row["request"]["customer"] == customer for row in rows) >= effects:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"the shop never held {effects} effects for {customer}")


def _race(tool: durably.Durable[..., dict[str, Any]]) -> Callable[..., Awaitable[Any]]:
    async def race(customer: str, campaign: str) -> dict[str, Any]:
        await begin(customer, campaign)
        # Ask three at once, take whichever answers first, cancel the others. The first
        # process asks call_0 once the others' effects stand at the shop (whose answers the
        # test holds back): call_0 answers first. A recovery is slower to reach the others,
        # so it cancels them before they call again.
        first_process = os.environ.get("CRASH_ROLE") == "start"

        async def one(i: int) -> dict[str, Any]:
            if i == 0 and first_process:
                await _until_the_shop_holds(customer, PARALLEL_CALLS - 1)
            elif i and not first_process:
                await asyncio.sleep(0.5)
            call = tool.with_step_id(f"call_{i}")
            return await call(customer=customer, campaign=f"{campaign}-{i}")

        tasks = [asyncio.ensure_future(one(i)) for i in range(PARALLEL_CALLS)]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        first = next(iter(done)).result()
        await finish(first)
        return first

    return race


PARALLEL_CALLS = 3
for _kind, _tool in TOOLS.items():
    app.workflow(name=f"{_kind}_once")(_once(_tool))
    app.workflow(name=f"{_kind}_twice")(_twice(_tool))
    app.workflow(name=f"{_kind}_parallel")(_parallel(_tool))
    app.workflow(name=f"{_kind}_race")(_race(_tool))
app.workflow(name="approved_once")(_once(approved_tool))


@app.workflow(name="approved_together")
async def approved_together(customer: str, campaign: str) -> list[dict[str, Any]]:
    await begin(customer, campaign)
    calls = [
        approved_tool.with_step_id(f"call_{i}")(customer=customer, campaign=f"{campaign}-{i}")
        for i in range(PARALLEL_CALLS)
    ]
    effects = await asyncio.gather(*calls)
    await finish(effects[0])
    return effects


app.workflow(name="garbled_once")(_once(garbled_tool))


# -- a long run of steps, checkpointed periodically ---------------------------------------

STEP_LOG_ENV = "CRASH_STEP_LOG"
"""A file each execution of ``tick`` appends its index to (one ``O_APPEND`` write)."""


@app.step()
def tick(i: int) -> dict[str, Any]:
    path = os.environ.get(STEP_LOG_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{i}\n".encode())
        finally:
            os.close(fd)
    return {"i": i, "square": i * i}


@app.workflow(name="long_steps")
async def long_steps(n: int) -> int:
    return sum([(await tick(i))["square"] for i in range(1, n + 1)])
