"""Secrets on both stores: redacted values cannot be guessed back from anything readable, are
scrubbed from error messages, and checkpoints are sealed with the App's secret.

The attacker of these tests reads everything durably stores or shows (the API and the UI
show the same documents as ``describe``, ``events`` and ``checkpoints``), or writes the
database directly; they do not know the App's secret.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import durably
from durably import RunStatus
from durably.checkpoint import chain_digest
from durably.keys import canonical_json, input_hash, plain_json, sha256_hex
from tests.conftest import execute_sql

MakeApp = Callable[..., durably.App]

SECRET = "a-test-secret-of-at-least-16-bytes"
PIN = "4821"


def database_text(database_url: str) -> str:
    """Every byte the database holds, as text: the SQLite files (with the WAL), or every row
    of every table of the test's PostgreSQL schema."""
    if database_url.startswith("sqlite:"):
        path = Path(database_url.removeprefix("sqlite:///"))
        files = [path, path.with_name(path.name + "-wal")]
        return "".join(f.read_bytes().decode("latin-1") for f in files if f.exists())
    with psycopg.connect(database_url, autocommit=True) as pg:
        tables = [
            r[0]
            for r in pg.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema()"
            )
        ]
        assert "durably_steps" in tables
        query = sql.SQL("SELECT row_to_json(t)::text FROM {} t")
        return "\n".join(
            str(row[0])
            for table in tables
            for row in pg.execute(query.format(sql.Identifier(table)))
        )


def readable(app: durably.App, database_url: str, run_id: str) -> str:
    """Everything about the run a reader can see: the run document (steps, effects,
    approvals), its events and checkpoints, and the database itself."""
    return "\n".join(
        [
            json.dumps(app.describe(run_id)),
            json.dumps([(e.type, e.step_id, e.payload) for e in app.events(run_id)]),
            json.dumps(app.checkpoints(run_id)),
            database_text(database_url),
        ]
    )


def guesses(pin: str) -> list[str]:
    """The canonical JSON an attacker would hash for one guess, from the value alone up to
    the whole call (tool name, version and the other, known, argument)."""
    return [
        pin,
        canonical_json(pin),
        canonical_json({"pin": pin}),
        canonical_json({"account": "acct-1", "pin": pin}),
        canonical_json({"name": "unlock", "version": "1", "arguments": {"pin": pin}}),
        canonical_json(
            {"name": "unlock", "version": "1", "arguments": {"account": "acct-1", "pin": pin}}
        ),
    ]


def pin_app(make_app: MakeApp, secret: str = SECRET) -> tuple[durably.App, Counter[str]]:
    app = make_app(secret_key=secret)
    unlocked = Counter[str]()

    @app.tool(idempotent=True, requires_approval=True, redact=["pin"])
    def unlock(account: str, pin: str) -> dict[str, str]:
        unlocked[account] += 1
        return {"unlocked": account}

    @app.workflow()
    async def wf() -> Any:
        door = await unlock("acct-1", PIN)
        arrived = await durably.wait_for_event("arrived")
        return {"door": door, "arrived": arrived}

    return app, unlocked


def test_a_redacted_pin_cannot_be_brute_forced_and_still_replays(
    make_app: MakeApp, database_url: str
) -> None:
    """No hash readable anywhere is sha256 of any JSON built from any 4-digit PIN; the input
    hash is an HMAC under the App's secret, so new processes with the same secret recompute
    it: the approval given in a second App authorises the call, and a third App replays the
    recorded call without an IdempotencyConflict."""
    first, unlocked = pin_app(make_app)
    run = first.run("wf")
    assert run.status is RunStatus.WAITING_APPROVAL
    first.close()

    second, unlocked = pin_app(make_app)
    second.approve(run.run_id, by="ops")
    waiting = second.resume(run.run_id)
    assert waiting.status is RunStatus.WAITING_EXTERNAL, waiting.error
    assert unlocked == Counter({"acct-1": 1})
    second.close()

    third, unlocked = pin_app(make_app)
    third.send_event(run.run_id, "arrived", {"at": "door"}, event_id="e1")
    done = third.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == {"door": {"unlocked": "acct-1"}, "arrived": {"at": "door"}}
    assert unlocked == Counter()  # replayed from the ledger, not sent again

    seen = set(re.findall(r"[0-9a-f]{64}", readable(third, database_url, run.run_id)))
    assert len(seen) > 5  # keys, hashes and checksums are there to be read
    plain = {
        sha256_hex(text) for pin in (f"{n:04d}" for n in range(10_000)) for text in guesses(pin)
    }
    # What a plain input hash of this call was: among the guesses (the test can see it).
    assert input_hash("unlock", "1", {"account": "acct-1", "pin": PIN}) in plain
    assert seen & plain == set()
    effect = third.describe(run.run_id)["effects"][0]
    assert effect["input_hash"] in seen
    assert set(effect["arguments"]["pin"]) == {"redacted"}
    assert f'"{PIN}"' not in json.dumps(third.describe(run.run_id))


def test_another_secret_cannot_replay_a_redacted_call(make_app: MakeApp) -> None:
    """Why the secret must be the same in every process: under another one the recorded call
    hashes differently, and the run pauses instead of reusing or repeating the effect."""
    first, _ = pin_app(make_app)
    run = first.run("wf")
    first.approve(run.run_id, by="ops")
    assert first.resume(run.run_id).status is RunStatus.WAITING_EXTERNAL
    first.close()

    other, unlocked = pin_app(make_app, secret="another-secret-of-16-bytes-or-more")
    other.send_event(run.run_id, "arrived", None, event_id="e1")
    paused = other.resume(run.run_id)
    assert paused.status is RunStatus.PAUSED
    assert paused.status_reason == "idempotency_conflict"
    assert unlocked == Counter()


def test_redact_needs_a_configured_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random per-process key would make a redacted call's hash differ in every process:
    registering one without a secret is refused, saying how to configure it."""
    monkeypatch.delenv("DURABLY_SECRET_KEY", raising=False)
    app = durably.App(f"sqlite:///{tmp_path}/a.db")
    with pytest.raises(durably.ConfigurationError, match=r"DURABLY_SECRET_KEY.*secret_key"):

        @app.tool(redact=["pin"])
        def unlock(pin: str) -> None: ...

    @app.tool()  # a tool without redact= needs no secret
    def plain(pin: str) -> None: ...

    monkeypatch.setenv("DURABLY_SECRET_KEY", SECRET)
    configured = durably.App(f"sqlite:///{tmp_path}/a.db")

    @configured.tool(redact=["pin"])
    def unlock_too(pin: str) -> None: ...

    assert configured.secret_key == SECRET.encode()


@pytest.mark.parametrize("secret", ["short", b"\x00" * 15])
def test_a_guessable_secret_is_refused(tmp_path: Path, secret: str | bytes) -> None:
    with pytest.raises(durably.ConfigurationError, match="at least 16 random bytes"):
        durably.App(f"sqlite:///{tmp_path}/a.db", secret_key=secret)


def test_redact_names_only_parameters(make_app: MakeApp) -> None:
    app = make_app(secret_key=SECRET)
    with pytest.raises(durably.ConfigurationError, match=r"\['pni'\].*not parameters"):

        @app.tool(redact=["pni"])
        def unlock(pin: str) -> None: ...


def test_redacting_kwargs_redacts_every_keyword_argument_it_receives(
    make_app: MakeApp, database_url: str
) -> None:
    """Keyword arguments gathered by ``**extra`` are stored flattened under their own names;
    naming ``extra`` in ``redact=`` redacts each of them (it used to redact nothing)."""
    app = make_app(secret_key=SECRET)

    @app.tool(idempotent=True, redact=["extra", "codes"])
    def login(account: str, *codes: str, **extra: str) -> str:
        return account

    @app.workflow()
    async def wf() -> str:
        return await login("acct-1", "code-918273", password="hunter2-pw", otp="551-220")

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED, run.error
    stored = app.describe(run.run_id)["effects"][0]["arguments"]
    assert stored["account"] == "acct-1"
    assert {name: set(value) for name, value in stored.items() if name != "account"} == {
        "password": {"redacted"},
        "otp": {"redacted"},
        "codes": {"redacted"},
    }
    everything = readable(app, database_url, run.run_id)
    for secret in ("hunter2-pw", "551-220", "code-918273"):
        assert secret not in everything


def test_tool_errors_are_scrubbed_of_redacted_values(
    make_app: MakeApp, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool's error message that quotes a redacted argument (as its str or its JSON) is
    stored, shown and logged with ``[redacted]`` in its place."""
    app = make_app(secret_key=SECRET)
    card = {"number": "4000123412341234", "cvc": "737"}

    @app.tool(idempotent=True, redact=["pin", "card"])
    def unlock(account: str, pin: str, card: dict[str, str]) -> None:
        raise durably.ToolError(
            f"wrong pin {pin!r} for {account} (card {json.dumps(card)}, cvc {card['cvc']})",
            category=durably.FailureCategory.PERMANENT_INPUT,
        )

    @app.tool(idempotent=True, redact=["pin"])
    def lookup(pin: str) -> None:
        raise TimeoutError(f"no answer for pin={pin}")  # an unknown outcome: paused

    @app.workflow()
    async def wf() -> Any:
        try:
            await unlock("acct-1", PIN, card)
        except durably.StepFailed as exc:
            failed = exc.error_message
        await lookup(PIN)
        return failed

    with caplog.at_level(logging.INFO, logger="durably"):
        run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    doc = app.describe(run.run_id)
    assert doc["effects"][0]["error"]["message"] == (
        "wrong pin '[redacted]' for acct-1 (card [redacted], cvc [redacted])"
    )
    assert doc["effects"][1]["error"]["message"] == "no answer for pin=[redacted]"
    everything = readable(app, database_url, run.run_id) + caplog.text
    assert "[redacted]" in caplog.text
    # Digits alone may turn up by chance (in hashes, timestamps): look for them in context.
    for secret in ("4000123412341234", f"'{PIN}'", f"={PIN}", '"737"', "cvc 737"):
        assert secret not in everything


def forge(database_url: str, app: durably.App, run_id: str, step_id: str, output: str) -> None:
    """Rewrite a recorded result, and every checkpoint covering it with a recomputed digest
    and a recomputed plain sha256 checksum: what anyone who can write the database can do."""
    execute_sql(
        database_url,
        "UPDATE durably_steps SET output_json = ? WHERE run_id = ? AND step_id = ?",
        (output, run_id, step_id),
    )
    for stored in app.checkpoints(run_id):
        payload = {k: v for k, v in stored.items() if k not in ("checksum", "valid")}
        if payload["state_snapshot"]["journal_length"] == 0:
            continue
        assert payload["state_snapshot"]["journal_length"] == 1
        payload["state_snapshot"]["journal_digest"] = chain_digest("", step_id, sha256_hex(output))
        text = plain_json(payload)
        execute_sql(
            database_url,
            "UPDATE durably_checkpoints SET payload_json = ?, checksum = ? "
            "WHERE run_id = ? AND state_version = ?",
            (text, sha256_hex(text), run_id, payload["state_version"]),
        )


def price_app(make_app: MakeApp, **options: Any) -> tuple[durably.App, dict[str, bool]]:
    app = make_app(**options)
    gate_open = {"v": False}

    @app.step()
    def price() -> int:
        return 10

    @app.tool()
    def gate() -> None:
        if not gate_open["v"]:
            raise TimeoutError  # unknown outcome: the run pauses for an operator

    @app.workflow()
    async def wf() -> int:
        p = await price()
        await gate()
        return p

    return app, gate_open


def test_checkpoints_are_sealed_with_the_secret(make_app: MakeApp) -> None:
    sealed, _ = price_app(make_app, secret_key=SECRET)
    run = sealed.run("wf")
    checkpoints = sealed.checkpoints(run.run_id)
    assert checkpoints
    assert all(re.fullmatch(r"hmac-sha256:[0-9a-f]{64}", c["checksum"]) for c in checkpoints)
    assert all(c["valid"] for c in checkpoints)
    plain, _ = price_app(make_app)
    run = plain.run("wf")
    assert all(re.fullmatch(r"[0-9a-f]{64}", c["checksum"]) for c in plain.checkpoints(run.run_id))
    assert all(c["valid"] for c in plain.checkpoints(run.run_id))


def test_with_a_secret_a_forged_checkpoint_is_detected(
    make_app: MakeApp, database_url: str
) -> None:
    """The forger cannot compute the keyed seal, so their plain checksum anchors nothing: the
    result is checked against the event log, found altered, and the run pauses."""
    app, gate_open = price_app(make_app, secret_key=SECRET)
    run = app.run("wf")
    assert run.status is RunStatus.PAUSED
    forge(database_url, app, run.run_id, "price#1", "1000")
    checkpoints = app.checkpoints(run.run_id)
    # Only the receipt's holds: it was written before the result, which it does not cover.
    assert [c["valid"] for c in checkpoints] == [False] * (len(checkpoints) - 1) + [True]
    gate_open["v"] = True
    with pytest.raises(durably.CheckpointCorrupted):
        app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == "checkpoint_corrupted"


def test_with_a_secret_a_forged_journal_and_event_log_is_reported(
    make_app: MakeApp, database_url: str
) -> None:
    """A forger who also rewrites the event log and every checkpoint covering the result
    leaves nothing sealed to compare with: the run goes on from the event log, but every
    forged checkpoint is reported (``checkpoint_corrupted``)."""
    app, gate_open = price_app(make_app, secret_key=SECRET)
    run = app.run("wf")
    forge(database_url, app, run.run_id, "price#1", "1000")
    execute_sql(
        database_url,
        "UPDATE durably_events SET payload_json = replace(payload_json, ?, ?) WHERE run_id = ?",
        (sha256_hex("10"), sha256_hex("1000"), run.run_id),
    )
    gate_open["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    reported = [e for e in app.events(run.run_id) if e.type == "checkpoint_corrupted"]
    assert reported
    # All but the receipt (which holds, covering no result) and the one written since.
    assert len(reported[0].payload["checkpoint_ids"]) == len(app.checkpoints(run.run_id)) - 2
    assert reported[0].payload["recovered_from"] == f"{run.run_id}:1"
    # The limit: with nothing sealed left to compare with, the forged value is used.
    assert app.resume(run.run_id).result == 1000


def test_without_a_secret_a_forged_checkpoint_is_not_detected(
    make_app: MakeApp, database_url: str
) -> None:
    """The stated limit: plain checksums detect accidents, not a forger who recomputes them."""
    app, gate_open = price_app(make_app)
    run = app.run("wf")
    forge(database_url, app, run.run_id, "price#1", "1000")
    assert all(c["valid"] for c in app.checkpoints(run.run_id))
    gate_open["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == 1000  # the forged value, undetected


def test_runs_sealed_before_the_secret_was_configured_still_resume(
    make_app: MakeApp, database_url: str
) -> None:
    """Plain checkpoints are not trusted once a secret is configured: they are reported and
    the journal is verified against the event log, and the run goes on from there."""
    before, _ = price_app(make_app)
    run = before.run("wf")
    before.close()
    after, gate_open = price_app(make_app, secret_key=SECRET)
    assert not any(c["valid"] for c in after.checkpoints(run.run_id))
    gate_open["v"] = True
    after.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = after.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == 10
    assert "checkpoint_corrupted" in [e.type for e in after.events(run.run_id)]
    assert after.checkpoints(run.run_id)[0]["valid"]


def test_a_redacted_call_recorded_with_a_plain_input_hash_still_replays(
    make_app: MakeApp, database_url: str
) -> None:
    """A call recorded before redacted input hashes were keyed (a plain sha256) is the same
    call: the run is settled with its recorded key, not paused as a conflict."""
    app = make_app(secret_key=SECRET)
    answered = {"v": False}
    sent = Counter[str]()

    @app.tool(redact=["pin"])
    def unlock(account: str, pin: str) -> str:
        sent[account] += 1
        if not answered["v"]:
            raise TimeoutError
        return "open"

    @app.workflow()
    async def wf() -> str:
        return await unlock("acct-1", PIN)

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    legacy = input_hash("unlock", "1", {"account": "acct-1", "pin": PIN})
    for table in ("durably_steps", "durably_tool_operations"):
        execute_sql(
            database_url,
            f"UPDATE {table} SET input_hash = ? WHERE run_id = ?",
            (legacy, run.run_id),
        )
    answered["v"] = True
    app.resolve_effect(run.run_id, "unlock#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == "open"
    assert sent == Counter({"acct-1": 2})


TOKEN = "sk_live_ABCDEFGHIJKLMNOPQRSTUVWX"


def test_a_long_error_message_is_scrubbed_before_it_is_cut(
    make_app: MakeApp, database_url: str
) -> None:
    """Cut first, a token straddling the 4,000-character cut would be stored as a prefix."""
    app = make_app(secret_key=SECRET)

    @app.tool(redact=["token"])
    async def call(token: str) -> str:
        raise PermissionError("x" * 3985 + " token=" + token)  # an echoed request

    @app.workflow()
    async def wf() -> str:
        return await call(TOKEN)

    run = app.run(wf)
    assert TOKEN[:5] not in readable(app, database_url, run.run_id)


def test_a_redacted_value_quoted_as_ascii_escaped_json_is_scrubbed(
    make_app: MakeApp, database_url: str
) -> None:
    """json.dumps (and requests) escape non-ASCII by default: that form is scrubbed too."""
    app = make_app(secret_key=SECRET)
    password = "pässwörd-9271"

    @app.tool(redact=["password"])
    async def login(user: str, password: str) -> str:
        body = json.dumps({"user": user, "password": password})
        raise PermissionError(f"401 for request body {body}")

    @app.workflow()
    async def wf() -> str:
        return await login("bob", password)

    run = app.run(wf)
    everything = readable(app, database_url, run.run_id)
    assert json.dumps(password)[1:-1] not in everything
    assert "[redacted]" in app.describe(run.run_id)["effects"][0]["error"]["message"]


def test_a_sealed_checkpoint_copied_from_another_run_proves_nothing(
    make_app: MakeApp, database_url: str
) -> None:
    """The attacker copies run X's sealed checkpoint into run Y and rewrites Y's result to
    X's: the seal is real, but it is X's, so Y's altered journal is caught."""
    app = make_app(secret_key=SECRET)
    paid: list[int] = []

    @app.step()
    def quote(customer: str) -> int:
        return 1000 if customer == "attacker" else 5

    @app.tool(idempotent=True)
    def pay(amount: int) -> int:
        paid.append(amount)
        return amount

    @app.workflow()
    async def wf(customer: str) -> int:
        amount = await quote(customer)
        await durably.wait_for_event("go")
        return await pay(amount)

    x = app.run(wf, "attacker")
    y = app.run(wf, "victim")
    [newest] = [c for c in app.checkpoints(x.run_id)][:1]
    payload = {k: v for k, v in newest.items() if k not in ("checksum", "valid")}
    execute_sql(
        database_url,
        "INSERT INTO durably_checkpoints (run_id, state_version, last_event_sequence, "
        "schema_version, payload_json, checksum, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            y.run_id,
            999,
            payload["last_event_sequence"],
            payload["schema_version"],
            plain_json(payload),
            newest["checksum"],
            payload["created_at"],
        ),
    )
    execute_sql(
        database_url,
        "UPDATE durably_steps SET output_json = '1000' WHERE run_id = ? AND step_id = 'quote#1'",
        (y.run_id,),
    )
    app.send_event(y.run_id, "go")
    app.worker().run(until_idle=True)
    assert 1000 not in paid, "the forged amount was paid"
    done = app.get_run(y.run_id)
    assert done.status is RunStatus.PAUSED
    assert done.status_reason == "checkpoint_corrupted"
