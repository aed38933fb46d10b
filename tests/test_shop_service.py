"""The example shop service, exercised over real HTTP against a real subprocess."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durably.demo.shop import ShopHTTPError, ShopService, get_json, post_json

ORDER = {"customer": "ada", "items": [{"sku": "grinder", "qty": 1}], "amount": 129.5}
COUPON = {"customer": "ada", "campaign": "spring"}
EMAIL = {"to": "ada@example.com", "subject": "Thanks", "body": "Your order shipped."}


@pytest.fixture(scope="module")
def service() -> Iterator[ShopService]:
    with ShopService() as svc:
        yield svc


@pytest.fixture
def shop(service: ShopService) -> ShopService:
    service.reset()
    return service


def test_health_and_deterministic_sales(shop: ShopService) -> None:
    assert get_json(f"{shop.url}/health") == {"ok": True}
    first = get_json(f"{shop.url}/sales?region=EMEA")
    assert first == get_json(f"{shop.url}/sales?region=EMEA")
    assert first["region"] == "EMEA"
    assert first["quarter"] == "2026-Q3"
    assert isinstance(first["revenue"], int)
    assert first["revenue"] != get_json(f"{shop.url}/sales?region=APAC")["revenue"]
    with pytest.raises(ShopHTTPError) as info:
        get_json(f"{shop.url}/sales")
    assert info.value.status == 400


def test_model_draft_is_deterministic(shop: ShopService) -> None:
    figures = get_json(f"{shop.url}/sales?region=EMEA")
    body = {"prompt": "Summarise the quarter", "figures": figures}
    draft = post_json(f"{shop.url}/model/draft", body)
    assert draft == post_json(f"{shop.url}/model/draft", body)
    assert draft["model"] == "shop-draft-1"
    assert "EMEA" in draft["text"]
    assert f"{figures['revenue']:,}" in draft["text"]
    assert draft["tokens"] > 0


@pytest.mark.parametrize(("path", "body", "id_field"), [
    ("/orders", ORDER, "order_id"),
    ("/emails", EMAIL, "message_id"),
])  # fmt: skip
def test_idempotent_endpoints_replay_and_conflict(
    shop: ShopService, path: str, body: dict[str, Any], id_field: str
) -> None:
    url = f"{shop.url}{path}"
    first = post_json(url, body, idempotency_key="k-1")
    assert first["replayed"] is False
    again = post_json(url, dict(reversed(list(body.items()))), idempotency_key="k-1")
    assert again["replayed"] is True
    assert again[id_field] == first[id_field]

    with pytest.raises(ShopHTTPError) as info:
        post_json(url, {**body, "to": "eve@example.com", "customer": "eve"}, idempotency_key="k-1")
    assert info.value.status == 409
    assert info.value.body == {"error": "idempotency key reused with a different request"}

    with pytest.raises(ShopHTTPError) as info:
        post_json(url, body)
    assert info.value.status == 400

    second = post_json(url, body, idempotency_key="k-2")
    assert second[id_field] != first[id_field]
    rows = shop.effects()[path.lstrip("/")]
    assert [r["idempotency_key"] for r in rows] == ["k-1", "k-2"]
    assert rows[0]["request"] == body
    assert rows[0]["created_at"]


def test_orders_and_emails_responses(shop: ShopService) -> None:
    order = post_json(f"{shop.url}/orders", ORDER, idempotency_key="o")
    assert order["order_id"].startswith("ord_")
    assert (order["customer"], order["amount"]) == ("ada", 129.5)
    email = post_json(f"{shop.url}/emails", EMAIL, idempotency_key="e")
    assert email["message_id"].startswith("msg_")
    assert email["to"] == "ada@example.com"
    listed = get_json(f"{shop.url}/emails?to=ada@example.com")["emails"]
    assert [m["message_id"] for m in listed] == [email["message_id"]]
    assert get_json(f"{shop.url}/emails?to=nobody@example.com") == {"emails": []}


def test_coupons_duplicate_even_with_the_same_key(shop: ShopService) -> None:
    a = post_json(f"{shop.url}/coupons", COUPON, idempotency_key="same")
    b = post_json(f"{shop.url}/coupons", COUPON, idempotency_key="same")
    post_json(f"{shop.url}/coupons", {"customer": "bob", "campaign": "spring"})
    assert a["coupon_id"] != b["coupon_id"]
    assert a["code"] != b["code"]

    found = get_json(f"{shop.url}/coupons?customer=ada&campaign=spring")["coupons"]
    assert [c["coupon_id"] for c in found] == [a["coupon_id"], b["coupon_id"]]
    assert {c["idempotency_key"] for c in found} == {"same"}
    assert get_json(f"{shop.url}/coupons?customer=ada&campaign=autumn") == {"coupons": []}
    rows = shop.effects()["coupons"]
    assert [r["idempotency_key"] for r in rows] == ["same", "same", None]


def test_reject_before_performs_nothing(shop: ShopService) -> None:
    shop.add_fault("/orders", "reject_before")
    with pytest.raises(ShopHTTPError) as info:
        post_json(f"{shop.url}/orders", ORDER, idempotency_key="r")
    assert (info.value.status, info.value.body) == (503, {"error": "unavailable"})
    assert shop.effects()["orders"] == []
    assert post_json(f"{shop.url}/orders", ORDER, idempotency_key="r")["replayed"] is False
    assert len(shop.effects()["orders"]) == 1


def test_delay_after_commit_times_out_but_the_effect_happened(shop: ShopService) -> None:
    shop.add_fault("/orders", "delay_after_commit", seconds=1.5)
    with pytest.raises(TimeoutError):
        post_json(f"{shop.url}/orders", ORDER, idempotency_key="d", timeout=0.3)
    assert [r["idempotency_key"] for r in shop.effects()["orders"]] == ["d"]
    # The caller's retry with the same key learns the outcome instead of ordering twice.
    retry = post_json(f"{shop.url}/orders", ORDER, idempotency_key="d")
    assert retry["replayed"] is True
    assert len(shop.effects()["orders"]) == 1


def test_drop_after_commit_disconnects_but_the_effect_happened(shop: ShopService) -> None:
    shop.add_fault("/coupons", "drop_after_commit")
    with pytest.raises(http.client.RemoteDisconnected) as info:
        post_json(f"{shop.url}/coupons", COUPON, idempotency_key="x")
    assert isinstance(info.value, ConnectionResetError)
    assert len(get_json(f"{shop.url}/coupons?customer=ada&campaign=spring")["coupons"]) == 1
    # A blind retry on a non-idempotent endpoint duplicates the effect.
    post_json(f"{shop.url}/coupons", COUPON, idempotency_key="x")
    assert len(shop.effects()["coupons"]) == 2


def test_sales_fault_applies_to_get(shop: ShopService) -> None:
    shop.add_fault("/sales", "reject_before", times=2)
    for _ in range(2):
        with pytest.raises(ShopHTTPError):
            get_json(f"{shop.url}/sales?region=EMEA")
    assert get_json(f"{shop.url}/sales?region=EMEA")["region"] == "EMEA"


def test_fault_consumption_is_atomic(shop: ShopService) -> None:
    shop.add_fault("/coupons", "reject_before", times=1)
    outcomes: list[int] = []
    lock = threading.Lock()

    def call() -> None:
        try:
            post_json(f"{shop.url}/coupons", COUPON)
            status = 201
        except ShopHTTPError as exc:
            status = exc.status
        with lock:
            outcomes.append(status)

    threads = [threading.Thread(target=call) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == [201] * 11 + [503]
    assert len(shop.effects()["coupons"]) == 11


def test_concurrent_retries_with_one_key_create_one_order(shop: ShopService) -> None:
    replayed: list[bool] = []

    def call() -> None:
        replayed.append(post_json(f"{shop.url}/orders", ORDER, idempotency_key="race")["replayed"])

    threads = [threading.Thread(target=call) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(replayed) == [False] + [True] * 9
    assert len(shop.effects()["orders"]) == 1


def test_clear_faults(shop: ShopService) -> None:
    shop.add_fault("/emails", "reject_before", times=5)
    shop.clear_faults()
    assert post_json(f"{shop.url}/emails", EMAIL, idempotency_key="c")["replayed"] is False
    with pytest.raises(ShopHTTPError) as info:
        shop.add_fault("/health", "reject_before")
    assert info.value.status == 400


def test_request_counts_include_replays_and_faults(shop: ShopService) -> None:
    shop.add_fault("/orders", "reject_before")
    with pytest.raises(ShopHTTPError):
        post_json(f"{shop.url}/orders", ORDER, idempotency_key="n")
    post_json(f"{shop.url}/orders", ORDER, idempotency_key="n")
    post_json(f"{shop.url}/orders", ORDER, idempotency_key="n")
    post_json(f"{shop.url}/coupons", COUPON)
    get_json(f"{shop.url}/coupons?customer=ada&campaign=spring")
    get_json(f"{shop.url}/sales?region=EMEA")
    effects = shop.effects()
    assert effects["requests"] == {
        "/orders": 3, "/coupons": 2, "/emails": 0, "/sales": 1, "/model/draft": 0,
    }  # fmt: skip
    assert effects["requests_by_method"]["POST /coupons"] == 1
    assert effects["requests_by_method"]["GET /coupons"] == 1
    assert len(effects["orders"]) == 1


def test_unknown_route(shop: ShopService) -> None:
    with pytest.raises(ShopHTTPError) as info:
        get_json(f"{shop.url}/nope")
    assert info.value.status == 404
    with pytest.raises(ShopHTTPError) as info:
        get_json(f"{shop.url}/orders")
    assert info.value.status == 405


def test_attach_shares_the_running_service(shop: ShopService) -> None:
    post_json(f"{shop.url}/coupons", COUPON)
    attached = ShopService.attach(shop.url + "/")
    assert attached.pid is None
    assert len(attached.effects()["coupons"]) == 1
    attached.stop()
    assert get_json(f"{shop.url}/health") == {"ok": True}


def test_effects_survive_a_restart_on_the_same_db(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    with ShopService(db) as first:
        post_json(f"{first.url}/orders", ORDER, idempotency_key="p")
    with ShopService(db) as second:
        assert second.db_path == db
        assert post_json(f"{second.url}/orders", ORDER, idempotency_key="p")["replayed"] is True
        assert len(second.effects()["orders"]) == 1


def test_stop_leaves_nothing_running() -> None:
    svc = ShopService()
    pid, url, db_path = svc.pid, svc.url, svc.db_path
    assert pid is not None
    assert db_path is not None
    assert db_path.exists()
    svc.stop()
    svc.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not db_path.parent.exists()
    with pytest.raises(ConnectionRefusedError):
        get_json(f"{url}/health", timeout=1.0)


def test_cli_prints_listening_line_and_port_file(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "durably.demo.shop", "--db", str(tmp_path / "s.db")]
    cmd += ["--port", "0", "--port-file", str(port_file)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            match = re.fullmatch(r"listening on http://127\.0\.0\.1:(\d+)", line)
            assert match is not None, line
            assert port_file.read_text().strip() == match.group(1)
            assert get_json(f"http://127.0.0.1:{match.group(1)}/health") == {"ok": True}
        finally:
            proc.terminate()
            assert proc.wait(timeout=10) == 0
