"""The web console, end to end: a real uvicorn server, a real SQLite app, a real browser.

The console only reads; every button goes through the JSON API. These tests click them in
Chromium (Playwright) and check the runs really move: an approval granted from the page lets
a worker finish the run; an UNKNOWN effect resolved from the page lets Resume finish it.

``DURABLY_UPDATE_SCREENSHOT=1`` also refreshes ``docs/console.png``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from playwright.sync_api import Page, expect

import durably
from durably.server import create_server
from tests.server.browser import OffLoop

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "console.png"


def build_app(url: str, calls: dict[str, int]) -> durably.App:
    """The app under test; the server and the test each build one over the same database."""
    app = durably.App(url, lease_ttl=timedelta(seconds=5))

    @app.tool(requires_approval=True, idempotent=True)
    def send_email(to: str, subject: str, body: str) -> dict[str, Any]:
        return {"message_id": f"msg-{to}"}

    @app.tool()
    def charge_card(customer: str, amount: int) -> dict[str, Any]:
        # Neither idempotent nor reconcilable: a timeout leaves the outcome unknown.
        calls["charge_card"] = calls.get("charge_card", 0) + 1
        if calls["charge_card"] == 1:
            raise TimeoutError("payment gateway did not answer")
        return {"charge_id": f"ch-{customer}"}

    @app.model("scripted-4o", profile="triage-v2")
    def triage(messages: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "text": "I will refund it.",
            "tool_calls": [{"id": "call_7", "name": "refund", "args": {"order": "o-7"}}],
            "usage": {"input_tokens": 42, "output_tokens": 9},
        }

    @app.tool(idempotent=True)
    def refund(order: str) -> dict[str, Any]:
        return {"refund_id": f"rf-{order}"}

    @app.workflow(version="1")
    async def support(question: str) -> Any:
        answer = await triage([{"role": "user", "content": question}])
        [call] = answer["tool_calls"]
        return await refund.with_step_id(call["id"])(**call["args"])

    @app.workflow(version="1")
    async def mail_report(to: str) -> dict[str, Any]:
        sent: dict[str, Any] = await send_email(to=to, subject="Q3 sales", body="EMEA up 12%")
        return sent

    @app.workflow(version="1")
    async def checkout(customer: str) -> dict[str, Any]:
        charged: dict[str, Any] = await charge_card(customer=customer, amount=4200)
        return charged

    return app


@dataclass
class Console:
    url: str
    app: OffLoop


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    url = f"sqlite:///{tmp_path}/durably.db"
    calls: dict[str, int] = {}
    app = build_app(url, calls)
    served = build_app(url, calls)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_server(served), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="console-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        assert time.monotonic() < deadline, "uvicorn did not start in time"
        time.sleep(0.02)
    try:
        yield Console(f"http://127.0.0.1:{port}", OffLoop(app))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        with ThreadPoolExecutor(1) as pool:  # not on Playwright's running loop
            pool.submit(app.close).result()
            # The server's App opened its store on uvicorn's (now closed) loop.
            pool.submit(asyncio.run, served.close_async()).result()


def test_approve_from_the_page_and_the_run_completes(console: Console, page: Page) -> None:
    app = console.app
    run = app.run("mail_report", to="lead@example.com")
    assert run.status == durably.RunStatus.WAITING_APPROVAL

    page.goto(console.url + "/")
    row = page.locator("tr", has=page.locator(f"a[href='/runs/{run.run_id}']"))
    expect(row).to_have_class(re.compile(r"\battention\b"))
    expect(row).to_contain_text("waiting_approval")
    row.locator("a").click()

    expect(page.locator("#run-status")).to_have_text("waiting_approval")
    card = page.locator(".approvals-pending")
    expect(card.locator("code.tool")).to_have_text("send_email")
    payload = card.locator(".approval-payload")
    expect(payload).to_contain_text('"to": "lead@example.com"')
    expect(payload).to_contain_text('"subject": "Q3 sales"')
    expect(card.locator(".expires")).to_contain_text("UTC")

    card.locator("input[name=by]").fill("alice")
    card.locator("input[name=comment]").fill("looks right")
    card.get_by_role("button", name="Approve").click()
    expect(page.locator(".approvals-pending")).to_have_count(0)
    expect(page.locator("table", has_text="alice")).to_contain_text("approved")

    assert app.work_until_idle() >= 1
    page.reload()
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator(".run-head")).to_contain_text("msg-lead@example.com")
    assert app.get_run(run.run_id).status == durably.RunStatus.COMPLETED


def test_resolve_an_unknown_effect_then_resume(
    console: Console, page: Page, tmp_path: Path
) -> None:
    app = console.app
    run = app.run("checkout", customer="c-7")
    assert run.status == durably.RunStatus.PAUSED
    assert run.status_reason == "effect_state_unknown"

    page.goto(console.url + "/?status=paused")
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    page.locator(f"a[href='/runs/{run.run_id}']").click()

    banner = page.locator("#attention-banner")
    expect(banner).to_contain_text("UNKNOWN")
    expect(banner).to_contain_text("charge_card")
    key = app.describe(run.run_id)["effects"][0]["idempotency_key"]
    expect(banner).to_contain_text(key)
    expect(page.locator("table.effects td[title='" + key + "']")).to_have_count(1)

    shot = tmp_path / "console.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DURABLY_UPDATE_SCREENSHOT"):
        shutil.copyfile(shot, DOCS_SCREENSHOT)

    form = page.locator("form.resolve-form")
    form.locator("textarea[name=result]").fill("{not json")
    form.get_by_role("button", name="Record outcome").click()
    expect(form.locator(".form-error")).to_contain_text("not valid JSON")

    form.locator("input[value=succeeded]").check()
    form.locator("textarea[name=result]").fill('{"charge_id": "ch-found-by-hand"}')
    form.locator("input[name=by]").fill("bob")
    form.get_by_role("button", name="Record outcome").click()
    expect(page.locator("form.resolve-form")).to_have_count(0)
    expect(page.locator("#attention-banner")).to_have_count(0)

    page.get_by_role("button", name="Resume").click()
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator(".run-head")).to_contain_text("ch-found-by-hand")
    done = app.get_run(run.run_id)
    assert done.status == durably.RunStatus.COMPLETED
    assert done.result == {"charge_id": "ch-found-by-hand"}


def test_pause_and_unpause_a_waiting_run_from_its_page(console: Console, page: Page) -> None:
    """Paused from the page, the run waits for nothing until unpaused; unpaused, a worker
    puts it back in the same wait for the same approval."""
    app = console.app
    run = app.run("mail_report", to="lead@example.com")
    (approval,) = app.describe(run.run_id)["approvals"]

    page.goto(f"{console.url}/runs/{run.run_id}")
    page.locator("form[data-kind=pause] input[name=reason]").fill("customer called")
    page.get_by_role("button", name="Pause", exact=True).click()
    expect(page.locator("#run-status")).to_have_text("paused")
    banner = page.locator("#attention-banner")
    expect(banner).to_contain_text("operator_pause")
    expect(banner).to_contain_text("paused by operator: customer called")
    expect(page.locator("#pause-button")).to_have_count(0)
    assert app.work_until_idle() == 0  # paused: no worker takes it

    page.get_by_role("button", name="Unpause").click()
    expect(page.locator("#run-status")).to_have_text("queued")
    expect(page.locator("#pause-button")).to_have_count(1)
    assert app.work_until_idle() == 1
    page.reload()
    expect(page.locator("#run-status")).to_have_text("waiting_approval")
    (again,) = app.describe(run.run_id)["approvals"]
    assert again["approval_id"] == approval["approval_id"]

    page.get_by_role("button", name="Pause", exact=True).click()
    expect(page.locator("#run-status")).to_have_text("paused")
    app.unpause(run.run_id)  # behind the page's back: its Unpause now fails, shown inline
    page.get_by_role("button", name="Unpause").click()
    expect(page.locator("form[data-kind=unpause] .form-error")).to_contain_text(
        "nothing to unpause"
    )


def test_fork_a_finished_run_from_its_page(console: Console, page: Page) -> None:
    """A completed run forked with its recorded answers: the page goes to the fork, which a
    worker then completes without sending anything again."""
    app = console.app
    run = app.run("mail_report", to="lead@example.com")
    app.approve(run.run_id, by="alice")
    assert app.resume(run.run_id).status == durably.RunStatus.COMPLETED

    page.goto(f"{console.url}/runs/{run.run_id}")
    form = page.locator("form.fork-form")
    form.locator("select[name=replay]").select_option("RECORDED")
    form.get_by_role("button", name="Fork run").click()
    expect(page.locator("#run-status")).to_have_text("queued")
    forked = page.locator("h1").inner_text()
    assert forked != run.run_id
    assert app.work_until_idle() == 1
    page.reload()
    expect(page.locator("#run-status")).to_have_text("completed")
    assert app.get_run(forked).result == {"message_id": "msg-lead@example.com"}

    page.goto(f"{console.url}/runs/{run.run_id}")
    page.locator("form.fork-form input[name=at]").fill("nope#1")
    page.get_by_role("button", name="Fork run").click()
    expect(page.locator("form.fork-form .form-error")).to_contain_text("no settled step")


def test_a_model_call_shows_its_prompt_answer_and_the_effect_it_asked_for(
    console: Console, page: Page
) -> None:
    question = "refund o-7 <script>window.owned = 1</script>"
    run = console.app.run("support", question=question)
    assert run.status == durably.RunStatus.COMPLETED

    page.goto(f"{console.url}/runs/{run.run_id}")
    calls = page.locator("table.model-calls")
    expect(calls).to_contain_text("scripted-4o")
    expect(calls).to_contain_text("triage-v2")
    expect(calls).to_contain_text("42 / 9")
    expect(calls).to_contain_text("call_7")
    calls.locator("summary").click()
    # The prompt is shown as text, never obeyed.
    expect(calls.locator(".model-input")).to_contain_text(question)
    assert page.evaluate("window.owned") is None
    expect(calls.locator(".model-output")).to_contain_text("I will refund it.")
    link = page.locator("table.effects a", has_text="asked by")
    link.click()
    model_call_id = console.app.describe(run.run_id)["model_calls"][0]["model_call_id"]
    assert page.url.endswith("#" + model_call_id)


def test_api_errors_are_shown_inline(console: Console, page: Page) -> None:
    app = console.app
    run = app.run("mail_report", to="ops@example.com")
    page.goto(f"{console.url}/runs/{run.run_id}")
    expect(page.locator(".approvals-pending")).to_have_count(1)
    app.reject(run.run_id, by="someone-else")  # decided behind the page's back

    page.get_by_role("button", name="Approve").click()
    error = page.locator(".approval-form .form-error")
    expect(error).not_to_be_empty()
    expect(page.get_by_role("button", name="Approve")).to_be_enabled()


def test_unknown_run_is_a_404_page(console: Console, page: Page) -> None:
    response = page.goto(console.url + "/runs/run_nope")
    assert response is not None
    assert response.status == 404
    expect(page.locator("h1")).to_have_text("Run not found")
    expect(page.locator("main")).to_contain_text("run_nope")


def test_runs_list_filters_and_refreshes(console: Console, page: Page) -> None:
    app = console.app
    paused = app.run("checkout", customer="c-1")
    page.goto(console.url + "/?workflow=checkout")
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    expect(page.locator("table.runs")).to_contain_text(paused.run_id)

    waiting = app.run("mail_report", to="x@example.com")  # appears without a reload
    page.goto(console.url + "/")
    expect(page.locator("table.runs tbody tr").first).to_contain_text(waiting.run_id)
    third = app.start("mail_report", to="y@example.com")
    expect(page.locator("table.runs tbody tr").first).to_contain_text(third, timeout=8000)
    expect(page.locator("table.runs tbody tr")).to_have_count(3)
