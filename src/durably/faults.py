"""Crash injection: ``DURABLY_CRASH_AT=<point>[:<n>]`` exits the process at the n-th visit.

The exit is ``os._exit(77)``: no ``finally`` blocks, no flushing, no atexit — exactly what a
SIGKILL or a power cut leaves behind. The contract points are listed in ``CRASH_POINTS``;
tools may add their own with :func:`crash_point`.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

from durably.errors import ConfigurationError

CRASH_EXIT_CODE = 77

CRASH_POINTS = (
    "effect.before_intent",
    "effect.after_intent",
    "effect.after_call",
    "effect.after_record",
    "step.after_record",
    "checkpoint.after_write",
    "approval.after_request",
)

_visits: Counter[str] = Counter()
_parsed: dict[str, tuple[str, int]] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("DURABLY_CRASH_AT", "").strip()
    if not spec:
        return None
    if spec in _parsed:
        return _parsed[spec]
    name, _, count = spec.partition(":")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ConfigurationError(
            f"DURABLY_CRASH_AT={spec!r}: expected <point>[:<n>] with n a positive integer"
        ) from None
    if n < 1:
        raise ConfigurationError(f"DURABLY_CRASH_AT={spec!r}: n must be at least 1")
    _parsed[spec] = (name, n)
    return name, n


def crash_point(name: str) -> None:
    """Mark a crash window; exits the process here if ``DURABLY_CRASH_AT`` selects it.

    Example, in a tool you want to test: ``durably.crash_point("payments.after_capture")``.
    """
    target = _target()
    if target is None or target[0] != name:
        return
    _visits[name] += 1
    if _visits[name] == target[1]:
        sys.stderr.flush()
        os.write(2, f"durably: crash injected at {name} (visit {target[1]})\n".encode())
        os._exit(CRASH_EXIT_CODE)
