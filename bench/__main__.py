"""``python -m bench [SUITE ...] [--quick] [--out DIR] [--dsn DSN]``: run benchmark suites.

Every suite runs in a fresh database of one server (a throwaway durable
cluster unless ``--dsn`` names one) and writes ``<suite>.json`` and
``<suite>.png`` to the output directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.harness import BenchServer, git_commit, load_average, machine_info
from bench.measure import EVENTS_PER_SECOND
from bench.registry import Suite, SuiteContext, all_suites
from bench.report import summary_table, write_chart, write_json

REPEATS = 3
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _parse_args(argv: list[str] | None, suites: dict[str, Suite]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run pgque's benchmark suites.",
        epilog="suites: " + "; ".join(f"{s.name}: {s.description}" for s in suites.values()),
    )
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help="suites to run (default: all but the long variants)")
    parser.add_argument("--quick", action="store_true",
                        help="about a tenth of the events, for a smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for <suite>.json and <suite>.png (default: %(default)s)")
    parser.add_argument("--dsn", help="use this server (its role must be allowed to create "
                                      "databases) instead of a throwaway cluster")
    args = parser.parse_args(argv)
    unknown = [name for name in args.suites if name not in suites]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(suites)}")
    return args


def _run_suite(suite: Suite, server: BenchServer, args: argparse.Namespace,
               server_info: dict[str, Any]) -> None:
    print(f"== {suite.name}: {suite.description}", file=sys.stderr, flush=True)
    started_at = datetime.now(timezone.utc)
    load_before = load_average()
    start = time.perf_counter()
    with server.database(f"pgque_bench_{suite.name}") as dsn:
        result = suite.run(SuiteContext(dsn=dsn, quick=args.quick, repeats=REPEATS))
    duration = time.perf_counter() - start
    machine = machine_info()
    server_info = result.server or server_info
    units = {m.unit for m in result.measurements}

    document = {
        "suite": suite.name,
        "description": suite.description,
        "quick": args.quick,
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(duration, 1),
        "git": git_commit(),
        "machine": machine,
        "load_average": {"before": load_before, "after": load_average()},
        "server": server_info,
        "parameters": result.parameters,
        # One unit for the whole suite when there is one; otherwise each
        # measurement's "unit" says (latencies in ms next to rates, say).
        "unit": units.pop() if len(units) == 1 else "per measurement",
        "measurements": [
            {"name": m.name, "label": m.label, "events_per_run": m.events, "unit": m.unit,
             "median": round(m.median, 1), "values": [round(v, 1) for v in m.values],
             "us_per_event": (round(1e6 / m.median, 2) if m.unit == EVENTS_PER_SECOND
                              else None),
             "baseline": m.baseline, "ratio": None if m.ratio is None else round(m.ratio, 3)}
            for m in result.measurements
        ],
    }
    out: Path = args.out
    write_json(out / f"{suite.name}.json", document)
    if not result.measurements:
        # A suite that skipped itself (say, peers without PgQ) has nothing to
        # chart: its JSON says why, and an old chart would show another run.
        (out / f"{suite.name}.png").unlink(missing_ok=True)
        print(f"\n{suite.name} ({duration:.0f} s) -> {out / suite.name}.json: "
              f"nothing measured ({result.parameters.get('skipped', 'skipped')})\n")
        return
    write_chart(out / f"{suite.name}.png", f"pgque benchmark: {suite.name}",
                _subtitle(server_info, args.quick), result.measurements)
    print(f"\n{suite.name} ({duration:.0f} s) -> {out / suite.name}.json, .png\n")
    print(summary_table(result.measurements) + "\n", flush=True)


def _subtitle(server_info: dict[str, Any], quick: bool) -> str:
    """One line under the chart's title: which server, how durable, which machine."""
    version = str(server_info.get("version", "")).split(" on ")[0]
    settings = server_info.get("settings", {})
    durability = ", ".join(f"{name}={settings.get(name, '?')}"
                           for name in ("fsync", "synchronous_commit", "full_page_writes"))
    machine = machine_info()
    parts = [version, durability, f"{machine['nproc']} × {machine['cpu_model']}",
             f"median of {REPEATS} runs, whiskers min..max"]
    if quick:
        parts.append("--quick")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    suites = all_suites()
    args = _parse_args(argv, suites)
    chosen = ([suites[name] for name in args.suites]
              or [suite for suite in suites.values() if suite.default])
    with BenchServer(args.dsn) as server:
        server_info = server.describe()
        for suite in chosen:
            _run_suite(suite, server, args, server_info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
