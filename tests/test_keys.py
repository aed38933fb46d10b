"""Canonical JSON, input hashes and idempotency keys."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durably.errors import NotJSONSerializable, PayloadTooLarge
from durably.keys import (
    canonical_json,
    idempotency_key,
    input_hash,
    json_value,
    keyed_hex,
    sha256_hex,
)
from durably.values import MAX_JSON_DEPTH, check_json_value, json_text_fits

# Text a store can hold: no lone surrogates, no NUL (both refused, see below).
storable_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | storable_text,
    lambda children: st.lists(children) | st.dictionaries(storable_text, children),
    max_leaves=20,
)


@given(st.dictionaries(storable_text, json_values))
def test_input_hash_ignores_key_order(arguments: dict[str, object]) -> None:
    reordered = dict(reversed(list(arguments.items())))
    assert input_hash("t", "1", arguments) == input_hash("t", "1", reordered)


def test_input_hash_binds_name_version_and_arguments() -> None:
    base = input_hash("send", "1", {"to": "a"})
    assert base != input_hash("send", "2", {"to": "a"})
    assert base != input_hash("mail", "1", {"to": "a"})
    assert base != input_hash("send", "1", {"to": "b"})


def test_a_keyed_input_hash_is_an_hmac_only_the_secret_recomputes() -> None:
    arguments = {"account": "acct-1", "pin": "4821"}
    key = b"k" * 32
    keyed = input_hash("unlock", "1", arguments, key=key)
    assert keyed == input_hash("unlock", "1", dict(reversed(arguments.items())), key=key)
    assert keyed != input_hash("unlock", "1", arguments)
    assert keyed != input_hash("unlock", "1", arguments, key=b"j" * 32)
    text = canonical_json({"name": "unlock", "version": "1", "arguments": arguments})
    assert keyed == keyed_hex(key, "input_hash", text)


def test_one_secret_gives_unrelated_hashes_per_purpose() -> None:
    """A redacted argument an attacker chose (say, a forged checkpoint payload) is hashed
    under another derived key than checkpoint seals: its stored hash is never a seal."""
    key = b"k" * 32
    text = '{"checkpoint_id":"r:9","status":"completed"}'
    assert keyed_hex(key, "redacted_argument", text) != keyed_hex(key, "checkpoint", text)


def test_idempotency_key_is_the_documented_formula() -> None:
    key = idempotency_key("acme", "run_1", 2, "send#1", "send")
    assert key == sha256_hex('["durably.idempotency_key",2,"acme","run_1",2,"send#1","send"]')
    assert key != idempotency_key("acme", "run_1", 3, "send#1", "send")


@given(st.lists(st.text(), min_size=4, max_size=4), st.integers(min_value=0))
def test_keys_hash_the_parts_as_json_dumps_writes_them(parts: list[str], version: int) -> None:
    """Any text (quotes, controls, non-ASCII): the key of a recorded call never changes
    with how durably encodes its parts."""
    tenant, run_id, step_id, group = parts
    text = json.dumps(
        ["durably.idempotency_key", 2, tenant, run_id, version, step_id, group],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert idempotency_key(tenant, run_id, version, step_id, group) == sha256_hex(text)


def test_runs_recorded_under_scheme_1_keep_their_keys() -> None:
    key = idempotency_key("acme", "run_1", 2, "send#1", "send", scheme=1)
    assert key == sha256_hex("acme|run_1|2|send#1|send")


@given(
    st.lists(storable_text, min_size=4, max_size=4), st.lists(storable_text, min_size=4, max_size=4)
)
def test_distinct_parts_never_share_a_key(a: list[str], b: list[str]) -> None:
    if a != b:
        assert idempotency_key(a[0], a[1], 1, a[2], a[3]) != idempotency_key(
            b[0], b[1], 1, b[2], b[3]
        )


def test_a_separator_inside_a_part_cannot_imitate_another_tenant() -> None:
    """Scheme 1 gave tenant acme + run x|y and tenant acme|x + run y the same key."""
    assert idempotency_key("acme", "x|y", 1, "s#1", "s", scheme=1) == idempotency_key(
        "acme|x", "y", 1, "s#1", "s", scheme=1
    )
    assert idempotency_key("acme", "x|y", 1, "s#1", "s") != idempotency_key(
        "acme|x", "y", 1, "s#1", "s"
    )


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"memo": "\ud800"}, "surrogate"),
        (["ok", "a\x00b"], "NUL"),
        ({"k\x00": 1}, "NUL"),
        ({"\udfff": 1}, "surrogate"),
    ],
)
def test_strings_no_store_can_hold_are_refused(value: object, match: str) -> None:
    with pytest.raises(NotJSONSerializable, match=match):
        canonical_json(value)


def test_nesting_is_bounded() -> None:
    deep: object = "leaf"
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    canonical_json(deep)
    with pytest.raises(NotJSONSerializable, match="nests deeper than 64"):
        canonical_json([deep])
    very_deep: object = 1
    for _ in range(10_000):
        very_deep = {"a": very_deep}
    with pytest.raises(NotJSONSerializable, match="nests deeper"):
        canonical_json(very_deep)


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, {1, 2}, (1, 2), {1: "int key"}, object(), b"bytes"],
)
def test_values_that_would_not_replay_identically_are_refused(value: object) -> None:
    with pytest.raises(NotJSONSerializable):
        canonical_json(value)


def test_a_value_that_contains_itself_is_refused_by_name() -> None:
    """The encoder runs without a circular check: a cycle recurses until RecursionError,
    which canonical_json reports as a value nested too deep, never as a crash."""
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(NotJSONSerializable, match="nests deeper"):
        canonical_json({"a": cycle})


@given(json_values)
def test_stored_json_reads_back_as_json_loads_reads_it(value: object) -> None:
    text = canonical_json(value)
    assert json_value(text) == json.loads(text) == value
    # Text durably did not write (padded, as another writer may have left it) is read by
    # json.loads itself: the same value, or the same refusal.
    assert json_value(f" {text}\n") == value
    for broken in (f"{text} x", f"\ufeff{text}", f"[{text}"):
        with pytest.raises(json.JSONDecodeError):
            json_value(broken)


def test_size_limit() -> None:
    with pytest.raises(PayloadTooLarge, match="over the limit of 10"):
        canonical_json("x" * 20, limit=10)


any_text = st.text(st.characters(codec=None))  # NUL and lone surrogates included
any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | any_text,
    lambda children: st.lists(children) | st.dictionaries(any_text, children),
    max_leaves=30,
)


@given(any_json)
def test_the_fast_scan_never_passes_what_the_walk_refuses(value: object) -> None:
    """canonical_json walks the value only when json_text_fits says no: it must never say
    yes to a value check_json_value refuses."""
    text = json.dumps(value, ensure_ascii=False)
    if json_text_fits(text):
        check_json_value(value, "value")


@given(st.integers(min_value=1, max_value=80))
def test_the_fast_scan_measures_nesting_like_the_walk(levels: int) -> None:
    value: object = "x]}["
    for _ in range(levels):
        value = [{"k[": value}] if levels % 2 else [value]
    text = json.dumps(value, ensure_ascii=False)
    try:
        check_json_value(value, "value")
    except NotJSONSerializable:
        assert not json_text_fits(text)
    else:
        assert json_text_fits(text)
