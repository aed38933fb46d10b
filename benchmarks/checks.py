"""Did every run of a throughput measurement execute exactly once?

Everything is read back through durably's public API (``App.list_runs``, ``describe``,
``events``) and checked against the tool bodies' own log of what they executed
(``bench_app``): a figure from a run that executed twice would be worthless.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import durably
from benchmarks import bench_app


class CheckFailed(Exception):
    pass


@dataclass
class RunsSeen:
    """What the database holds about the benchmark's runs after a measurement."""

    status: Counter[str] = field(default_factory=Counter)
    epochs: Counter[int | None] = field(default_factory=Counter)
    """The fencing token each completed run's result reports (1: claimed once)."""
    recovered: int = 0
    """``run_recovered`` events: a run taken over from a worker that lost it."""
    kinds: dict[str, Counter[str]] = field(default_factory=dict)
    """Per run: its journal's calls by kind (``step``, ``tool``)."""
    succeeded_effects: dict[str, int] = field(default_factory=dict)
    first_step_at: float | None = None
    """When the first step of any run was recorded (database clock)."""
    last_completed_at: float | None = None
    """When the last run completed (database clock)."""

    @property
    def busy_s(self) -> float:
        """First step recorded to last run completed, by the database's clock."""
        assert self.first_step_at is not None
        assert self.last_completed_at is not None
        return self.last_completed_at - self.first_step_at


def read_back(url: str, runs: int) -> RunsSeen:
    seen = RunsSeen()
    app = durably.App(url)
    try:
        listed = [
            r
            for r in app.list_runs(workflow=bench_app.WORKFLOW, limit=runs + 10)
            if r.run_id.startswith(bench_app.RUN_ID_PREFIX)
        ]
        for run in listed:
            seen.status[run.status.value] += 1
            if run.status is durably.RunStatus.COMPLETED:
                epoch = run.result.get("lease_epoch") if isinstance(run.result, dict) else None
                seen.epochs[epoch] += 1
                seen.last_completed_at = max(seen.last_completed_at or 0.0, run.updated_at)
            document = app.describe(run.run_id)
            seen.kinds[run.run_id] = Counter(step["kind"] for step in document["steps"])
            seen.succeeded_effects[run.run_id] = sum(
                effect["status"] == "succeeded" for effect in document["effects"]
            )
            for event in app.events(run.run_id):
                if event.type == "run_recovered":
                    seen.recovered += 1
                # An event naming a step commits with that step's row, at the same moment.
                if event.step_id is not None and (
                    seen.first_step_at is None or event.created_at < seen.first_step_at
                ):
                    seen.first_step_at = event.created_at
    finally:
        app.close()
    return seen


def check(seen: RunsSeen, runs: int, effect_log: Path, executed: list[int]) -> dict[str, Any]:
    """Every run completed exactly once, with its 2 steps and 2 effects; raises if not."""
    ids = [bench_app.run_id(i) for i in range(runs)]
    effects: Counter[tuple[int, str]] = Counter()
    lines = effect_log.read_text().splitlines() if effect_log.exists() else []
    for line in lines:
        i, channel, _key, _pid = line.split()
        effects[(int(i), channel)] += 1
    problems: list[str] = []
    if seen.status != Counter({"completed": runs}):
        problems.append(f"run statuses {dict(seen.status)}, expected {runs} completed")
    if seen.epochs != Counter({1: runs}):
        problems.append(f"lease epochs {dict(seen.epochs)}: a run was claimed more than once")
    if seen.recovered:
        problems.append(f"{seen.recovered} run_recovered events")
    bad_steps = [
        r
        for r in ids
        if seen.kinds.get(r, Counter())
        != Counter(step=bench_app.STEPS_PER_RUN, tool=bench_app.EFFECTS_PER_RUN)
    ]
    if bad_steps:
        problems.append(f"{len(bad_steps)} runs without 2 steps + 2 tools, e.g. {bad_steps[:3]}")
    bad_ops = [r for r in ids if seen.succeeded_effects.get(r) != bench_app.EFFECTS_PER_RUN]
    if bad_ops:
        problems.append(f"{len(bad_ops)} runs without 2 succeeded operations: {bad_ops[:3]}")
    expected = {(i, c) for i in range(runs) for c in bench_app.CHANNELS}
    twice = sorted(k for k, n in effects.items() if n > 1)
    missing = sorted(expected - set(effects))
    if twice:
        problems.append(f"{len(twice)} effects executed more than once, e.g. {twice[:3]}")
    if missing:
        problems.append(f"{len(missing)} effects never executed, e.g. {missing[:3]}")
    if sum(executed) != runs:
        problems.append(f"the workers report {sum(executed)} run executions for {runs} runs")
    if seen.first_step_at is None or seen.last_completed_at is None:
        problems.append("no step recorded or no run completed: no busy window")
    if problems:
        raise CheckFailed("; ".join(problems))
    return {
        "runs_completed": seen.status["completed"],
        "claimed_once": seen.epochs[1],
        "run_recovered_events": seen.recovered,
        "effects_executed": len(lines),
        "effects_per_run": len(lines) / runs,
        "executions_per_worker": executed,
    }
