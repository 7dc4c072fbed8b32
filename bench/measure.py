"""Timing: run a workload for a fixed number of events and report events/s.

A :class:`Case` is one thing to measure. :func:`measure` warms every case up,
then times ``repeats`` rounds in which the cases take turns, so a case and its
baseline see the same server state (WAL position, checkpoints, table sizes)
rather than one of them always running first.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "EVENTS_PER_SECOND", "BenchError", "Case", "Measurement", "Workload", "events_per_second",
    "measure",
]

#: Does the work for ``count`` events and returns how many it handled.
Workload = Callable[[int], int]


class BenchError(RuntimeError):
    """A workload did not handle the events it was asked to: its figure would be wrong."""


@dataclass(frozen=True)
class Case:
    """One measurement to take.

    ``prepare`` runs untimed before every run (warm-up included), e.g. to fill
    a queue that ``run`` then drains. ``baseline`` names the case this one is
    compared with; the ratio is this case's median over the baseline's.
    """

    name: str
    label: str
    count: int
    run: Workload
    warmup: int
    prepare: Callable[[int], None] | None = None
    baseline: str | None = None


#: The unit of measure() and of every Measurement that does not say otherwise.
EVENTS_PER_SECOND = "events/s"


@dataclass(frozen=True)
class Measurement:
    """The result of a case: the value of every repetition, their median, the ratio.

    Values are events/s unless ``unit`` says otherwise (a latency in ms, a CPU
    share). ``group`` names the chart panel a measurement is drawn in (None:
    the single panel of a suite that has no groups); ``target`` is a value
    drawn as a line across its bar, such as a latency goal.
    """

    name: str
    label: str
    events: int
    values: list[float]
    median: float
    baseline: str | None = None
    ratio: float | None = None
    unit: str = EVENTS_PER_SECOND
    group: str | None = None
    target: float | None = None


def events_per_second(run: Workload, count: int) -> float:
    """Time ``run(count)``; raises BenchError unless it handled exactly ``count`` events."""
    start = time.perf_counter()
    done = run(count)
    elapsed = time.perf_counter() - start
    if done != count:
        raise BenchError(f"the workload handled {done} events instead of {count}")
    return count / elapsed


def measure(cases: Sequence[Case], repeats: int) -> list[Measurement]:
    """Warm up each case, time ``repeats`` interleaved rounds, and compute ratios."""
    names = {case.name for case in cases}
    for case in cases:
        if case.baseline is not None and case.baseline not in names:
            raise ValueError(f"case {case.name!r}: unknown baseline {case.baseline!r}")
    for case in cases:
        _timed_run(case, case.warmup)
    values: dict[str, list[float]] = {case.name: [] for case in cases}
    for round_ in range(1, repeats + 1):
        for case in cases:
            rate = _timed_run(case, case.count)
            values[case.name].append(rate)
            _log(f"  {case.name:<28} run {round_}/{repeats}: {rate:>12,.0f} events/s")
    medians = {name: statistics.median(rates) for name, rates in values.items()}
    results = []
    for case in cases:
        ratio = None
        if case.baseline is not None:
            ratio = medians[case.name] / medians[case.baseline]
        results.append(Measurement(
            name=case.name, label=case.label, events=case.count, values=values[case.name],
            median=medians[case.name], baseline=case.baseline, ratio=ratio))
    return results


def _timed_run(case: Case, count: int) -> float:
    if case.prepare is not None:
        case.prepare(count)
    return events_per_second(case.run, count)


def _log(line: str) -> None:
    # Progress goes to stderr, so stdout stays the summary table.
    print(line, file=sys.stderr, flush=True)
