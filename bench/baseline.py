"""An earlier pgque in the same run: the 0.1 Worker beside today's.

Issue 11 set a goal relative to the no-op drain of the 0.1 Worker (commit
75e3587). This machine's speed moves by a third from one day to the next, so a
figure recorded on another day is no baseline: the suite runs that old Worker
again, in turns with today's, on the same server.

:class:`BaselineWorker` exports the old commit's ``pgque``, ``bench`` and
``sql`` directories with ``git archive`` into a temporary directory, installs
that schema into a database of its own, and for each run starts the old
tree's own drain (its ``bench.partition`` and worker processes, on this
interpreter: the dependencies did not change) in a child process. Without git
or without the commit (a tarball, a shallow clone) it is unavailable, and the
suite says so instead of the figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.measure import BenchError

__all__ = ["BASELINE_COMMIT", "BaselineWorker"]

#: The Worker of 0.1 whose figure (36,601 events/s on 2026-11-30) issue 11 named.
BASELINE_COMMIT = "75e3587"

_REPO_ROOT = Path(__file__).resolve().parent.parent

# Run in the old tree: install its schema (count 0), or drain count events with
# one worker process at N = 8 as its own partition suite did, and print the rate.
_CHILD = """
import json, sys
import psycopg, pgque
from pgque import schema
from bench.partition import HANDLERS, _Queues, _WorkerDrain
dsn, count = sys.argv[1], int(sys.argv[2])
if count == 0:
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.install(conn)
    sys.exit(0)
with pgque.connect(dsn, pool_size=0) as client:
    drain = _WorkerDrain(dsn, _Queues(client), HANDLERS[0], 1)
    rate = drain.run(count, True)
print(json.dumps({"rate": rate, "details": drain.details[-1]}))
"""


class BaselineWorker:
    """The 0.1 Worker's no-op drain, runnable in turns with today's.

    Use as a context manager; ``available`` is False (and ``why`` says why)
    when the old tree cannot be exported.
    """

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._dbname = f"{conninfo_to_dict(dsn).get('dbname', 'postgres')}_baseline"
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.available = False
        self.why = ""
        self.details: list[dict[str, Any]] = []  # one per timed run

    def __enter__(self) -> BaselineWorker:
        self._tmp = tempfile.TemporaryDirectory(prefix="pgque-bench-baseline-")
        tree = Path(self._tmp.name)
        archive = tree / "tree.tar"
        export = subprocess.run(
            ["git", "-C", str(_REPO_ROOT), "archive", "--format=tar", "-o", str(archive),
             BASELINE_COMMIT, "pgque", "bench", "sql"], capture_output=True, text=True, check=False)
        if export.returncode != 0:
            self.why = f"git archive {BASELINE_COMMIT} failed: {export.stderr.strip()[:200]}"
            return self
        with tarfile.open(archive) as tar:
            tar.extractall(tree, filter="data")
        with psycopg.connect(self._dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("drop database if exists {} with (force)").format(
                sql.Identifier(self._dbname)))
            admin.execute(sql.SQL("create database {}").format(sql.Identifier(self._dbname)))
        self._child(0)
        self.available = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            with psycopg.connect(self._dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("drop database if exists {} with (force)").format(
                    sql.Identifier(self._dbname)))
        if self._tmp is not None:
            self._tmp.cleanup()

    def run(self, count: int, timed: bool) -> float:
        """One drain of count events by one old worker process; events/s."""
        report = self._child(count)
        if timed:
            self.details.append(report["details"])
        return float(report["rate"])

    def _child(self, count: int) -> dict[str, Any]:
        assert self._tmp is not None
        tree = self._tmp.name
        dsn = make_conninfo(self._dsn, dbname=self._dbname)
        done = subprocess.run([sys.executable, "-c", _CHILD, dsn, str(count)], cwd=tree,
                              env={**os.environ, "PYTHONPATH": tree},
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"the {BASELINE_COMMIT} worker failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout) if count else {}
