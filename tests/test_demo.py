"""The demo and its reference agent, judged by the shop's own database, not by durably."""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from durably import RunStatus
from durably.demo import sales_report as agent
from durably.demo.shop import ShopService
from durably.demo.walkthrough import run_demo


def shop_counts(db_path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(rows per effect table, requests per "METHOD /path"), straight from the shop's file."""
    with sqlite3.connect(db_path) as db:
        rows = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in EFFECT_TABLES}
        calls = {f"{m} {p}": n for m, p, n in db.execute("SELECT method, path, n FROM requests")}
    return rows, calls


EFFECT_TABLES = ("orders", "coupons", "emails")


def test_demo_crashes_mid_effect_and_every_effect_happens_once(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_demo(workdir=tmp_path, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "killed (exit code 77) at effect.after_call" in text
    assert "Verdict: every effect happened exactly once" in text

    rows, calls = shop_counts(tmp_path / "shop.sqlite3")
    assert rows == {"orders": 1, "coupons": 1, "emails": 1}
    # The coupon was recovered by looking it up, not by sending it again.
    assert calls["POST /coupons"] == 1
    assert calls["GET /coupons"] == 1
    assert calls["POST /orders"] == calls["POST /emails"] == 1
    # Completed steps are reused on recovery: the model is not paid twice.
    assert calls["GET /sales"] == calls["POST /model/draft"] == 1
    recorded = json.loads((tmp_path / "shop-effects.json").read_text())
    assert [len(recorded[t]) for t in EFFECT_TABLES] == [1, 1, 1]


@pytest.fixture
def shop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ShopService]:
    """A fresh shop, and the example app pointed at a fresh database for this test."""
    agent.app.close()
    monkeypatch.setattr(agent.app, "database_url", f"sqlite:///{tmp_path}/agent.db")
    with ShopService(tmp_path / "shop.sqlite3") as svc:
        monkeypatch.setenv("SHOP_URL", svc.url)
        yield svc
    agent.app.close()


def test_sales_report_completes_in_process(shop: ShopService) -> None:
    run = agent.app.run(agent.sales_report, "EMEA")
    assert run.status is RunStatus.COMPLETED, run.error
    assert run.result["order_id"] == "ord_1"
    assert run.result["coupon_id"] == "cpn_1"
    assert run.result["message_id"] == "msg_1"
    assert shop.effects()["emails"][0]["request"]["to"] == "lead-emea@example.com"

    doc = agent.app.describe(run.run_id)
    [draft] = doc["model_calls"]
    assert draft["model_call_id"].startswith("mc_")
    assert (draft["model"], draft["model_profile"]) == (agent.DRAFT_MODEL, agent.MODEL_PROFILE)
    assert draft["input"]["region"] == "EMEA"
    assert draft["usage"]["total_tokens"] == draft["output"]["tokens"] > 0
    external = {e["tool"]: e["external_operation_id"] for e in doc["effects"]}
    assert external == {"create_order": "ord_1", "issue_coupon": "cpn_1", "send_email": "msg_1"}


def test_lost_answers_are_settled_without_duplicates(shop: ShopService) -> None:
    # The shop commits, then the answer is lost: an unknown outcome for both kinds of tool.
    shop.add_fault("/orders", "drop_after_commit")
    shop.add_fault("/coupons", "drop_after_commit")
    run = agent.app.run(agent.sales_report, "APAC")
    assert run.status is RunStatus.COMPLETED, run.error

    rows, calls = shop_counts(shop.db_path or Path())
    assert rows == {"orders": 1, "coupons": 1, "emails": 1}
    assert calls["POST /orders"] == 2  # re-sent under the same key; the shop replayed it
    assert calls["POST /coupons"] == 1  # never re-sent: find_coupon found it
    assert calls["GET /coupons"] == 1
