"""Every error durably raises, in one tree.

::

    DurablyError
    ├── ConfigurationError          bad decorator options, unknown workflow, bad database URL
    ├── InputError                  refused before anything was written; fix the input
    │   ├── InvalidInput            a malformed id or text, or input that misfits a signature
    │   ├── NotJSONSerializable     a value that must be stored is not plain, storable JSON
    │   └── PayloadTooLarge         a stored value is over the size limit
    ├── OutsideRunError             a step or tool called outside a workflow run
    ├── RunNotFound
    ├── InvalidTransition           the run or effect is not in a state that allows the request
    ├── RunStopError                this run must stop here; a person or another worker goes on
    │   ├── IdempotencyConflict     same key (or run id), different input
    │   ├── NonDeterminismError     replayed workflow code called something else at a position
    │   ├── LeaseLostError          another worker owns the run now; this one must stop
    │   ├── CheckpointCorrupted     checksum mismatch and no verified fallback
    │   ├── NotAwaited              the workflow returned leaving a call un-awaited
    │   ├── ReplayBlocked           a fork's call would make a real effect its mode forbids
    │   └── BudgetExceeded          a run went over its budget (the run pauses with it)
    ├── StoreError                  the database, not the request
    │   ├── StoreUnavailable        the database cannot be reached or refused the transaction
    │   └── SchemaTooNew            the database was migrated by newer code
    ├── StepFailed                  a step or tool failed for good; raised inside the workflow
    ├── WaitTimeout                 wait_for_event's timeout passed; raised inside the workflow
    ├── ApprovalRejected            a person rejected the approval; raised inside the workflow
    ├── ApprovalExpired             an approval was decided or used after its expiry
    ├── ToolError                   raised BY a tool to state the failure category
    └── OutcomeUnknown              raised BY a tool: the request may have taken effect

    RunStopped (a BaseException)    unwinds workflow code when its run stops here

Each error carries the ids it is about as attributes (``run_id``, ``step_id``,
``idempotency_key``) and its message says what to do next. Catch a group to handle its
kind: ``InputError`` is the caller's to fix (a 4xx), ``StoreError`` is worth a retry later,
and a ``RunStopError`` means nothing more of that run may happen in this process.

Inside a workflow a stop never arrives as a ``RunStopError``: it arrives as
:class:`RunStopped`, which ``except Exception`` does not catch, so neither workflow code nor
an agent framework that turns every exception into a message for the model can carry on
after it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from durably.status import FailureCategory


class DurablyError(Exception):
    """Base class of every error raised by durably."""

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        step_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.step_id = step_id
        self.idempotency_key = idempotency_key


class ConfigurationError(DurablyError):
    """The app, a decorator or a URL is configured wrongly."""


class InputError(DurablyError):
    """Input durably refused before writing anything: fix it and ask again."""


class RunStopError(DurablyError):
    """The run must stop here: what comes next needs a person, a fix, or the worker that
    owns the run now. Nothing more of the run happens in this process."""


class StoreError(DurablyError):
    """The database, not the request: unreachable, failing, or migrated by newer code."""


class NotJSONSerializable(InputError):
    """A value that durably must persist is not plain JSON (dict, list, str, number, bool, None)."""


class PayloadTooLarge(InputError):
    """A value that durably must persist exceeds the configured size limit."""


class InvalidInput(InputError):
    """A malformed id or text, or a run's input that does not fit its workflow's signature."""


class OutsideRunError(DurablyError):
    """A step, tool or in-workflow function was used outside a workflow run."""


class RunNotFound(DurablyError):
    """No run has this id."""


class InvalidTransition(DurablyError):
    """The run or effect is not in a state that allows what was asked."""


class IdempotencyConflict(RunStopError):
    """The same idempotency key (or run id) was used with a different input."""


class NonDeterminismError(RunStopError):
    """Replayed workflow code made a different call at a recorded position.

    ``divergence``: what differs, as recorded with the paused run (``kind``, ``step_id``,
    ``name``, ``matched`` — the calls replayed before it); ``durably replay`` reports it.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        step_id: str | None = None,
        divergence: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id, step_id=step_id)
        self.divergence = divergence


class LeaseLostError(RunStopError):
    """This worker's lease on the run expired and another worker took it over."""


class CheckpointCorrupted(RunStopError):
    """A checkpoint failed its checksum and the journal could not be verified otherwise."""


class CheckpointNotMigratable(RunStopError):
    """A checkpoint is intact but written in a schema version this code cannot read: newer
    than it knows, or older with no registered migration. Not corruption: deploy the newer
    durably, or register the migration, then resume."""


class NotAwaited(RunStopError):
    """The workflow returned while a step or tool call it created was never awaited (a
    missing ``await``): that call never happened, so the run pauses instead of completing."""


class ReplayBlocked(RunStopError):
    """A fork reached a tool call that would make a real effect, and its replay mode does
    not allow it (``DISABLED``; ``RECORDED`` with nothing recorded; ``SANDBOX`` without a
    sandbox): nothing was sent and the fork pauses."""


class SchemaTooNew(StoreError):
    """The database schema was written by a newer durably than this one."""


class StoreUnavailable(StoreError):
    """The database could not be reached, or a transaction failed for a reason outside
    durably (connection lost, disk full). Nothing of that transaction was applied unless the
    connection broke during COMMIT; either way the run is picked up again from the store."""


class StepFailed(DurablyError):
    """A step or tool failed for good. Raised inside the workflow, which may handle it.

    ``category`` is the tool's failure category (``None`` for a plain step); ``error_type``
    and ``error_message`` describe the original exception, which is not persisted itself.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        step_id: str | None = None,
        idempotency_key: str | None = None,
        category: FailureCategory | None = None,
        error_type: str = "",
        error_message: str = "",
    ) -> None:
        super().__init__(message, run_id=run_id, step_id=step_id, idempotency_key=idempotency_key)
        self.category = category
        self.error_type = error_type
        self.error_message = error_message


class WaitTimeout(DurablyError):
    """No event arrived before ``wait_for_event``'s timeout. Raised inside the workflow."""


class ApprovalRejected(DurablyError):
    """The approval was rejected. Raised inside the workflow, which may handle it."""

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        step_id: str | None = None,
        approval_id: str = "",
        by: str | None = None,
        comment: str | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id, step_id=step_id)
        self.approval_id = approval_id
        self.by = by
        self.comment = comment


class ApprovalExpired(DurablyError):
    """The approval expired before it was decided or used; a new one is requested."""


class BudgetExceeded(RunStopError):
    """A run went over its workflow's budget; recorded as the reason its run paused."""


class ToolError(DurablyError):
    """Raise from a tool to say how it failed, so durably knows whether a retry is safe.

    Example::

        raise durably.ToolError("card declined", category=FailureCategory.BUSINESS_REJECTED)
    """

    def __init__(
        self,
        message: str,
        *,
        category: FailureCategory,
        retry_after: timedelta | None = None,
    ) -> None:
        super().__init__(message)
        # Its value as a plain string ("PERMISSION") is the same category; any other fails
        # here, in the tool, which leaves the call's outcome unknown rather than misread.
        self.category = FailureCategory(category)
        self.retry_after = retry_after


class OutcomeUnknown(DurablyError):
    """Raise from a tool when the request may have reached the service but no answer came.

    ``external_id``: the service's id for the operation, if the tool knows it (a job id
    accepted before the connection broke); ``reconcile`` gets it as
    ``op.external_operation_id``.
    """

    def __init__(
        self,
        message: str,
        *,
        external_id: str | None = None,
        run_id: str | None = None,
        step_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id, step_id=step_id, idempotency_key=idempotency_key)
        self.external_id = external_id


class RunStopped(BaseException):
    """Unwinds workflow code because its run stops here: it paused, waits, was cancelled,
    lost its lease, or replay found a divergence (``error`` says which, if any).

    A ``BaseException``, like ``asyncio.CancelledError``: ``except Exception`` in workflow
    or framework code cannot swallow it, and once it has been raised every later step or
    tool call of the run raises it again instead of executing. Clean up in ``finally``;
    never catch it. The run is then continued (or paused for a person) from what the store
    holds.
    """

    def __init__(self, error: DurablyError | None = None) -> None:
        super().__init__(str(error) if error is not None else "the run stops here")
        self.error = error
        """The ``RunStopError`` (or ``StoreError``) behind the stop, if it is an error."""
