"""The repository stands alone: no committed wheels, no design file outside it, and
benchmarks that use only durably's public API (proposed; issue 10 item 4)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make"})


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_no_wheel_is_committed() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.whl"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked == []


def test_the_source_cites_no_design_file_outside_the_repository() -> None:
    cited = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "src").rglob("*")
        if path.suffix in {".py", ".yml", ".sql", ".html", ".js"}
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if "DESIGN.md" in line
    ]
    assert cited == []


def test_every_architecture_section_the_source_cites_exists() -> None:
    anchors = {
        _anchor(line.lstrip("#"))
        for line in ARCHITECTURE.read_text().splitlines()
        if line.startswith("#")
    }
    cited = {
        (str(path.relative_to(ROOT)), anchor)
        for path in [
            *(ROOT / "src").rglob("*.py"),
            *(ROOT / "src").rglob("*.yml"),
            *(ROOT / "benchmarks").glob("*.md"),
            *(ROOT / "benchmarks").glob("*.py"),
        ]
        for anchor in re.findall(r"architecture\.md#([\w-]+)", path.read_text())
    }
    assert cited, "the source cites sections of docs/architecture.md"
    missing = sorted((path, a) for path, a in cited if a not in anchors)
    assert missing == []


def test_benchmarks_use_only_the_public_api() -> None:
    for path in (ROOT / "benchmarks").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("durably."), f"{path.name}: {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("durably."), f"{path.name}: {alias.name}"
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                owner = node.value
                own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                public = node.attr.startswith("__") or node.attr in NAMEDTUPLE_API
                assert own or public, f"{path.name}:{node.lineno}: reaches into ._{node.attr[1:]}"
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vars":
                raise AssertionError(f"{path.name}:{node.lineno}: vars() peeks at private state")


def test_the_documented_decision_matrix_is_the_code() -> None:
    """docs/architecture.md#the-decision-matrix, row by row, against ledger.decide over
    every combination: a change to decide() fails here until the table is updated."""
    import itertools

    from durably.ledger import Action, OperationView, decide
    from durably.status import FailureCategory as F
    from durably.status import OperationStatus as S

    me, epoch, now, most = "me", 2, 100.0, 3

    def documented(op: OperationView, can: bool) -> Action:
        if op.input_hash != "h":
            return Action.CONFLICT
        if op.status in (S.SUCCEEDED, S.COMPENSATED):
            return Action.RETURN
        if op.status is S.INTENT_RECORDED:
            return Action.CLAIM
        settle_or_pause = Action.RECONCILE if can else Action.PAUSE
        if op.status is S.EXECUTING:
            if op.lease_owner == me and op.lease_epoch == epoch:
                return Action.EXECUTE
            if op.lease_until is not None and op.lease_until > now:
                return Action.WAIT
            return settle_or_pause
        if op.status in (S.UNKNOWN, S.RECONCILING):
            return settle_or_pause
        category = op.failure_category
        if category is F.PERMISSION:
            return Action.PAUSE
        confirmed = category is F.TRANSIENT_AFTER_SEND and op.confirmed_not_executed
        if category in (F.TRANSIENT_BEFORE_SEND, F.RATE_LIMIT) or confirmed:
            return Action.RETRY if op.attempt < most else Action.RAISE
        if category is F.TRANSIENT_AFTER_SEND:
            if not can:
                return Action.PAUSE
            return Action.RECONCILE if op.attempt < most else Action.RAISE
        return Action.RAISE

    for can in (True, False):
        decided = decide(
            None,
            input_hash="h",
            owner=me,
            epoch=epoch,
            now=now,
            max_attempts=most,
            can_reconcile=can,
        )
        assert decided is Action.PREPARE
        for fields in itertools.product(
            list(S),
            ["h", "x"],
            [0, 2, 3, 4],
            [None, *F],
            [False, True],
            [None, me, "other"],
            [None, 1, epoch],
            [None, now - 1, now + 1],
        ):
            op = OperationView(*fields)
            decided = decide(
                op,
                input_hash="h",
                owner=me,
                epoch=epoch,
                now=now,
                max_attempts=most,
                can_reconcile=can,
            )
            assert decided is documented(op, can), (op, can)
