"""Checkpoint schema versions over a real store: old checkpoints are migrated on read; one
this code cannot read pauses the run as such, never as corrupted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably import checkpoint as cp

MakeApp = Callable[..., durably.App]


def _v1_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints are written as version 1 wrote them: its number, its completed_effects."""
    draft = cp.JournalState.draft

    def v1_draft(self: cp.JournalState, **kwargs: Any) -> cp.CheckpointDraft:
        last = self.recent_effects[-1] if self.recent_effects else None
        effects = {"count": self.effects_completed, "last": last}
        return replace(draft(self, **kwargs), completed_effects=effects)

    monkeypatch.setattr(cp, "CHECKPOINT_SCHEMA_VERSION", 1)
    monkeypatch.setattr(cp.JournalState, "draft", v1_draft)


def _waiting_run(app: durably.App, calls: list[str]) -> tuple[Any, str]:
    """A run that made one effect and waits for the event ``go``."""

    @app.tool(idempotent=True)
    def charge() -> str:
        calls.append("charge")
        return "ch_1"

    @app.workflow()
    async def wf() -> list[Any]:
        charged = await charge()
        got = await durably.wait_for_event("go")
        return [charged, got, await charge(), len(calls)]

    return wf, app.run(wf).run_id


def test_a_run_checkpointed_as_version_1_resumes_on_version_2(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app()
    calls: list[str] = []
    with monkeypatch.context() as old_code:
        _v1_drafts(old_code)
        _, run_id = _waiting_run(app, calls)
    newest = app.checkpoints(run_id)[0]
    assert (newest["schema_version"], newest["status"]) == (1, "waiting_external")
    assert set(newest["completed_effects"]) == {"count", "last"}
    key = newest["completed_effects"]["last"]

    # Without the built-in migration the run pauses as unreadable, not as corrupted.
    with monkeypatch.context() as no_path:
        no_path.setattr(cp, "_migrations", {})
        app.send_event(run_id, "go", 7)
        app.worker().run(until_idle=True)
        run = app.get_run(run_id)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "checkpoint_not_migratable")
    assert run.error is not None
    assert "no registered migration" in run.error["message"]
    assert "checkpoint_corrupted" not in [e.type for e in app.events(run_id)]

    run = app.resume(run_id)
    assert run.status is RunStatus.COMPLETED
    assert run.result == ["ch_1", 7, "ch_1", 2]
    latest = app.checkpoints(run_id)[0]
    assert latest["schema_version"] == cp.CHECKPOINT_SCHEMA_VERSION == 2
    assert latest["completed_effects"]["count"] == 2
    assert latest["completed_effects"]["keys"][0] == key


def test_a_checkpoint_newer_than_the_code_pauses_the_run_as_such(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No fallback to an older checkpoint, no corruption event or metric."""
    app = make_app()
    calls: list[str] = []
    with monkeypatch.context() as newer_code:
        # A newer durably ran the run up to its wait.
        newer_code.setattr(cp, "CHECKPOINT_SCHEMA_VERSION", 3)
        _, run_id = _waiting_run(app, calls)
    assert app.checkpoints(run_id)[0]["schema_version"] == 3
    app.send_event(run_id, "go", 7)
    app.worker().run(until_idle=True)
    run = app.get_run(run_id)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "checkpoint_not_migratable")
    assert run.error is not None
    assert "newer than this durably reads" in run.error["message"]
    assert "checkpoint_corrupted" not in [e.type for e in app.events(run_id)]
    corrupted = app.metrics.step_recovery.labels(state="checkpoint_corrupted")._value.get()
    assert corrupted == 0
    assert calls == ["charge"]
