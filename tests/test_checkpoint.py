"""Checkpoints: checksums, verification of the journal, and migrations of old payloads."""

from __future__ import annotations

from typing import Any

import pytest

from durably import checkpoint as cp
from durably.errors import CheckpointCorrupted, CheckpointNotMigratable
from durably.keys import sha256_hex


def sealed(state: cp.JournalState, sequence: int, version: int = 1) -> tuple[dict[str, Any], str]:
    c, _ = state.draft(status="running", current_step=None).seal(
        state_version=version, last_event_sequence=sequence
    )
    return c.payload(), c.checksum


def test_tampered_payload_fails_its_checksum() -> None:
    payload, checksum = sealed(cp.JournalState("r"), 1)
    assert cp.from_stored(dict(payload), checksum).run_id == "r"
    payload["status"] = "completed"
    with pytest.raises(CheckpointCorrupted):
        cp.from_stored(payload, checksum)


def test_journal_is_verified_against_anchor_and_events() -> None:
    """Results up to the anchor match its digest; later ones must match their events."""
    state = cp.JournalState("r")
    state.settle("a#1", sha256_hex("1"))
    anchor = sealed(state, 2)
    results = [
        cp.SettledResult("a#1", 2, sha256_hex("1")),
        cp.SettledResult("b#1", 3, sha256_hex("2")),
    ]
    ok = cp.verify_journal(results, [anchor], lambda seq: {"b#1": sha256_hex("2")})
    assert ok.anchor is not None
    assert ok.corrupted_checkpoints == []
    with pytest.raises(CheckpointCorrupted):
        cp.verify_journal(results, [anchor], lambda seq: {"b#1": sha256_hex("999")})
    altered = [cp.SettledResult("a#1", 2, sha256_hex("100")), results[1]]
    with pytest.raises(CheckpointCorrupted):
        cp.verify_journal(altered, [anchor], lambda seq: {"b#1": sha256_hex("2")})


def test_a_corrupted_newest_checkpoint_falls_back_to_an_older_one() -> None:
    state = cp.JournalState("r")
    older = sealed(state, 1, version=1)
    state.settle("a#1", sha256_hex("1"))
    newest_payload, newest_checksum = sealed(state, 2, version=2)
    newest_payload["current_step"] = "forged"
    result = cp.verify_journal(
        [cp.SettledResult("a#1", 2, sha256_hex("1"))],
        [(newest_payload, newest_checksum), older],
        lambda seq: {"a#1": sha256_hex("1")},
    )
    assert result.anchor is not None
    assert result.anchor.state_version == 1
    assert result.corrupted_checkpoints == ["r:2"]


def test_old_schema_versions_are_migrated_on_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written by older code is upgraded by the registered migration."""
    payload, _ = sealed(cp.JournalState("r"), 1)
    old = {k: v for k, v in payload.items() if k != "budget_snapshot"}
    old["schema_version"] = 0
    checksum = cp.checksum_of(old)
    with pytest.raises(CheckpointNotMigratable, match="no registered migration"):
        cp.from_stored(dict(old), checksum)
    monkeypatch.setattr(cp, "_migrations", dict(cp._migrations))

    @cp.register_checkpoint_migration(0)
    def add_budget(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "budget_snapshot": {}}

    upgraded = cp.from_stored(dict(old), checksum)
    assert upgraded.schema_version == cp.CHECKPOINT_SCHEMA_VERSION
    assert upgraded.budget_snapshot == {}


def test_version_1_lists_its_latest_effect_and_version_2_a_bounded_list() -> None:
    state = cp.JournalState("r")
    v1, _ = sealed(state, 1)
    v1 = {**v1, "schema_version": 1, "completed_effects": {"count": 3, "last": "k3"}}
    upgraded = cp.from_stored(dict(v1), cp.checksum_of(v1))
    assert upgraded.completed_effects == {"count": 3, "keys": ["k3"]}
    for i in range(cp.EFFECTS_LISTED + 5):
        state.effect_completed(f"k{i}")
    listed = state.draft(status="running", current_step=None).completed_effects
    assert listed["count"] == cp.EFFECTS_LISTED + 5
    assert listed["keys"] == [f"k{i}" for i in range(5, cp.EFFECTS_LISTED + 5)]


def test_a_newer_checkpoint_is_not_migratable_and_not_passed_over() -> None:
    """An intact checkpoint newer than the code stops verification: an older one is no
    anchor for it, and it is not reported corrupted."""
    state = cp.JournalState("r")
    older = sealed(state, 1, version=1)
    newer, _ = sealed(state, 2, version=2)
    newer["schema_version"] = cp.CHECKPOINT_SCHEMA_VERSION + 1
    with pytest.raises(CheckpointNotMigratable, match="newer than this durably reads"):
        cp.verify_journal([], [(newer, cp.checksum_of(newer)), older], lambda seq: {})


KEY = b"k" * 32


def keyed(state: cp.JournalState, sequence: int, version: int = 1) -> tuple[dict[str, Any], str]:
    state.key = KEY
    return sealed(state, sequence, version)


def test_a_secret_seals_checkpoints_and_only_its_seal_is_trusted() -> None:
    payload, checksum = keyed(cp.JournalState("r"), 1)
    assert checksum.startswith("hmac-sha256:")
    assert cp.from_stored(dict(payload), checksum, KEY).run_id == "r"
    with pytest.raises(CheckpointCorrupted, match="secret this App does not have"):
        cp.from_stored(dict(payload), checksum)
    with pytest.raises(CheckpointCorrupted, match="failed its checksum"):
        cp.from_stored(dict(payload), checksum, b"another key, also 32 bytes long")
    # A forger recomputes a plain checksum, or puts the prefix on one: neither is a seal.
    forged = {**payload, "status": "completed"}
    with pytest.raises(CheckpointCorrupted, match="not sealed with the App's secret"):
        cp.from_stored(dict(forged), cp.checksum_of(forged), KEY)
    with pytest.raises(CheckpointCorrupted, match="failed its checksum"):
        cp.from_stored(dict(forged), "hmac-sha256:" + cp.checksum_of(forged), KEY)


def test_with_a_secret_a_plain_newest_checkpoint_is_passed_over() -> None:
    state = cp.JournalState("r")
    older = keyed(state, 1, version=1)
    state.settle("a#1", sha256_hex("1"))
    state.key = None
    newest = sealed(state, 2, version=2)
    result = cp.verify_journal(
        [cp.SettledResult("a#1", 2, sha256_hex("1"))],
        [newest, older],
        lambda seq: {"a#1": sha256_hex("1")},
        KEY,
    )
    assert result.anchor is not None
    assert result.anchor.state_version == 1
    assert result.corrupted_checkpoints == ["r:2"]
    without = cp.verify_journal(
        [cp.SettledResult("a#1", 2, sha256_hex("1"))], [newest, older], lambda seq: {}
    )
    assert without.anchor is not None
    assert without.anchor.state_version == 2
    assert without.corrupted_checkpoints == []


def test_the_key_is_never_shown() -> None:
    state = cp.JournalState("r", key=KEY)
    draft = state.draft(status="running", current_step=None)
    assert "kkkk" not in repr(state) + repr(draft)
