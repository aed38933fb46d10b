"""The reference agent: a quarterly sales report whose tools have real side effects.

The agent reads a region's figures, asks a model to draft a report, then acts on it: it
places a restock order, issues a loyalty coupon and emails the regional lead. It calls the
small shop service of :mod:`durably.demo.shop` over real HTTP, so a crash can land
between an effect happening at the shop and durably recording it — the window this library
exists for.

The three kinds of tool, and what durably does when an outcome is unknown (a crash after
the request left, a timeout):

* **idempotent** (``create_order``, ``send_email``): the service deduplicates by the
  ``Idempotency-Key`` header, so durably re-sends the *same* key and the service answers
  with the original order or message instead of making a second one.
* **reconciled** (``issue_coupon``): the service ignores keys, but it can be asked what
  exists. ``find_coupon`` looks the coupon up by its business key (customer + campaign);
  durably records what it finds, or sends the request again only if nothing is there.
* **neither**: an unknown outcome is never guessed at. The run pauses with its effect
  ``unknown`` until a person checks and runs ``durably resolve``.

Steps (``fetch_sales``, ``draft_report``) are reads and model calls: re-running one costs
time or money but changes nothing outside, and a completed step is never re-run.

Run it against a shop::

    python -m durably.demo.shop --db shop.db --port 8765 &
    export SHOP_URL=http://127.0.0.1:8765
    durably --app durably.demo.sales_report:app start sales_report --input '{"region":"EMEA"}'
    durably --app durably.demo.sales_report:app worker --until-idle

``durably demo`` does all of this for you and kills the worker in the worst window.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

import durably
from durably.demo.shop import ShopHTTPError, get_json, post_json

app = durably.App(os.environ.get("DURABLY_DATABASE_URL", "sqlite:///sales_report.db"))

TOOL_TIMEOUT_S = 2.0
"""Short on purpose: a slow answer becomes an unknown outcome that durably settles safely."""

DRAFT_MODEL = "shop-draft-1"
MODEL_PROFILE = "report-writer/shop-draft-1/temperature-0"
"""The model configuration a recorded model call was made with."""


def shop_url() -> str:
    """The shop's base URL, read at call time so a worker's environment decides it."""
    url = os.environ.get("SHOP_URL", "").rstrip("/")
    if not url:
        raise durably.ConfigurationError(
            "SHOP_URL is not set; start the shop (python -m durably.demo.shop --db shop.db)"
            " and export SHOP_URL=http://127.0.0.1:<port>"
        )
    return url


def classify_http(exc: BaseException) -> durably.FailureCategory | None:
    """A 4xx means the shop looked at the request and refused it: nothing happened.

    A 5xx or a lost answer is left to durably's default (unknown outcome), because the shop
    may have committed the effect before failing to answer.
    """
    if isinstance(exc, ShopHTTPError) and 400 <= exc.status < 500:
        if exc.status == 429:
            return durably.FailureCategory.RATE_LIMIT
        return durably.FailureCategory.PERMANENT_INPUT
    return None


# -- steps: reads and model calls ---------------------------------------------------------


@app.step()
def fetch_sales(region: str) -> dict[str, Any]:
    """The region's quarterly figures."""
    query = urllib.parse.urlencode({"region": region})
    return get_json(f"{shop_url()}/sales?{query}", timeout=TOOL_TIMEOUT_S)


@app.model(
    DRAFT_MODEL, profile=MODEL_PROFILE, usage=lambda answer: {"total_tokens": answer["tokens"]}
)
def draft_report(region: str, figures: dict[str, Any]) -> dict[str, Any]:
    """A model call, recorded as one: its model_call_id, model, profile, the exact input,
    the answer, its tokens (charged to the budget) and its latency, so a recovered run
    reuses this draft instead of paying for (and maybe getting) a different one."""
    prompt = f"Write a short quarterly sales report for {region} from these figures."
    request = {"prompt": prompt, "figures": figures}
    return post_json(f"{shop_url()}/model/draft", request, timeout=TOOL_TIMEOUT_S)


# -- tools: effects at the shop -----------------------------------------------------------


@app.tool(idempotent=True, external_id=lambda r: r["order_id"], classify=classify_http)
def create_order(customer: str, items: list[str], amount: float) -> dict[str, Any]:
    """Idempotent: the shop keeps one order per Idempotency-Key."""
    return post_json(
        f"{shop_url()}/orders",
        {"customer": customer, "items": items, "amount": amount},
        idempotency_key=durably.idempotency_key(),
        timeout=TOOL_TIMEOUT_S,
    )


COUPON_FIELDS = ("coupon_id", "customer", "campaign", "code")


def find_coupon(op: durably.Operation) -> durably.Reconciliation:
    """Ask the shop whether the coupon exists. Customer + campaign is the business key: a
    customer gets one coupon per campaign, so anything found is this operation's coupon."""
    query = urllib.parse.urlencode(
        {"customer": op.arguments["customer"], "campaign": op.arguments["campaign"]}
    )
    found = get_json(f"{shop_url()}/coupons?{query}", timeout=TOOL_TIMEOUT_S)["coupons"]
    if not found:
        return durably.Reconciliation.not_executed()
    # Shaped like issue_coupon's own answer, so the workflow cannot tell the two apart.
    coupon = {k: found[0][k] for k in COUPON_FIELDS}
    return durably.Reconciliation.succeeded(coupon, duplicates=len(found) - 1)


@app.tool(reconcile=find_coupon, external_id=lambda r: r["coupon_id"], classify=classify_http)
def issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
    """Not idempotent: every POST makes a new coupon, so recovery asks find_coupon first."""
    return post_json(
        f"{shop_url()}/coupons",
        {"customer": customer, "campaign": campaign},
        timeout=TOOL_TIMEOUT_S,
    )


@app.tool(idempotent=True, external_id=lambda r: r["message_id"], classify=classify_http)
def send_email(to: str, subject: str, body: str) -> dict[str, Any]:
    """Idempotent: the shop's mailer sends one message per Idempotency-Key."""
    return post_json(
        f"{shop_url()}/emails",
        {"to": to, "subject": subject, "body": body},
        idempotency_key=durably.idempotency_key(),
        timeout=TOOL_TIMEOUT_S,
    )


# -- the workflow -------------------------------------------------------------------------


@app.workflow(version="1")
async def sales_report(region: str) -> dict[str, Any]:
    """Report on a region's quarter and act on it; every effect happens exactly once."""
    figures = await fetch_sales(region)
    draft = await draft_report(region, figures)
    store = f"store-{region.lower()}"
    order = await create_order(
        customer=store,
        items=[figures["top_product"]],
        amount=round(figures["revenue"] * 0.01, 2),
    )
    coupon = await issue_coupon(customer=store, campaign=f"{region}-{figures['quarter']}")
    body = (
        f"{draft['text']}\n\nRestock order {order['order_id']} is placed; "
        f"loyalty coupon {coupon['code']} is issued to {store}."
    )
    mail = await send_email(
        to=f"lead-{region.lower()}@example.com",
        subject=f"{region} sales report, {figures['quarter']}",
        body=body,
    )
    return {
        "region": region,
        "quarter": figures["quarter"],
        "order_id": order["order_id"],
        "coupon_id": coupon["coupon_id"],
        "coupon_code": coupon["code"],
        "message_id": mail["message_id"],
    }
