"""The app that the scale tests' worker processes execute (``tests.scale.scaleapp:app``).

One workflow, ``purchase(customer, campaign)``: a step, then three real effects at the
example shop (``$SHOP_URL``), each through a different kind of external service, then a step:

* ``place_order``: ``idempotent=True``, POST /orders with ``durably.idempotency_key()``; the
  shop deduplicates by that key, so an unknown outcome is settled by re-sending it.
* ``issue_coupon``: POST /coupons, which does **not** deduplicate; ``reconcile=`` asks
  GET /coupons?customer=&campaign= what happened.
* ``send_email``: ``idempotent=True``, POST /emails with the key.

The steps record the pid of the process that executed them, so a test can tell which worker
ran which part of a run. ``$SCALE_TOOL_DELAY`` (seconds) makes every tool sleep that long
before and again after its request: kills and restarts then land inside effects, both before
the request left and after the shop committed it. ``$SHOP_TIMEOUT`` is the HTTP timeout.
The database is ``$DURABLY_DATABASE_URL`` (the CLI's ``--db`` overrides it).
"""

from __future__ import annotations

import os
import time
import urllib.parse
from datetime import timedelta
from typing import Any

import durably
from durably.demo.shop import get_json, post_json

WORKFLOW = "purchase"


def _shop() -> str:
    return os.environ["SHOP_URL"].rstrip("/")


def _timeout() -> float:
    return float(os.environ.get("SHOP_TIMEOUT", "10"))


def _pause() -> None:
    delay = float(os.environ.get("SCALE_TOOL_DELAY", "0"))
    if delay > 0:
        time.sleep(delay)


def email_of(customer: str) -> str:
    return f"{customer}@example.com"


def coupon_view(row: dict[str, Any]) -> dict[str, Any]:
    """A coupon as POST /coupons answers it, from that answer or from a GET /coupons row."""
    return {k: row[k] for k in ("coupon_id", "customer", "campaign", "code")}


def find_coupon(op: durably.Operation) -> durably.Reconciliation:
    """Ask the shop whether the coupon of this operation exists (it has no idempotency key)."""
    query = urllib.parse.urlencode(
        {"customer": op.arguments["customer"], "campaign": op.arguments["campaign"]}
    )
    found = get_json(f"{_shop()}/coupons?{query}", timeout=_timeout())["coupons"]
    if found:
        return durably.Reconciliation.succeeded(coupon_view(found[0]), duplicates=len(found) - 1)
    return durably.Reconciliation.not_executed()


def build(database_url: str | None = None, lease_ttl_s: float = 1.0) -> durably.App:
    """A fresh App with the workflow, its steps and tools registered."""
    app = durably.App(database_url, lease_ttl=timedelta(seconds=lease_ttl_s))

    @app.step()
    def begin(customer: str, campaign: str) -> dict[str, Any]:
        return {"pid": os.getpid(), "customer": customer, "campaign": campaign}

    @app.step()
    def finish(order_id: str, coupon_id: str, message_id: str) -> dict[str, Any]:
        return {"pid": os.getpid(), "ids": [order_id, coupon_id, message_id]}

    @app.tool(idempotent=True, external_id=lambda r: r["order_id"])
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        _pause()
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
        key = durably.idempotency_key()
        order = post_json(f"{_shop()}/orders", body, idempotency_key=key, timeout=_timeout())
        _pause()
        return order

    @app.tool(reconcile=find_coupon, external_id=lambda r: r["coupon_id"])
    def issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
        _pause()
        body = {"customer": customer, "campaign": campaign}
        coupon = coupon_view(post_json(f"{_shop()}/coupons", body, timeout=_timeout()))
        _pause()
        return coupon

    @app.tool(idempotent=True, external_id=lambda r: r["message_id"])
    def send_email(to: str, subject: str, body: str) -> dict[str, Any]:
        _pause()
        mail = {"to": to, "subject": subject, "body": body}
        key = durably.idempotency_key()
        sent = post_json(f"{_shop()}/emails", mail, idempotency_key=key, timeout=_timeout())
        _pause()
        return sent

    @app.workflow(name=WORKFLOW)
    async def purchase(customer: str, campaign: str) -> dict[str, Any]:
        started = await begin(customer, campaign)
        order = await place_order(customer=customer, campaign=campaign)
        coupon = await issue_coupon(customer=customer, campaign=campaign)
        email = await send_email(
            to=email_of(customer),
            subject=f"Your order {order['order_id']}",
            body=f"Thanks! Coupon {coupon['code']} for your next {campaign} order.",
        )
        done = await finish(order["order_id"], coupon["coupon_id"], email["message_id"])
        return {
            "order": order,
            "coupon": coupon,
            "email": email,
            "pids": [started["pid"], done["pid"]],
        }

    return app


app = build(lease_ttl_s=float(os.environ.get("DURABLY_LEASE_TTL", "1")))
