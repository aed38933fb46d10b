"""The console in Chromium against a malicious page: framing, DNS rebinding, one-click actions,
and the token on reads. The server is a real ``durably serve`` subprocess."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from playwright.sync_api import Browser, Dialog, Page, Request, expect

from tests.server.browser import CHROMIUM, CHROMIUM_ARGS
from tests.server.served import AUTH, TOKEN, Served, fingerprint, prepare

Start = Callable[..., Served]


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/durably.db"


def status(served: Served, run_id: str) -> str:
    value: str = served.request("GET", f"/api/runs/{run_id}", None, AUTH).json()["status"]
    return value


@contextmanager
def other_origin(pages: dict[str, str]) -> Iterator[str]:
    """A plain HTTP server on another loopback port (another origin, same address space)
    serving ``pages`` (path to HTML); yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "").encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_another_origin_cannot_frame_the_console(tmp_path: Path, start: Start, page: Page) -> None:
    """Clickjacking: a page elsewhere puts the console in an invisible frame and has the
    operator click Approve through it. The browser must refuse to render it framed."""
    prepare(sqlite_url(tmp_path))
    served = start(sqlite_url(tmp_path), DURABLY_API_TOKEN=None)
    console = f"http://127.0.0.1:{served.port}/runs/o-1"
    pages = {"/framed": "<p id=ok>framed</p>"}
    with other_origin(pages) as attacker:
        pages["/"] = (
            f'<iframe name="console" src="{console}"></iframe>'
            f'<iframe name="control" src="{attacker}/framed"></iframe>'
        )
        page.goto(attacker + "/")
        control = page.frame(name="control")
        assert control is not None
        expect(control.locator("#ok")).to_have_text("framed")  # framing itself works here
        framed = page.frame(name="console")
        assert framed is not None
        page.wait_for_timeout(500)
        assert framed.locator("button").count() == 0
        assert not framed.url.startswith(console), framed.url


def test_a_dismissed_confirmation_changes_nothing(
    tmp_path: Path, start: Start, browser: Browser
) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url, DURABLY_API_TOKEN=None)
    base = f"http://127.0.0.1:{served.port}"
    before = fingerprint(url)
    context = browser.new_context()
    context.set_default_timeout(10_000)
    page = context.new_page()
    asked: list[str] = []
    sent: list[str] = []

    def dismiss(dialog: Dialog) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    def record(request: Request) -> None:
        if "/api/" in request.url:
            sent.append(request.url)

    page.on("dialog", dismiss)
    page.on("request", record)
    try:
        clicks = [
            ("/runs/o-1", "Approve", "Approve place_order for run o-1"),
            ("/runs/o-1", "Reject", "Reject place_order for run o-1"),
            ("/runs/b-1", "Record outcome", "Record that the effect at charge#1 succeeded"),
            ("/runs/b-1", "Resume", "Resume run b-1"),
            ("/runs/b-1", "Cancel run", "Cancel this run"),
        ]
        for path, button, question in clicks:
            page.goto(base + path)
            if button == "Record outcome":
                page.locator("textarea[name=result]").fill('{"charge_id": "ch-1"}')
            page.get_by_role("button", name=button).click()
            expect(page.get_by_role("button", name=button)).to_be_enabled()
            assert asked[-1].startswith(question), asked
        page.wait_for_timeout(300)
        assert len(asked) == len(clicks)
        assert sent == []
        assert fingerprint(url) == before
        # Saying yes does act: the dialogs were the only thing in the way.
        page.remove_listener("dialog", dismiss)
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto(base + "/runs/o-1")
        page.get_by_role("button", name="Approve").click()
        expect(page.locator(".approvals-pending")).to_have_count(0)
    finally:
        context.close()
    assert status(served, "o-1") == "queued"
    assert status(served, "b-1") == "paused"


def test_dns_rebinding_from_a_real_browser_is_refused(
    tmp_path: Path, start: Start, browser: Browser
) -> None:
    """Chromium resolves rebind.test to 127.0.0.1, as an attacker's DNS would after the
    page loaded: the page is then same-origin with the console and could use its API."""
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url, DURABLY_API_TOKEN=None)
    before = fingerprint(url)
    chromium = browser.browser_type.launch(
        executable_path=CHROMIUM,
        args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"],
    )
    try:
        page = chromium.new_page()
        response = page.goto(f"http://rebind.test:{served.port}/runs/o-1")
        assert response is not None
        assert response.status == 400
        assert "does not answer to Host" in page.content()
        approve = page.evaluate(
            """() => fetch('/api/runs/o-1/approvals/approve', {method: 'POST',
                 headers: {'Content-Type': 'application/json'}, body: '{}'})
               .then(r => r.status)"""
        )
        assert approve == 400
    finally:
        chromium.close()
    assert fingerprint(url) == before
    assert status(served, "o-1") == "waiting_approval"


def test_reads_behind_the_token_work_once_it_is_pasted(
    tmp_path: Path, start: Start, page: Page
) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url)
    base = f"http://127.0.0.1:{served.port}"
    response = page.goto(base + "/")
    assert response is not None
    assert response.status == 401
    expect(page.locator("h1")).to_have_text("API token needed")
    expect(page.locator("#token-scope")).to_have_text("token: read+write")
    expect(page.locator("main")).not_to_contain_text("o-1")
    page.locator("#api-token").fill(TOKEN)
    page.get_by_role("button", name="Save").click()
    expect(page.locator("h1")).to_have_text("Runs")
    page.locator("a[href='/runs/o-1']").click()
    page.get_by_role("button", name="Approve").click()
    expect(page.locator(".approvals-pending")).to_have_count(0)
    assert status(served, "o-1") == "queued"
