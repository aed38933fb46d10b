"""Redacted tool arguments: what is stored instead of them, and what is scrubbed of them.

A tool's ``redact=[names]`` arguments never reach the store, the event log, the API or a
log line in clear. Their stored form and the call's input hash are HMACs under the App's
secret (see :func:`durably.keys.keyed_hex`), so a low-entropy value (a PIN) cannot be found
by hashing every candidate; error messages a tool or its reconciler writes are scrubbed.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from durably.definitions import ToolDef
from durably.keys import canonical_json, keyed_hex

REDACTED = "[redacted]"


def redacted_names(tool: ToolDef, arguments: dict[str, Any]) -> list[str]:
    """The arguments of this call that ``redact=`` covers. ``bind_arguments`` stores those
    gathered by ``**kwargs`` under their own names, so naming it covers each of them."""
    params = tool.signature.parameters
    names: list[str] = []
    for name in tool.redact:
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            names.extend(a for a in arguments if a not in params)
        elif name in arguments:
            names.append(name)
    return names


def redact(tool: ToolDef, secret: bytes | None, arguments: dict[str, Any]) -> dict[str, Any]:
    """Arguments as stored: the ones ``redact=`` covers replaced by ``{"redacted": <HMAC>}``
    under the App's secret, which is never stored."""
    names = redacted_names(tool, arguments)
    if not names:
        return arguments
    assert secret is not None, "App.tool() refuses redact= without a secret"
    stored = dict(arguments)
    for name in names:
        text = canonical_json(stored[name], what=f"argument {name!r}")
        stored[name] = {"redacted": keyed_hex(secret, "redacted_argument", text)}
    return stored


def scrub(tool: ToolDef, arguments: dict[str, Any], text: str) -> str:
    """``text``, written by a tool or its reconciler, with each redacted value of the call
    replaced by ``[redacted]``: the values and their parts, as ``str()`` and as JSON."""
    if not tool.redact:
        return text
    texts: set[str] = set()
    stack = [arguments[name] for name in redacted_names(tool, arguments)]
    while stack:
        value = stack.pop()
        texts.add(str(value))
        for ascii_only in (False, True):  # json.dumps' default (and requests') escapes
            texts.add(json.dumps(value, ensure_ascii=ascii_only))
            texts.add(
                json.dumps(value, ensure_ascii=ascii_only, sort_keys=True, separators=(",", ":"))
            )
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    texts.discard("")
    if not texts:
        return text
    # One pass, longest first: no value is left half-replaced, no replacement re-scanned.
    pattern = "|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))
    return re.sub(pattern, REDACTED, text)
