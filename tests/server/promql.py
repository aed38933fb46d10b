"""Just enough PromQL to evaluate the shipped alert rules, with Prometheus's semantics.

promtool would need the ~100 MB prometheus package; this evaluates the subset the rules use
(``sum``/``max`` [``by (...)``], ``rate``, ``increase``, ``histogram_quantile``, a bare
selector, and a ``> N`` filter) the way Prometheus does: the extrapolated rate of
``promql/functions.go`` (counter resets, zero clamp, 1.1 x the mean interval) and the bucket
interpolation of ``promql/quantile.go``. Anything else is a ``SyntaxError``, so a new rule
with another construct cannot pass unevaluated.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

Labels = frozenset[tuple[str, str]]
LOOKBACK_S = 300.0


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    samples: list[tuple[float, float]]  # (unix seconds, value), in time order


Vector = dict[Labels, float]

_TOKEN = re.compile(r"\s*(\d+(?:\.\d+)?[smh]\b|\d+(?:\.\d+)?|[A-Za-z_][A-Za-z0-9_]*|[()\[\],>])")


def _tokens(expr: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise SyntaxError(f"cannot read {expr[pos:]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


def duration_s(text: str) -> float:
    return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


class Query:
    """A parsed rule expression, evaluated at a time over a list of series."""

    def __init__(self, expr: str) -> None:
        self.tokens = _tokens(expr)
        self.pos = 0
        self.tree = self._expr()
        if self.pos != len(self.tokens):
            raise SyntaxError(f"unexpected {self.tokens[self.pos]!r} in {expr!r}")

    def _take(self, expected: str | None = None) -> str:
        token = self.tokens[self.pos]
        if expected is not None and token != expected:
            raise SyntaxError(f"expected {expected!r}, found {token!r}")
        self.pos += 1
        return token

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _expr(self) -> tuple[object, ...]:
        node = self._term()
        if self._peek() == ">":
            self._take()
            return ("gt", node, float(self._take()))
        return node

    def _term(self) -> tuple[object, ...]:
        word = self._take()
        if word in ("sum", "max"):
            by: tuple[str, ...] = ()
            if self._peek() == "by":
                self._take()
                self._take("(")
                names = [self._take()]
                while self._peek() == ",":
                    self._take()
                    names.append(self._take())
                self._take(")")
                by = tuple(names)
            self._take("(")
            inner = self._expr()
            self._take(")")
            return ("agg", word, by, inner)
        if word in ("rate", "increase"):
            self._take("(")
            name = self._take()
            self._take("[")
            window = duration_s(self._take())
            self._take("]")
            self._take(")")
            return ("range", word, name, window)
        if word == "histogram_quantile":
            self._take("(")
            q = float(self._take())
            self._take(",")
            inner = self._expr()
            self._take(")")
            return ("quantile", q, inner)
        if re.fullmatch(r"[a-z_][a-z0-9_]*", word):
            return ("selector", word)
        raise SyntaxError(f"unsupported {word!r}")

    def at(self, t: float, series: Iterable[Series]) -> Vector:
        return _eval(self.tree, t, list(series))


def _key(labels: dict[str, str]) -> Labels:
    return frozenset(labels.items())


def _eval(node: tuple[object, ...], t: float, series: list[Series]) -> Vector:
    kind = node[0]
    if kind == "gt":
        _, inner, threshold = node
        return {k: v for k, v in _eval(inner, t, series).items() if v > threshold}
    if kind == "selector":
        out: Vector = {}
        for s in series:
            if s.name == node[1]:
                recent = [v for ts, v in s.samples if t - LOOKBACK_S < ts <= t]
                if recent:
                    out[_key(s.labels)] = recent[-1]
        return out
    if kind == "range":
        _, fn, name, window = node
        out = {}
        for s in series:
            if s.name == name:
                value = _extrapolated(s.samples, t, float(window), fn == "rate")
                if value is not None:
                    out[_key(s.labels)] = value
        return out
    if kind == "agg":
        _, op, by, inner = node
        groups: dict[Labels, list[float]] = defaultdict(list)
        for labels, value in _eval(inner, t, series).items():
            groups[frozenset((k, v) for k, v in labels if k in by)].append(value)
        return {k: (sum(vs) if op == "sum" else max(vs)) for k, vs in groups.items()}
    if kind == "quantile":
        _, q, inner = node
        buckets: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
        for labels, value in _eval(inner, t, series).items():
            le = dict(labels)["le"]
            rest = frozenset((k, v) for k, v in labels if k != "le")
            buckets[rest].append((math.inf if le == "+Inf" else float(le), value))
        return {k: _bucket_quantile(float(q), sorted(b)) for k, b in buckets.items()}
    raise SyntaxError(f"unknown node {kind!r}")


def _extrapolated(
    samples: list[tuple[float, float]], t: float, window: float, per_second: bool
) -> float | None:
    """Prometheus's extrapolatedRate for a counter over (t - window, t]."""
    start = t - window
    points = [(ts, v) for ts, v in samples if start < ts <= t]
    if len(points) < 2:
        return None
    delta, previous = 0.0, points[0][1]
    for _, v in points[1:]:
        delta += v if v < previous else v - previous  # a reset restarts from zero
        previous = v
    first_t, first_v = points[0]
    last_t = points[-1][0]
    sampled = last_t - first_t
    to_start, to_end = first_t - start, t - last_t
    threshold = sampled / (len(points) - 1) * 1.1
    if delta > 0 and first_v >= 0:
        to_start = min(to_start, sampled * (first_v / delta))  # a counter is never below 0
    extrapolate = sampled
    extrapolate += to_start if to_start < threshold else sampled / (len(points) - 1) / 2
    extrapolate += to_end if to_end < threshold else sampled / (len(points) - 1) / 2
    value = delta * extrapolate / sampled
    return value / window if per_second else value


def _bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile over cumulative (upper bound, count) buckets."""
    if not buckets or buckets[-1][0] != math.inf or len(buckets) < 2:
        return math.nan
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    i = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if i == len(buckets) - 1:
        return buckets[-2][0]
    if i == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    lower, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
    upper, count = buckets[i]
    return lower + (upper - lower) * ((rank - below) / (count - below))


def fires(
    expr: str, for_s: float, series: list[Series], at: float, every_s: float = 60.0
) -> Vector:
    """What the alert reports firing at ``at``: the expression held at every evaluation
    (each ``every_s``) over the last ``for_s`` seconds."""
    query = Query(expr)
    result = query.at(at, series)
    steps = int(for_s // every_s)
    for i in range(1, steps + 1):
        earlier = query.at(at - i * every_s, series)
        result = {k: v for k, v in result.items() if k in earlier}
    return result
