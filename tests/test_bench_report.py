"""The bench runner's own output (bench/__main__.py): no server needed."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from bench.__main__ import _run_suite
from bench.registry import Suite, SuiteContext, SuiteResult


class _NoServer:
    """Stands in for BenchServer: the suite below never connects."""

    @contextlib.contextmanager
    def database(self, name: str) -> Iterator[str]:
        yield f"dbname={name}"


def test_a_suite_that_skipped_itself_writes_its_json_and_no_chart(tmp_path: Path) -> None:
    """A suite with nothing measured (peers without PgQ installed) used to end the
    whole run with a ValueError from the chart, after the other suites' results
    were written but before its own JSON said why it skipped."""
    def skipped(ctx: SuiteContext) -> SuiteResult:
        return SuiteResult(parameters={"skipped": "PgQ is not installed"})

    stale = tmp_path / "empty.png"
    stale.write_bytes(b"a chart of another run")
    args = argparse.Namespace(quick=True, out=tmp_path)
    _run_suite(Suite("empty", "nothing to measure", skipped), _NoServer(),  # type: ignore[arg-type]
               args, {"version": "none"})
    document = json.loads((tmp_path / "empty.json").read_text("utf-8"))
    assert document["measurements"] == []
    assert document["parameters"] == {"skipped": "PgQ is not installed"}
    assert not stale.exists()
