"""Canonical JSON, input hashes and idempotency keys."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durably.errors import NotJSONSerializable, PayloadTooLarge
from durably.keys import canonical_json, idempotency_key, input_hash, sha256_hex

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), json_values))
def test_input_hash_ignores_key_order(arguments: dict[str, object]) -> None:
    reordered = dict(reversed(list(arguments.items())))
    assert input_hash("t", "1", arguments) == input_hash("t", "1", reordered)


def test_input_hash_binds_name_version_and_arguments() -> None:
    base = input_hash("send", "1", {"to": "a"})
    assert base != input_hash("send", "2", {"to": "a"})
    assert base != input_hash("mail", "1", {"to": "a"})
    assert base != input_hash("send", "1", {"to": "b"})


def test_idempotency_key_is_the_documented_formula() -> None:
    key = idempotency_key("acme", "run_1", 2, "send#1", "send")
    assert key == sha256_hex("acme|run_1|2|send#1|send")
    assert key != idempotency_key("acme", "run_1", 3, "send#1", "send")


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, {1, 2}, (1, 2), {1: "int key"}, object(), b"bytes"],
)
def test_values_that_would_not_replay_identically_are_refused(value: object) -> None:
    with pytest.raises(NotJSONSerializable):
        canonical_json(value)


def test_size_limit() -> None:
    with pytest.raises(PayloadTooLarge, match="over the limit of 10"):
        canonical_json("x" * 20, limit=10)
