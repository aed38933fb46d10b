"""What a reconcile function receives (:class:`Operation`) and answers (:class:`Reconciliation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from durably.status import FailureCategory
from durably.values import storable_text

Answer = Literal["succeeded", "failed", "not_executed", "running", "unresolved"]


@dataclass(frozen=True)
class Operation:
    """One recorded side effect, as reconcile and compensate functions see it.

    Arguments named in ``@app.tool(redact=[...])`` appear as ``{"redacted": "<hmac>"}``.
    ``result`` is set for a succeeded operation (compensation), else ``None``.
    """

    run_id: str
    step_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str
    external_operation_id: str | None
    attempt: int
    result: Any = None


@dataclass(frozen=True)
class Reconciliation:
    """The external system's answer to "did this operation happen?".

    Example::

        def find_coupon(op: durably.Operation) -> durably.Reconciliation:
            found = shop.lookup(op.arguments["customer"], op.arguments["campaign"])
            if found:
                return durably.Reconciliation.succeeded(found[0], duplicates=len(found) - 1)
            return durably.Reconciliation.not_executed()
    """

    answer: Answer
    result: Any = None
    category: FailureCategory | None = None
    detail: str = ""
    duplicates: int = 0

    def __post_init__(self) -> None:
        # The detail is recorded with the run's pause: whatever the service said must fit.
        object.__setattr__(self, "detail", storable_text(str(self.detail)))
        if not isinstance(self.duplicates, int) or self.duplicates < 0:
            raise ValueError(f"duplicates must be a count (0 or more), not {self.duplicates!r}")

    @classmethod
    def succeeded(cls, result: Any, *, duplicates: int = 0) -> Reconciliation:
        """It happened; ``result`` is what the tool would have returned.

        ``duplicates`` reports extra copies the service holds (an earlier bug or a peer that
        retried blindly); they are counted in ``agent_duplicate_side_effect_total``.
        """
        return cls("succeeded", result=result, duplicates=duplicates)

    @classmethod
    def failed(cls, category: FailureCategory, detail: str = "") -> Reconciliation:
        """It was attempted and definitely failed; nothing took effect."""
        return cls("failed", category=category, detail=detail)

    @classmethod
    def not_executed(cls) -> Reconciliation:
        """The service never saw it: safe to execute with the same idempotency key."""
        return cls("not_executed")

    @classmethod
    def running(cls) -> Reconciliation:
        """It is still in progress: ask again later."""
        return cls("running")

    @classmethod
    def unresolved(cls, detail: str = "") -> Reconciliation:
        """Nobody can tell: a person must resolve it."""
        return cls("unresolved", detail=detail)
