"""Metrics (pgque/metrics.py): every instrument of a Worker, its Ticker and a
producer, read after a known workload through OpenTelemetry's in-memory reader
and, for Worker(metrics_port=...), scraped and parsed as Prometheus text. In
the recommended deployment: the team's login runs the worker, the producer's
login sends, the ticker's login ticks.

The workload: events of three types over four slots; every "Poison" event is
not retryable (a dead letter), one "Flaky" event fails once and is handled on
its retry, the rest succeed."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from helpers import wait_for
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from prometheus_client.parser import text_string_to_metric_families

import pgque
from pgque.metrics import INSTRUMENTS, report_sends_to
from pgque.testing import Deployment

QUEUE = "metered"
GROUP = "billing"
SLOTS = 4
OKS = 24  # "Order" events, handled at once
POISONS = 2  # "Poison" events: not retryable, to the dead letters
BATCHED = 6  # of the Orders, those sent by one send_batch


@dataclass
class Team:
    deployment: Deployment
    dsn: str


@pytest.fixture
def team(pgque_deployment_template: Deployment) -> Iterator[Team]:
    with pgque_deployment_template.database() as deployment:
        with pgque.connect(deployment.dsn(deployment.owner)) as owner:
            owner.create_queue(QUEUE, ticker_max_lag=0)
        yield Team(deployment, deployment.dsn(deployment.login(deployment.teams[0])))


def _send_workload(team: Team, provider: MeterProvider | None = None) -> None:
    """OKS Orders (BATCHED of them in one send_batch), POISONS Poisons and one Flaky,
    by the producer's login: each of its sends reported on ``provider``."""
    report_sends_to(provider)
    try:
        with pgque.connect(team.deployment.dsn(team.deployment.producer)) as producer:
            for n in range(OKS - BATCHED):
                producer.send(QUEUE, "Order", {"n": n}, partition_key=f"customer-{n % 8}")
            producer.send_batch(QUEUE, [("Order", {"n": n}, f"customer-{n % 8}")
                                        for n in range(OKS - BATCHED, OKS)])
            for n in range(POISONS):
                producer.send(QUEUE, "Poison", {"n": n}, partition_key=f"customer-{n}")
            producer.send(QUEUE, "Flaky", {}, partition_key="customer-7")
    finally:
        report_sends_to(None)


class _Handler:
    """Poisons are not retryable; the Flaky event fails its first call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()

    def __call__(self, message: pgque.Message[Any]) -> None:
        with self.lock:
            self.calls[message.type] += 1
            first_flaky = message.type == "Flaky" and self.calls["Flaky"] == 1
        if message.type == "Poison":
            raise pgque.NonRetryable("poison")
        if first_flaky:
            raise RuntimeError("fails once")

    def done(self) -> bool:
        with self.lock:
            return (self.calls["Order"] >= OKS and self.calls["Poison"] >= POISONS
                    and self.calls["Flaky"] >= 2)


def _points(data: MetricsData | None) -> dict[str, list[Any]]:
    """The data points of every metric the reader collected, by name."""
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "pgque"
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def _total(points: list[Any], **attrs: str) -> float:
    """The sum of the points (counters' values, histograms' counts) whose
    attributes hold ``attrs`` (keys written with _ for .)."""
    wanted = {key.replace("_", "."): value for key, value in attrs.items()}
    return sum(getattr(p, "value", None) if hasattr(p, "value") else p.count
               for p in points if all(p.attributes.get(k) == v for k, v in wanted.items()))


def _drained(team: Team) -> bool:
    with pgque.connect(team.dsn) as client:
        return all(s.pending_events == 0 and s.open_batch_id is None
                   for s in client.partition_slot_status(QUEUE) if s.consumer_name == GROUP)


@pytest.mark.both_workers
def test_every_instrument_after_a_known_workload(team: Team) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with pgque.connect(team.dsn) as client:
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
    _send_workload(team, provider)
    handler = _Handler()
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker), name="metered-ticker",
                      meter_provider=provider) as ticker, \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS, handler=handler,
                         retry_after=0, poll_interval=0.05, ticker=False,
                         meter_provider=provider) as worker:
        assert worker.wait(handler.done, timeout=60)
        wait_for(lambda: _drained(team), timeout=30, what="every slot acked")
        owned = _points(reader.get_metrics_data())["pgque.worker.slots.owned"]
        assert _total(owned) == SLOTS  # one worker: it owns them all
        assert ticker.active
    points = _points(reader.get_metrics_data())
    # Every instrument but the two of a lost session (the next test's).
    lost = {"pgque.worker.losses", "pgque.worker.reconnects"}
    assert set(points) == set(INSTRUMENTS) - lost
    for name, metric_points in points.items():
        for point in metric_points:
            assert point.attributes["messaging.system"] == "pgque", name

    # The producer: OKS + POISONS + 1 events, in OKS - BATCHED + POISONS + 2 calls.
    sent = points["messaging.client.sent.messages"]
    assert _total(sent, messaging_destination_name=QUEUE) == OKS + POISONS + 1
    assert _total(sent, messaging_operation_name="send_batch") == BATCHED
    durations = points["messaging.client.operation.duration"]
    assert _total(durations, messaging_operation_name="send") == OKS - BATCHED + POISONS + 1
    assert _total(durations, messaging_operation_name="send_batch") == 1

    # The worker's events by type and outcome; every point of the group's slots.
    events = points["pgque.worker.events"]
    for point in events:
        attributes = point.attributes
        assert attributes["messaging.destination.name"] == QUEUE
        assert attributes["messaging.consumer.group.name"] == GROUP
        assert attributes["messaging.destination.partition.id"] in {str(s) for s in range(SLOTS)}
    by_outcome = {(t, o): _total(events, pgque_event_type=t, pgque_outcome=o)
                  for t in ("Order", "Poison", "Flaky") for o in ("ok", "failed", "dead")}
    assert {k: v for k, v in by_outcome.items() if v} == {
        ("Order", "ok"): OKS, ("Poison", "dead"): POISONS, ("Flaky", "failed"): 1,
        ("Flaky", "ok"): 1}
    handed = OKS + POISONS + 2
    assert _total(events) == handed
    assert _total(points["pgque.worker.retries"]) == 1
    assert _total(points["pgque.worker.dead_letters"]) == POISONS
    pieces = _total(points["pgque.worker.batch.size"])
    assert 1 <= pieces <= handed
    assert sum(p.sum for p in points["pgque.worker.batch.size"]) == handed
    assert _total(points["messaging.process.duration"]) == pieces
    pickups = points["pgque.worker.pickup.latency"]
    assert _total(pickups) == pieces and all(p.min >= 0 for p in pickups)
    # Ownership: every slot claimed once, released at the stop, none lost.
    assert _total(points["pgque.worker.claims"]) == SLOTS
    assert _total(points["pgque.worker.slots.owned"]) == 0
    assert _total(points["pgque.worker.sessions"]) == 0  # one lane, opened and closed
    # The ticker: elected once, active no more, its ticks made in looks.
    assert _total(points["pgque.ticker.elections"], pgque_ticker_name="metered-ticker") == 1
    assert _total(points["pgque.ticker.active"]) == 0
    assert _total(points["pgque.ticker.ticks"]) == ticker.ticks >= 1
    assert _total(points["pgque.ticker.look.duration"]) == ticker.looks


@pytest.mark.both_workers
def test_a_lost_session_counts_its_slots_lost_and_a_reconnect(team: Team) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with pgque.connect(team.dsn) as client:
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
    with pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                      handler=lambda message: None, poll_interval=0.05, ticker=False,
                      name="cut", meter_provider=provider) as worker:
        assert worker.wait(lambda: len(worker.owned_slots) == SLOTS, timeout=30)
        with psycopg.connect(team.deployment.superuser_dsn(), autocommit=True) as admin:
            cut = admin.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                                " where application_name like 'cut-lane%'").fetchall()
        assert cut
        assert worker.wait(lambda: _total(_points(reader.get_metrics_data()).get(
            "pgque.worker.losses", [])) >= SLOTS, timeout=30)
        # Its slots come back to the worker, on a new lane.
        assert worker.wait(lambda: len(worker.owned_slots) == SLOTS, timeout=30)
    points = _points(reader.get_metrics_data())
    assert _total(points["pgque.worker.losses"]) == SLOTS
    assert _total(points["pgque.worker.reconnects"]) >= 1
    assert _total(points["pgque.worker.claims"]) == 2 * SLOTS
    assert _total(points["pgque.worker.slots.owned"]) == 0


def _scrape(address: tuple[str, int]) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sample(families: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in families[family].samples if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_worker_serves_its_metrics_to_prometheus(team: Team) -> None:
    with pgque.connect(team.dsn) as client:
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
    _send_workload(team)
    handler = _Handler()
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS, handler=handler,
                         retry_after=0, poll_interval=0.05, ticker=False,
                         metrics_port=0) as worker:
        assert worker.wait(lambda: worker.metrics_address is not None and handler.done(),
                           timeout=60)
        address = worker.metrics_address
        assert address is not None and address[0] == "127.0.0.1"
        families = wait_for(lambda: (f := _scrape(address)) and _sample(
            f, "pgque_worker_events", "pgque_worker_events_total", outcome="ok") == OKS + 1
            and f, timeout=30, what="the handled events scraped")
    assert worker.metrics_address is None  # no longer served once stopped
    events = families["pgque_worker_events"]
    assert events.type == "counter"
    assert {(s.labels["type"], s.labels["outcome"]) for s in events.samples
            if s.name == "pgque_worker_events_total"} == {
        ("Order", "ok"), ("Poison", "dead"), ("Flaky", "failed"), ("Flaky", "ok")}
    assert all(s.labels["queue"] == QUEUE and s.labels["group"] == GROUP
               and s.labels["slot"] in {str(n) for n in range(SLOTS)} for s in events.samples)
    assert _sample(families, "pgque_worker_dead_letters", "pgque_worker_dead_letters_total") \
        == POISONS
    assert _sample(families, "pgque_worker_slots_owned", "pgque_worker_slots_owned") == SLOTS
    assert families["pgque_worker_process_duration_seconds"].type == "histogram"
    assert _sample(families, "pgque_worker_batch_size", "pgque_worker_batch_size_sum") \
        == OKS + POISONS + 2
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=2)


def test_a_taken_metrics_port_stops_the_worker_with_the_error(team: Team) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        worker = pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                              handler=lambda message: None, ticker=False,
                              metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError):
            worker.run()


def test_without_the_extras_nothing_is_imported_and_nothing_is_measured(team: Team) -> None:
    """With opentelemetry and prometheus_client not importable, pgque imports,
    sends and handles without them; metrics_port says what to install."""
    script = f"""
import sys
sys.modules["opentelemetry"] = None  # as if not installed
sys.modules["prometheus_client"] = None
import pgque
assert not any(name.startswith(("opentelemetry", "prometheus_client"))
               for name, module in sys.modules.items() if module is not None)
with pgque.connect({team.deployment.dsn(team.deployment.producer)!r}) as producer:
    producer.send({QUEUE!r}, "Order", {{}}, partition_key="k")
worker = pgque.Worker({team.dsn!r}, queue={QUEUE!r}, consumer={GROUP!r}, slots=1,
                      handler=print, ticker=False)
assert worker.metrics is None
try:
    pgque.Worker({team.dsn!r}, queue={QUEUE!r}, consumer={GROUP!r}, slots=1,
                 handler=print, metrics_port=0)
except ImportError as exc:
    assert "pgque[prometheus]" in str(exc), exc
else:
    raise AssertionError("metrics_port without prometheus-client")
print("fine")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fine"


def test_a_worker_labels_at_most_max_types_event_types() -> None:
    """Producers choose event types: past MAX_TYPES distinct ones a worker counts
    the rest as OTHER_TYPE, so no producer grows its metrics without bound."""
    from datetime import datetime, timezone
    from types import SimpleNamespace

    from pgque.metrics import MAX_TYPES, OTHER_TYPE, Metrics, WorkerMetrics

    reader = InMemoryMetricReader()
    metrics = Metrics.of(MeterProvider(metric_readers=[reader]))
    assert metrics is not None
    worker = WorkerMetrics(metrics, QUEUE, GROUP)
    now = datetime.now(timezone.utc)
    extra = 7
    for n in range(MAX_TYPES + extra):
        message = pgque.Message(id=n, type=f"type-{n}", data="{}", partition_key="k",
                                retry_count=0, created_at=now)
        worker.piece(SimpleNamespace(messages=[message, message], slot=n % SLOTS), {}, (),
                     now.timestamp(), 0.001)
    events = _points(reader.get_metrics_data())["pgque.worker.events"]
    types = Counter[str]()
    for point in events:
        types[point.attributes["pgque.event.type"]] += point.value
    assert len(types) == MAX_TYPES + 1
    assert types[OTHER_TYPE] == 2 * extra
    assert sum(types.values()) == 2 * (MAX_TYPES + extra)
