"""``durably demo``: kill an agent in its most dangerous window and watch it recover.

The sales-report agent (:mod:`durably.demo.sales_report`) runs against the real shop
service. Its worker is killed right after the shop issued a coupon and before durably
recorded it: the window where a checkpoint-only agent would issue a second coupon on
restart. A fresh worker recovers the run, asks the shop what happened, and finishes. The
shop's own records are the judge: one order, one coupon, one email.

Everything goes through the real command line in child processes, as a user would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import durably
from durably.demo.shop import ShopService
from durably.faults import CRASH_EXIT_CODE

APP = "durably.demo.sales_report:app"
LEASE_TTL_S = 1.0
"""Short, so the dead worker's lease runs out within the demo; production uses ~30 s."""
CRASH_AT = "effect.after_call:2"
"""The 2nd time a tool returns: create_order is the 1st, issue_coupon the 2nd."""
CHILD_TIMEOUT_S = 60.0
EFFECTS = (
    # (label, shop table, HTTP path, the tool that makes it)
    ("order", "orders", "/orders", "create_order"),
    ("coupon", "coupons", "/coupons", "issue_coupon"),
    ("email", "emails", "/emails", "send_email"),
)


Say = Callable[[str], None]


class DemoFailed(Exception):
    """Something went otherwise than the story says; the message says what."""


def run_demo(*, workdir: Path | None = None, out: TextIO = sys.stdout) -> int:
    """Run the demo; returns 0 when every effect happened exactly once, else 1.

    With ``workdir`` the run's database (``demo.db``), the shop's database
    (``shop.sqlite3``) and the shop's final records (``shop-effects.json``) stay there for
    inspection; without it a temporary directory is used and removed.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="durably-demo-") as tmp:
            return _demo(Path(tmp), out)
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return _demo(workdir, out)


def _demo(workdir: Path, out: TextIO) -> int:
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    started = time.monotonic()
    say("durably demo: an agent is killed in its most dangerous window, then recovers")
    say(f"working in {workdir}")
    shop = ShopService(workdir / "shop.sqlite3")
    try:
        _story(shop, _child_env(workdir, shop.url), workdir, say)
    except DemoFailed as exc:
        say(f"\nFAILED: {exc}")
        return 1
    finally:
        # The shop is a child process: never leave it behind, whatever happened above.
        shop.stop()
    say(f"(the demo took {time.monotonic() - started:.1f} s)")
    return 0


def _story(shop: ShopService, env: dict[str, str], workdir: Path, say: Say) -> None:
    say(f"\n1. The shop service is up at {shop.url}; its tools really change its database.")

    started = _durably(["start", "sales_report", "--input", '{"region": "EMEA"}'], env)
    run_id = started.stdout.strip().splitlines()[-1]
    say(f"2. Queued run {run_id}: sales_report for region EMEA.")

    say(f"3. A worker executes it, set to die at {CRASH_AT} (DURABLY_CRASH_AT).")
    crashed = _durably(
        ["worker", "--until-idle", "--lease-ttl", str(LEASE_TTL_S)],
        env | {"DURABLY_CRASH_AT": CRASH_AT},
        expect=CRASH_EXIT_CODE,
    )
    killed_at = time.monotonic()
    say(
        f"   The worker was killed (exit code {crashed.returncode}) at effect.after_call: "
        "the coupon exists at the shop but the ledger does not know."
    )

    held = _held(shop.effects())
    shown = json.loads(_durably(["runs", "show", run_id, "--json"], env).stdout)
    ledger = {e["tool"]: e["status"] for e in shown["effects"]}
    say("4. The state at that moment:")
    say("   shop:   " + ", ".join(_count(n, label) for label, n in held.items()))
    say(
        f"   ledger: run {shown['status']}; "
        + ", ".join(f"{tool} {status}" for tool, status in ledger.items())
    )
    if held["coupon"] != 1 or ledger.get("issue_coupon") != "executing":
        raise DemoFailed(
            "the worker did not die where intended (expected the coupon issued at the shop "
            f"and 'executing' in the ledger; shop holds {held}, ledger says {ledger})"
        )
    say(
        "   The ledger still says 'executing', under the dead worker's lease. Retrying blindly "
        "would issue a second coupon; durably will ask the shop instead."
    )

    # A lease outliving its worker is what stops two workers running one effect; the
    # recovering worker may only claim the run once it has run out.
    time.sleep(max(LEASE_TTL_S + 0.25 - (time.monotonic() - killed_at), 0.0))
    say(f"5. The dead worker's lease ({LEASE_TTL_S:g} s) has expired; a fresh worker recovers.")
    began = time.monotonic()
    _durably(["worker", "--until-idle", "--lease-ttl", str(LEASE_TTL_S)], env)
    say(f"   It finished in {time.monotonic() - began:.1f} s.")

    report = shop.effects()
    (workdir / "shop-effects.json").write_text(json.dumps(report, indent=2) + "\n")
    doc = json.loads(_durably(["runs", "show", run_id, "--json"], env).stdout)
    _verdict(report, doc, say)


def _verdict(report: dict[str, Any], doc: dict[str, Any], say: Say) -> None:
    """Print the shop's own account next to the ledger's, and judge it."""
    held = _held(report)
    calls = report["requests_by_method"]
    statuses = {e["tool"]: e for e in doc["effects"]}
    say("6. What the shop itself recorded, next to durably's ledger:\n")
    rows = [["effect", "held by the shop", "requests it received", "ledger", "external id"]]
    problems = []
    for label, _table, path, tool in EFFECTS:
        posts, lookups = calls.get(f"POST {path}", 0), calls.get(f"GET {path}", 0)
        received = f"{posts} POST" + (
            f" + {lookups} GET (reconciliation lookup)" if lookups else ""
        )
        effect = statuses.get(tool, {})
        status = effect.get("status", "missing")
        rows.append(
            [label, str(held[label]), received, status, effect.get("external_operation_id")]
        )
        if held[label] != 1 or posts != 1 or status != "succeeded":
            problems.append(f"{label}: shop holds {held[label]}, {posts} POST, ledger {status}")
    if calls.get("GET /coupons", 0) != 1:
        problems.append(f"coupon: {calls.get('GET /coupons', 0)} lookups, expected 1")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        say("   " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    say(
        f"\n   reads and model calls: GET /sales {calls.get('GET /sales', 0)}, "
        f"POST /model/draft {calls.get('POST /model/draft', 0)} (recorded once, reused on recovery)"
    )
    say(f"   run {doc['run_id']}: {doc['status']}")
    if doc["status"] != "completed":
        problems.append(f"the run is {doc['status']}, not completed: {doc.get('error')}")
    if problems:
        raise DemoFailed("; ".join(problems))
    say("\nVerdict: every effect happened exactly once, although the worker died mid-effect.")


def _held(report: dict[str, Any]) -> dict[str, int]:
    return {label: len(report[table]) for label, table, _path, _tool in EFFECTS}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _child_env(workdir: Path, shop_url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # The caller's own settings must not redirect or crash the demo's children.
        if k not in ("DURABLY_CRASH_AT", "DURABLY_APP", "DURABLY_LEASE_TTL")
    }
    # Children must import this very package, even when it is not installed.
    src = str(Path(durably.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env["DURABLY_DATABASE_URL"] = f"sqlite:///{workdir / 'demo.db'}"
    env["SHOP_URL"] = shop_url
    return env


def _durably(
    args: list[str], env: dict[str, str], *, expect: int = 0
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m durably --app APP ARGS`` and insist on its exit code."""
    cmd = [sys.executable, "-m", "durably", "--app", APP, *args]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        # subprocess.run has killed the child already; nothing is left running.
        raise DemoFailed(
            f"`durably {' '.join(args)}` did not finish in {CHILD_TIMEOUT_S:g} s"
        ) from None
    if done.returncode != expect:
        raise DemoFailed(
            f"`durably {' '.join(args)}` exited with {done.returncode}, expected {expect}:\n"
            + (done.stderr or done.stdout)[-2000:]
        )
    return done
