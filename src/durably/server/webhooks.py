"""Signed webhook intake: external systems send events to runs.

``POST /webhooks/events`` follows the Standard Webhooks scheme
(https://www.standardwebhooks.com): the sender signs ``{webhook-id}.{webhook-timestamp}.{body}``
with HMAC-SHA256 and sends ``webhook-signature: v1,<base64> [v1,<base64> ...]``. A secret
written ``whsec_<base64>`` is the base64-encoded key, as the spec has it; any other secret is
used as its UTF-8 bytes; a key under 24 bytes is refused at startup. Several secrets may be
configured during a rotation: any one matching is enough. Timestamps more than five minutes
off (either way) are refused, so a captured request cannot be replayed later; within that
window the ``webhook-id`` is the event id, so the run's inbox ignores a redelivery. Headers
and timestamp are checked before the body is read.

The body is ``{"run_id": ..., "name": ..., "payload": ...}``. Nothing is recorded unless the
request is authentic and well-formed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from durably.app import App
from durably.errors import ConfigurationError
from durably.server.errors import ApiError, DurablyRoute, ErrorOut, decode_json
from durably.server.settings import ServerSettings, durably_app, settings

TOLERANCE_SECONDS = 5 * 60
MAX_BODY_BYTES = 256 * 1024
MIN_SECRET_BYTES = 24

# ASCII digits, bounded: str.isdigit() accepts other digits and int() refuses huge strings.
_DIGITS = re.compile(r"[0-9]{1,15}")

router = APIRouter(route_class=DurablyRoute)


class WebhookDelivery(BaseModel):
    status: Literal["delivered", "duplicate ignored"]
    run_id: str
    name: str
    event_id: str


def secret_key(secret: str) -> bytes:
    """The HMAC key of a configured secret: ``whsec_<base64>`` decoded, else its UTF-8."""
    if secret.startswith("whsec_"):
        return base64.b64decode(secret[len("whsec_") :], validate=True)
    return secret.encode()


def check_secrets(secrets: Sequence[str]) -> tuple[str, ...]:
    """``secrets`` if every one is a usable key, else :class:`ConfigurationError` at startup.

    A short key can be brute-forced offline from a single signed request, and ``whsec_``
    alone would be an empty key that anyone can sign with.
    """
    for n, secret in enumerate(secrets, 1):
        where = f"webhook secret #{n} in $DURABLY_WEBHOOK_SECRETS"
        try:
            key = secret_key(secret)
        except (binascii.Error, ValueError):
            raise ConfigurationError(
                f"{where} starts with whsec_ but the rest is not base64; write it as "
                "whsec_<base64 of the key>, e.g. whsec_$(openssl rand -base64 32)"
            ) from None
        if len(key) < MIN_SECRET_BYTES:
            raise ConfigurationError(
                f"{where} is a {len(key)}-byte key; use at least {MIN_SECRET_BYTES} random "
                "bytes, e.g. whsec_$(openssl rand -base64 32)"
            )
    return tuple(secrets)


def sign(secret: str, webhook_id: str, timestamp: str, body: bytes) -> str:
    """The ``v1,<base64>`` signature of one message (what a sender puts in the header)."""
    content = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_matches(
    secrets: Iterable[str], webhook_id: str, timestamp: str, body: bytes, header: str
) -> bool:
    given = [
        part.partition(",")[2].encode()
        for part in header.split()
        if part.startswith("v1,") and len(part) > 3
    ]
    matched = False
    for secret in secrets:
        expected = sign(secret, webhook_id, timestamp, body).partition(",")[2].encode()
        for candidate in given:
            # Every comparison runs, so timing reveals nothing about which one matched.
            matched |= hmac.compare_digest(expected, candidate)
    return matched


async def _read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None once it exceeds ``limit`` bytes (without reading the rest)."""
    declared = request.headers.get("content-length")
    if declared is not None and _DIGITS.fullmatch(declared) and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "WebhookUnauthorized", message)


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "WebhookMalformed", message)


def _check_headers(headers: dict[str, str], now: float) -> None:
    """What can be refused before the body is read: missing headers, a stale timestamp."""
    if not all(headers.values()):
        raise _unauthorized(
            "missing webhook-id, webhook-timestamp or webhook-signature header "
            "(sign requests per the Standard Webhooks scheme)"
        )
    timestamp = headers["webhook-timestamp"]
    if not _DIGITS.fullmatch(timestamp):
        raise _unauthorized(f"webhook-timestamp {timestamp[:40]!a} is not unix seconds")
    skew = int(timestamp) - now
    if abs(skew) > TOLERANCE_SECONDS:
        direction = "in the future" if skew > 0 else "old"
        raise _unauthorized(
            f"webhook-timestamp is {abs(skew):.0f}s {direction}, outside the "
            f"{TOLERANCE_SECONDS}s tolerance; check the sender's clock, and sign each "
            "delivery (retries too) with the current time"
        )


def _parse(body: bytes) -> tuple[str, str, Any]:
    doc = decode_json(body, "the webhook body")
    if not isinstance(doc, dict):
        raise _bad_request('body must be a JSON object {"run_id", "name", "payload"}')
    run_id, name = doc.get("run_id"), doc.get("name")
    if not isinstance(run_id, str) or not run_id or not isinstance(name, str) or not name:
        raise _bad_request('body needs "run_id" and "name" as non-empty strings')
    return run_id, name, doc.get("payload")


_BODY_SCHEMA = {
    "type": "object",
    "required": ["run_id", "name"],
    "properties": {
        "run_id": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1},
        "payload": {},
    },
}


@router.post(
    "/webhooks/events",
    tags=["webhooks"],
    responses={
        400: {"model": ErrorOut, "description": "Malformed body."},
        401: {"model": ErrorOut, "description": "Bad signature or stale timestamp."},
        404: {"model": ErrorOut, "description": "No such run."},
        409: {"model": ErrorOut, "description": "The run is finished."},
        413: {"model": ErrorOut, "description": f"Body over {MAX_BODY_BYTES} bytes."},
        503: {"model": ErrorOut, "description": "No webhook secrets configured."},
    },
    openapi_extra={
        "parameters": [
            {"name": h, "in": "header", "required": True, "schema": {"type": "string"}}
            for h in ("webhook-id", "webhook-timestamp", "webhook-signature")
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _BODY_SCHEMA}},
        },
    },
)
async def receive_event(
    request: Request,
    app: Annotated[App, Depends(durably_app)],
    config: Annotated[ServerSettings, Depends(settings)],
) -> WebhookDelivery:
    """Deliver a signed external event to a run, once per ``webhook-id``."""
    if not config.webhook_secrets:
        raise ApiError(
            503,
            "WebhooksNotConfigured",
            "webhooks not configured: set $DURABLY_WEBHOOK_SECRETS (comma-separated)",
        )
    headers = {
        name: request.headers.get(name, "")
        for name in ("webhook-id", "webhook-timestamp", "webhook-signature")
    }
    _check_headers(headers, time.time())
    body = await _read_limited(request, MAX_BODY_BYTES)
    if body is None:
        raise ApiError(413, "PayloadTooLarge", f"webhook body over {MAX_BODY_BYTES} bytes")
    if not signature_matches(
        config.webhook_secrets,
        headers["webhook-id"],
        headers["webhook-timestamp"],
        body,
        headers["webhook-signature"],
    ):
        raise _unauthorized("webhook-signature does not match any configured secret")
    run_id, name, payload = _parse(body)
    event_id = headers["webhook-id"]
    status = await app.send_event_async(run_id, name, payload, event_id=event_id)
    return WebhookDelivery(status=status, run_id=run_id, name=name, event_id=event_id)
