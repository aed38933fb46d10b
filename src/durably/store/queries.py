"""Each backend's statements, by name, from its ``sql/<backend>/queries.sql``.

The file is a list of ``-- name: <name>`` headers, each followed by a one-line comment and
one statement (the style of procrastinate's ``queries.sql``). Statements take parameters by
name only (``:name`` for SQLite, ``%(name)s`` for PostgreSQL): no SQL is ever assembled
from values.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from importlib import resources
from operator import itemgetter
from typing import Any

_HEADER = re.compile(r"^-- name: (\w+)[ \t]*$", re.MULTILINE)


@functools.cache
def queries(backend: str) -> dict[str, str]:
    """name -> statement, read once per process."""
    text = (resources.files("durably.store") / "sql" / backend / "queries.sql").read_text()
    parts = _HEADER.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        # One line per statement, as server logs and protocol traces show it; the files
        # hold no string literal with a run of spaces for this to change.
        statement = " ".join(" ".join(lines).split()).rstrip(";").rstrip()
        if not statement or name in found:
            raise ValueError(f"sql/{backend}/queries.sql: {name} is empty or defined twice")
        found[name] = statement
    return found


Picker = Callable[[dict[str, Any]], tuple[Any, ...]]


def numbered(sql: str, placeholder: re.Pattern[str], mark: str) -> tuple[str, Picker]:
    """``sql`` with each named parameter (``placeholder``'s group 1) written as ``mark``
    and its number (``?1``, ``$1``; a name used twice is one parameter), and a function
    picking the parameters in that order from a plan's parameters by name. Drivers bind a
    sequence for a fraction of what they spend on a mapping."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"{mark}{names.index(match[1]) + 1}"

    text = placeholder.sub(number, sql)
    if len(names) == 1:
        (only,) = names
        return text, lambda params: (params[only],)
    return text, itemgetter(*names) if names else lambda params: ()
