"""Canonical JSON, input hashes and idempotency keys: the identities the ledger is built on."""

from __future__ import annotations

import hashlib
import hmac
import json
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any

from durably.errors import NotJSONSerializable, PayloadTooLarge
from durably.values import check_json_value, json_text_fits

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024

# Built once, and called without JSONEncoder.encode's wrapping, which builds a C encoder per
# call and costs more than encoding a step's small value. No circular check (markers None):
# durably's own values have no cycles, and a caller's cycle recurses until RecursionError,
# which canonical_json reports. An encoder keeps no state between calls (thread-safe).
# c_make_encoder takes (markers, default, encoder, indent, key_separator, item_separator,
# sort_keys, skipkeys, allow_nan), positionally only.
_canonical_chunks = c_make_encoder(
    None, json.JSONEncoder().default, encode_basestring, None, ":", ",",
    True, False, False,
)  # fmt: skip
_plain_chunks = c_make_encoder(
    None, json.JSONEncoder().default, encode_basestring, None, ":", ",",
    True, False, True,
)  # fmt: skip
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _canonical(value: Any) -> str:
    return "".join(_canonical_chunks(value, 0))


def _plain(value: Any) -> str:
    return "".join(_plain_chunks(value, 0))


def json_value(text: str) -> Any:
    """``json.loads(text)``, in about half its time for the text durably wrote (one value, no
    surrounding whitespace): anything else is read by ``json.loads`` itself."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def canonical_json(value: Any, *, what: str = "value", limit: int | None = None) -> str:
    """Serialise ``value`` to canonical JSON (sorted keys, compact) or raise a typed error.

    A value must come back *equal* after a round trip: tuples, non-string keys and the
    like would replay as something else than the original call saw, so they are refused;
    so are strings no store can hold and nesting past ``values.MAX_JSON_DEPTH``.
    """
    try:
        text = _canonical(value)
    except RecursionError:
        check_json_value(value, what)  # names the nesting
        raise
    except (TypeError, ValueError) as exc:
        raise NotJSONSerializable(
            f"{what} is not plain JSON ({exc}); return or pass dicts, lists, str, int, float, "
            "bool or None (convert dataclasses with dataclasses.asdict, datetimes with "
            ".isoformat())"
        ) from exc
    if not json_text_fits(text):
        # Rare: walk the value to name what no store can hold (the scan may also have seen
        # a harmless literal backslash-u0000).
        check_json_value(value, what)
    if json_value(text) != value:
        raise NotJSONSerializable(
            f"{what} does not survive a JSON round trip unchanged (tuples, sets or non-string "
            "dict keys?); use lists and string keys"
        )
    if limit is not None and len(text) > limit:
        raise PayloadTooLarge(
            f"{what} is {len(text)} bytes of JSON, over the limit of {limit}; store large "
            "data elsewhere and pass a reference (or raise App(max_payload_bytes=...))"
        )
    return text


def plain_json(value: Any) -> str:
    """Canonical JSON of a value durably built itself (events, checkpoints): no checks."""
    return _plain(value)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def keyed_hex(key: bytes, purpose: str, text: str) -> str:
    """HMAC-SHA256 of ``text`` under a key derived from ``key`` for ``purpose`` alone.

    One secret serves several purposes (input hashes, redacted values, checkpoint seals);
    deriving a key per purpose keeps a value hashed for one (a redacted argument an attacker
    chose) from ever being a valid hash for another (the seal of a forged checkpoint).
    """
    derived = hmac.new(key, b"durably/" + purpose.encode(), hashlib.sha256).digest()
    return hmac.new(derived, text.encode(), hashlib.sha256).hexdigest()


def input_hash(
    name: str, version: str, arguments: dict[str, Any], *, key: bytes | None = None
) -> str:
    """sha256 of the canonical JSON of a call's name, version and arguments.

    With ``key`` (the App's secret, for a tool with ``redact=``) it is an HMAC over the same
    JSON instead: a plain hash of a low-entropy value (a PIN) is reversed by trying them all.
    """
    text = canonical_json({"name": name, "version": version, "arguments": arguments}, what="input")
    return sha256_hex(text) if key is None else keyed_hex(key, "input_hash", text)


KEY_SCHEME = 2
"""The key derivation new runs get (a run keeps the scheme it started with)."""


def idempotency_key(
    tenant: str,
    run_id: str,
    plan_version: int,
    step_id: str,
    operation_group: str,
    *,
    scheme: int = KEY_SCHEME,
) -> str:
    """sha256 of (tenant, run_id, plan_version, step_id, operation_group) — stable across
    retries and recoveries, distinct for distinct parts.

    Scheme 2 hashes the parts as a JSON array, so no value can imitate a boundary. Scheme 1
    joined them with ``|`` — tenant ``a`` + run ``x|y`` and tenant ``a|x`` + run ``y`` then
    shared a key; it is kept only to replay runs recorded under it with their original keys.
    """
    if scheme == 1:
        return sha256_hex("|".join((tenant, run_id, str(plan_version), step_id, operation_group)))
    # The parts are text and integers: _plain writes them as json.dumps(separators=(",",
    # ":"), ensure_ascii=False) does, which the keys recorded so far were hashed over.
    return sha256_hex(
        _plain(
            [
                "durably.idempotency_key",
                scheme,
                tenant,
                run_id,
                plan_version,
                step_id,
                operation_group,
            ]
        )
    )


def undo_key(effect_key: str) -> str:
    """The idempotency key of the undo of the effect first recorded under ``effect_key`` (a
    fork's copies name that key as their origin). One key for every run holding a record of
    the effect, so the ledger lets only one of them undo it, once."""
    return sha256_hex(_plain(["durably.undo_key", effect_key]))
