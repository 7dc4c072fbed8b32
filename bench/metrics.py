"""Suite ``metrics``: what a Worker's and a producer's metrics cost.

A Worker of 16 slots with a no-op handler drains a backlog (as in the verify
suite), by turns: as it runs with no metrics configured (opentelemetry-api
installed, no SDK: the API's no-op provider), with an OpenTelemetry SDK
MeterProvider and an in-memory reader (the SDK's aggregation is what costs;
an exporter runs in its own thread), and with ``metrics_port`` (Prometheus).
The goal: either at 0.95 of the rate without, or better. The drain's rate
moves by half from run to run on this machine (the runs fall into a fast and a
slow mode, with metrics or without), so the suite also states what the
metrics cost where they are spent: this process's CPU time per event (the
Worker's threads), whose ratio to the plain drain's is the rate the process
would have if it were the bottleneck. Then ``Client.send``, one event a call,
without and with an SDK provider for the producer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import psycopg
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import pgque
from bench.measure import Case, Measurement, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register
from bench.verify import EVENTS, KEYS, SLOTS, TICK_EVERY, Drain
from pgque.metrics import report_sends_to

SENDS = 5_000  # a run's sends (a fifth with --quick)
# Rounds at least: a drain's rate moves by a quarter from run to run on this
# machine, and the goal is a 5 % difference.
ROUNDS = 9


def _send_rate(dsn: str, queue: str, provider: MeterProvider | None) -> Callable[[int], int]:
    def run(count: int) -> int:
        report_sends_to(provider)
        try:
            with pgque.connect(dsn) as client:
                for n in range(count):
                    client.send(queue, "e", {"n": n}, partition_key=f"tenant-{n % KEYS}")
        finally:
            report_sends_to(None)
        return count
    return run


def _cpu(plain: Drain, others: list[tuple[Drain, str, str]]) -> list[Measurement]:
    """The drains' CPU time per event (the warm-up's left out); each ratio is the
    plain drain's over the case's: the rate it allows, relative."""
    def median(drain: Drain) -> float:
        return statistics.median(drain.cpu_per_event[1:])

    group = "the worker process's CPU per event, µs"
    base = median(plain)
    results = [Measurement(name="drain.cpu", label="no metrics configured", events=0,
                           values=[round(v, 2) for v in plain.cpu_per_event[1:]],
                           median=base, unit="µs/event", group=group)]
    for drain, name, label in others:
        results.append(Measurement(
            name=name, label=label, events=0,
            values=[round(v, 2) for v in drain.cpu_per_event[1:]], median=median(drain),
            baseline="drain.cpu", ratio=base / median(drain), unit="µs/event", group=group))
    return results


def run(ctx: SuiteContext) -> SuiteResult:
    events = EVENTS // 5 if ctx.quick else EVENTS
    sends = SENDS // 5 if ctx.quick else SENDS
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        plain = Drain(ctx.dsn, conn, "plain")
        otel = Drain(ctx.dsn, conn, "otel", meter_provider=provider)
        prometheus = Drain(ctx.dsn, conn, "prometheus", metrics_port=0)
        conn.execute("select pgque.create_queue('sends')")
        drains = measure([
            Case("drain", "Worker, 16 slots, no-op handler, no metrics configured", events,
                 plain.run, warmup=events // 10, prepare=plain.prepare),
            Case("drain.otel", "the same reporting to an OpenTelemetry SDK", events, otel.run,
                 warmup=events // 10, prepare=otel.prepare, baseline="drain"),
            Case("drain.prometheus", "the same serving Prometheus metrics (metrics_port)",
                 events, prometheus.run, warmup=events // 10, prepare=prometheus.prepare,
                 baseline="drain"),
            Case("send", "Client.send, one event a call, no metrics configured", sends,
                 _send_rate(ctx.dsn, "sends", None), warmup=sends // 10),
            Case("send.otel", "the same reporting to an OpenTelemetry SDK", sends,
                 _send_rate(ctx.dsn, "sends", provider), warmup=sends // 10, baseline="send"),
        ], max(ctx.repeats, ROUNDS))
        for drain in (plain, otel, prometheus):
            drain.close()
        cpu = _cpu(plain, [(otel, "drain.otel.cpu", "OpenTelemetry SDK"),
                           (prometheus, "drain.prometheus.cpu", "Prometheus (metrics_port)")])
    provider.shutdown()
    return SuiteResult(parameters={"events_per_run": events, "sends_per_run": sends,
                                   "slots": SLOTS, "keys": KEYS, "tick_every": TICK_EVERY,
                                   "repeats": max(ctx.repeats, ROUNDS)},
                       measurements=[*drains, *cpu])


SUITE = register(Suite(
    name="metrics",
    description="a Worker's drain and Client.send with and without metrics",
    run=run,
))
