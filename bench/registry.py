"""The benchmark suites, by name.

A suite is one module of this package that calls :func:`register` at import
time. Adding a suite means writing that module and naming it in
``_SUITE_MODULES``; the CLI, the server and the output files come for free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.measure import Measurement

__all__ = ["Suite", "SuiteContext", "SuiteResult", "all_suites", "register"]

# Imported by all_suites(), not at the top: the suite modules import this one.
_SUITE_MODULES = (
    "bench.engine", "bench.partition", "bench.latency", "bench.peers", "bench.ownership",
    "bench.bloat", "bench.held_horizon", "bench.pause", "bench.delayed", "bench.jobs",
    "bench.curves", "bench.dimensions", "bench.verify", "bench.metrics",
    "bench.exporter", "bench.dashboard")


@dataclass(frozen=True)
class SuiteContext:
    """What a suite gets: a fresh database with pgque installed, and the run's options."""

    dsn: str
    quick: bool
    repeats: int


@dataclass
class SuiteResult:
    """What a suite hands back: its parameters (sizes, counts) and its measurements."""

    parameters: dict[str, Any]
    measurements: list[Measurement] = field(default_factory=list)
    #: The server measured, when the suite ran on one of its own (see bench.peers).
    server: dict[str, Any] | None = None


@dataclass(frozen=True)
class Suite:
    """A named benchmark: ``run`` measures, in the database the context names."""

    name: str
    description: str
    run: Callable[[SuiteContext], SuiteResult]
    #: Run when no suite is named (``make bench``); a long variant has its own target.
    default: bool = True


_suites: dict[str, Suite] = {}


def register(suite: Suite) -> Suite:
    """Make a suite known to the CLI; names must be unique."""
    if suite.name in _suites:
        raise ValueError(f"benchmark suite {suite.name!r} is registered twice")
    _suites[suite.name] = suite
    return suite


def all_suites() -> dict[str, Suite]:
    """Every suite, by name, in registration order."""
    for module in _SUITE_MODULES:
        importlib.import_module(module)
    return dict(_suites)
