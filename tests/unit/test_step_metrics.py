"""The step-metrics reference in docs/metrics.md lists exactly the fields of `StepMetrics`, with
their types and docstrings."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import msgspec
import pytest

from rollflow.controller import step_metrics
from rollflow.controller.step_metrics import StepMetrics

DOC = Path(__file__).parents[2] / "docs" / "metrics.md"


def documented_fields() -> list[tuple[str, str, str]]:
    """(name, type, docstring) of every `StepMetrics` field, from its source."""
    tree = ast.parse(inspect.getsource(step_metrics))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepMetrics"]
    rows = []
    for node, after in zip(cls.body, [*cls.body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            assert isinstance(after, ast.Expr), f"StepMetrics.{node.target.id} has no docstring"
            rows.append((node.target.id, ast.unparse(node.annotation), " ".join(after.value.value.split())))
    return rows


def test_docs_table_matches_the_struct():
    fields = documented_fields()
    assert [name for name, _, _ in fields] == list(StepMetrics.__struct_fields__)
    table = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    want = [f"| `{name}` | `{kind}` | {doc} |" for name, kind, doc in fields]
    assert table == want, "docs/metrics.md is out of date with StepMetrics; regenerate its table from the struct"


def test_a_row_converts_and_leaves_absent_values_out():
    row = {name: 0 for name in StepMetrics.__struct_fields__ if not name.startswith("teacher_")}
    row |= {"rewards": {}, "env_metrics": {}, "budget_ends": {}, "lag_hist": {}, "sample_lag_hist": {},
            "lag_in_flight_hist": {}, "lag_in_queue_hist": {},
            "withheld_by_reason": {}, "unscorable_by_reason": {}}
    metrics = msgspec.convert(row, StepMetrics).as_row()
    assert "teacher_kl" not in metrics and metrics["step"] == 0 and metrics["ratio_mean"] == 0.0
    missing = dict(row)
    del missing["wall_s"]
    with pytest.raises(msgspec.ValidationError, match="wall_s"):
        msgspec.convert(missing, StepMetrics)
