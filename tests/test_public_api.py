"""The public API is exactly what durably/__init__.py exports."""

from __future__ import annotations

import durably


def test_all_is_sorted_and_complete() -> None:
    assert durably.__all__ == sorted(durably.__all__)
    public = {n for n in dir(durably) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(durably, n)).__name__ == "module"}
    # `annotations` is the __future__ import, not API.
    assert public - modules - {"annotations"} == set(durably.__all__)


def test_every_error_is_a_durably_error() -> None:
    for name in durably.__all__:
        obj = getattr(durably, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, durably.DurablyError), name


def test_errors_can_be_caught_by_kind() -> None:
    """Integrations catch a group: the caller's input, the store, or a run that must stop."""
    groups = {
        durably.InputError: {"InvalidInput", "NotJSONSerializable", "PayloadTooLarge"},
        durably.StoreError: {"StoreUnavailable", "SchemaTooNew"},
        durably.RunStopError: {
            "IdempotencyConflict",
            "NonDeterminismError",
            "LeaseLostError",
            "CheckpointCorrupted",
            "CheckpointNotMigratable",
            "BudgetExceeded",
            "NotAwaited",
            "ReplayBlocked",
        },
    }
    for group, members in groups.items():
        for name in members:
            assert issubclass(getattr(durably, name), group), (name, group)
        others = {n for n in durably.__all__ if n not in members and n != group.__name__}
        for name in others:
            obj = getattr(durably, name)
            assert not (isinstance(obj, type) and issubclass(obj, group)), (name, group)


def test_a_stop_is_not_an_exception() -> None:
    """Inside a workflow a stop arrives as RunStopped, which ``except Exception`` (an agent
    framework's tool error handler) does not catch."""
    assert issubclass(durably.RunStopped, BaseException)
    assert not issubclass(durably.RunStopped, Exception)
    stop = durably.RunStopped(durably.LeaseLostError("gone", run_id="r1"))
    assert isinstance(stop.error, durably.RunStopError)
    assert str(stop) == "gone"
