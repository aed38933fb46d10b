"""What durably accepts to store: ids, short texts and JSON values, checked before any write.

A value the database cannot hold (a lone UTF-16 surrogate, which no UTF-8 encoder accepts;
a NUL, which PostgreSQL refuses in text and JSON) must be refused where it enters, with an
error naming it, and never discovered by the store halfway through recording an effect that
already happened. Nesting is bounded too: every reader (the API, the CLI, ``json``) recurses.
"""

from __future__ import annotations

import re
from datetime import timedelta
from enum import Enum
from typing import Any, TypeVar

from durably.errors import ConfigurationError, InvalidInput, NotJSONSerializable

E = TypeVar("E", bound=Enum)

MAX_JSON_DEPTH = 64
"""How deep arrays and objects may nest in any stored JSON value."""

MAX_ID_CHARS = 128
MAX_NAME_CHARS = 200
MAX_TEXT_CHARS = 4000
MAX_LIST = 100_000
"""Runs one listing returns at most: all of them are held in memory at once."""
MAX_SEQUENCE = 2**63 - 1
"""The largest event sequence a store holds (a 64-bit integer)."""

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
# C0 and C1 controls and DEL: they rewrite a terminal (escape sequences) or hide text.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def check_id(value: object, what: str) -> str:
    """A run id or tenant: 1 to 128 ASCII letters, digits and ``. _ : @ -``, not starting with
    punctuation. Ids are parts of idempotency keys, URLs and file-like names, so nothing
    that a URL, a shell or a key derivation could read another way is accepted."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
    if not value or len(value) > MAX_ID_CHARS or not _ID.fullmatch(value):
        raise InvalidInput(
            f"{what} {_shown(value)} is not a valid id: use 1 to {MAX_ID_CHARS} ASCII letters, "
            "digits and . _ : @ - (starting with a letter or digit)"
        )
    return value


def check_count(value: object, what: str, *, low: int, high: int) -> int:
    """A whole number from ``low`` to ``high`` (a bool is no count)."""
    if type(value) is not int or not low <= value <= high:
        raise InvalidInput(f"{what} must be a whole number from {low} to {high}, not {value!r:.50}")
    return value


def check_duration(value: object, what: str, *, zero: bool = False) -> timedelta:
    """A setting's length of time: a ``timedelta`` above zero (or zero, if ``zero``)."""
    if not isinstance(value, timedelta) or value < timedelta(0) or (not value and not zero):
        least = "zero or more" if zero else "above zero"
        raise ConfigurationError(f"{what} must be a timedelta {least}, not {value!r:.50}")
    return value


def check_setting(value: object, what: str, *, low: int) -> int:
    """A setting's whole number, at least ``low``."""
    if type(value) is not int or value < low:
        raise ConfigurationError(
            f"{what} must be a whole number of at least {low}, not {value!r:.50}"
        )
    return value


def check_choice(value: object, choices: type[E], what: str) -> E:
    """``value`` as one of the enum ``choices`` (given as the member or its value)."""
    try:
        return choices(value)
    except ValueError:
        names = ", ".join(repr(c.value) for c in choices)
        raise InvalidInput(f"{what} must be one of {names}, not {value!r:.50}") from None


def check_text(
    value: object, what: str, *, max_chars: int = MAX_NAME_CHARS, lines: bool = False
) -> str:
    """A name, event id, approver or comment: no control characters (``lines``: tabs and
    newlines allowed), no lone surrogates, at most ``max_chars``."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidInput(f"{what} must not be empty")
    if len(value) > max_chars:
        raise InvalidInput(f"{what} is {len(value)} characters long; at most {max_chars} are kept")
    if (_CONTROL_BUT_LINES if lines else _CONTROL).search(value):
        raise InvalidInput(
            f"{what} {_shown(value)} contains control characters; use printable text"
        )
    if not _encodable(value):
        raise InvalidInput(
            f"{what} {_shown(value)} contains a lone UTF-16 surrogate, which cannot be stored; "
            "decode the source text properly (errors='replace')"
        )
    return value


def check_ref(value: object, what: str) -> str:
    """An id naming a record that exists already (a run id to look up): text as
    :func:`check_text` accepts it, up to :data:`MAX_TEXT_CHARS`, so runs recorded before ids
    were checked stay reachable."""
    return check_text(value, what, max_chars=MAX_TEXT_CHARS)


def check_json_value(value: Any, what: str) -> None:
    """Refuse what no store can hold or no reader can walk: nesting deeper than
    :data:`MAX_JSON_DEPTH`, and strings (values or keys) with a NUL or a lone surrogate."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_json_string(item, what)
        elif isinstance(item, dict | list | tuple):
            if depth > MAX_JSON_DEPTH:
                raise NotJSONSerializable(
                    f"{what} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects; "
                    "flatten it"
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    if isinstance(key, str):
                        _check_json_string(key, what)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def storable_text(text: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """``text`` made storable rather than refused: for what durably records about a failure
    (an exception's message), which must be recorded whatever it holds. NUL and lone
    surrogates are escaped, and the text is cut at ``max_chars``."""
    if len(text) > max_chars:
        text = text[: max_chars - 3] + "..."
    text = text.replace("\x00", "\\x00")
    if not _encodable(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


# A JSON string literal, escapes included: what is left outside them is structure.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def json_text_fits(text: str) -> bool:
    """A fast look at JSON text (``ensure_ascii=False``) for what :func:`check_json_value`
    refuses: False if it may hold a NUL (always escaped as ``\u0000``), a lone surrogate
    (unencodable) or nesting deeper than :data:`MAX_JSON_DEPTH`. On the hot path, so the
    value itself is only walked when this says False."""
    if "\\u0000" in text or not _encodable(text):
        return False
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return True  # not even every bracket, in strings or not, nests that deep
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest <= MAX_JSON_DEPTH


def _check_json_string(text: str, what: str) -> None:
    if text.isascii():
        if "\x00" in text:
            raise NotJSONSerializable(
                f"{what} contains a NUL character (\\u0000), which databases cannot store in "
                "text; remove it or encode binary data (base64)"
            )
        return
    if "\x00" in text or not _encodable(text):
        raise NotJSONSerializable(
            f"{what} contains a NUL character or a lone UTF-16 surrogate ({_shown(text)}), "
            "which cannot be stored; decode the source text properly (errors='replace') and "
            "encode binary data (base64)"
        )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(value: str) -> str:
    """``value`` quoted for an error message, controls and surrogates escaped, cut short."""
    cut = value if len(value) <= 60 else value[:57] + "..."
    return ascii(cut)
