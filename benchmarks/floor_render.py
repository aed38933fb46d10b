"""The floor benchmark's figures: samples by measurement, and the table they print as."""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.floor_measure import Sample
from benchmarks.floor_recovery import Recovery
from benchmarks.floor_scaling import Scaling

CPU_TARGET_MS = {"sqlite": 0.1, "postgres": 0.15}
W3_TARGET_S = {("sqlite", 500): 1.0, ("postgres", 500): 2.0, ("sqlite", 10_000): 10.0}
"""The issue's W3 targets, by backend and runs recovered."""
W2_STEPS = 3


@dataclass
class Figures:
    backend: str
    samples: dict[str, list[Sample]] = field(default_factory=lambda: defaultdict(list))
    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    recoveries: list[Recovery] = field(default_factory=list)
    scalings: list[Scaling] = field(default_factory=list)

    def add(self, key: str, sample: Sample) -> None:
        self.samples[key].append(sample)

    def add_value(self, key: str, value: float) -> None:
        self.values[key].append(value)

    def of(self, key: str, metric: Callable[[Sample], float]) -> list[float]:
        return [metric(s) for s in self.samples.get(key, [])]

    def document(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "samples": {k: [asdict(s) for s in v] for k, v in self.samples.items()},
            "values": dict(self.values),
            "recoveries": [asdict(r) for r in self.recoveries],
            "scalings": [asdict(s) for s in self.scalings],
        }


@dataclass(frozen=True)
class Row:
    measure: str
    durably: list[float]
    raw: list[float]
    target: str = "-"
    meets: Callable[[float, float], bool] | None = None
    """(durably median, ratio) -> whether the target is met."""
    higher_is_better: bool = False


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fmt(value: float) -> str:
    if math.isnan(value):  # not measured
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def _at_most(limit: float) -> Callable[[float, float], bool]:
    return lambda durably, _ratio: durably <= limit


def rows(f: Figures) -> list[Row]:
    def ms(s: Sample) -> float:
        return s.ms_per_unit

    def cpu(s: Sample) -> float:
        return s.cpu_ms_per_unit

    def rate(s: Sample) -> float:
        return s.per_s

    raw_w1, raw_w2 = f.of("raw W1", ms), f.of("raw W2", rate)
    cpu_target = CPU_TARGET_MS[f.backend]
    out = [
        Row("W1 ms/step, async def step", f.of("W1 async", ms), raw_w1, "<= 1.2x",
            lambda _, r: r <= 1.2),
        Row("W1 ms/step, def step", f.of("W1 def", ms), raw_w1),
        Row("W1 client CPU ms/step, async def", f.of("W1 async", cpu), f.of("raw W1", cpu),
            f"<= {cpu_target} ms", lambda d, _: d <= cpu_target),
        Row("W1 client CPU ms/step, def", f.of("W1 def", cpu), f.of("raw W1", cpu)),
        Row("W2 runs/s, one after another", f.of("W2 seq", rate),
            [r / W2_STEPS for r in raw_w2], ">= 0.8x", lambda _, r: r >= 0.8, True),
    ]  # fmt: skip
    levels = sorted(int(k[4:]) for k in f.samples if k.startswith("W2 c"))
    for c in levels:
        top = c == levels[-1] and c > 1
        out.append(
            Row(f"W2 steps/s, {c} runs at once (raw: 1 conn)", f.of(f"W2 c{c}", rate), raw_w2,
                "> 1x" if top else "-", (lambda _, r: r > 1.0) if top else None, True)
        )  # fmt: skip
    raw_effect = [2 * v * 1e3 for v in f.of("raw effect", ms)]
    out.append(Row("effect us, idempotent tool (raw: 2 commits)", f.values.get("effect us", []),
                   raw_effect, "<= 1.2x", lambda _, r: r <= 1.2))  # fmt: skip
    if f.backend == "postgres":
        wal = [s.wal_bytes / s.units for s in f.samples.get("W1 async", []) if s.wal_bytes]
        raw_wal = [s.wal_bytes / s.units for s in f.samples.get("raw W1", []) if s.wal_bytes]
        out.append(Row("WAL bytes/step (cluster-wide)", wal, raw_wal, "<= 2x",
                       lambda _, r: r <= 2.0))  # fmt: skip
    for rec, raw in zip(f.recoveries, f.samples.get("raw W3", []), strict=False):
        t = W3_TARGET_S.get((f.backend, rec.runs))
        out.append(Row(f"W3 s to recover {rec.runs} runs (raw: 5 commits each)", [rec.total_s],
                       [raw.seconds], "-" if t is None else f"<= {t:g} s",
                       None if t is None else _at_most(t)))  # fmt: skip
    raw_scale = f.of("raw scale", rate)
    for sc in f.scalings:
        out.append(Row(f"steps/s, {sc.processes} worker processes x {sc.concurrency}",
                       [sc.steps_per_s], raw_scale, higher_is_better=True))  # fmt: skip
    return [r for r in out if r.durably]


def render(figures: list[Figures], args: argparse.Namespace, elapsed: float) -> str:
    head = f"{'backend':9}{'measure':46}{'durably':>9} {'(min-max)':>15}{'raw':>9}"
    head += f"{'ratio':>8}  {'target':12}{'meets':6}"
    lines = [head]
    for f in figures:
        for row in rows(f):
            d, r = _median(row.durably), _median(row.raw)
            ratio = d / r if r and not math.isnan(r) else float("nan")
            spread = f"{_fmt(min(row.durably))}-{_fmt(max(row.durably))}"
            verdict = "-" if row.meets is None else "yes" if row.meets(d, ratio) else "no"
            lines.append(
                f"{f.backend:9}{row.measure:46}{_fmt(d):>9} {spread:>15}{_fmt(r):>9}"
                f"{_fmt(ratio) + 'x':>8}  {row.target:12}{verdict:6}"
            )
        for rec in f.recoveries:
            lines.append(
                f"{'':9}W3 ({rec.runs} runs): lease TTL {rec.lease_ttl_s:g} s; runs recovered from "
                f"{rec.first_claim_s:.2f} to {rec.last_claim_s:.2f} s after launch, all "
                f"completed at {rec.total_s:.2f} s; recovering process CPU {rec.cpu_s:.2f} s; "
                f"the holder had all {rec.runs} in step 6 {rec.blocked_s:.1f} s after its launch"
            )
        for sc in f.scalings:
            lines.append(
                f"{'':9}scale: {sc.processes} processes x {sc.concurrency} runs at once, "
                f"{sc.runs} runs of 3 steps in {sc.seconds:.2f} s; workers' CPU {sc.cpu_s:.2f} s"
            )
    lines += [
        "median of the repeats (W3: one measurement); ratio = durably / raw medians "
        "(runs/s, steps/s: durably / raw, higher is better).",
        "raw: one ~200-byte JSON row per durable commit, same disk or server, same run: "
        "SQLite BEGIN IMMEDIATE/INSERT/COMMIT (WAL, synchronous=FULL); PostgreSQL "
        "autocommit INSERT (1 round trip).",
        f"W1: one run of {args.steps} steps; W2: {args.runs} runs of {W2_STEPS} steps; effect: "
        f"{args.effects} calls; repeats {args.repeat}; total {elapsed:.1f} s",
    ]
    return "\n".join(lines)
