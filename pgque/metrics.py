"""What workers, tickers and producers do, as metrics: OpenTelemetry and Prometheus.

Two optional backends, each an extra, neither imported unless used:

* **OpenTelemetry** (``pip install pgque[otel]``): when ``opentelemetry-api`` is
  installed, every :class:`~pgque.Worker`, :class:`~pgque.Ticker` and client
  reports on the global ``MeterProvider`` (or the one given to the Worker or
  Ticker). Until the application configures an SDK that provider does nothing
  (a fraction of a microsecond a call); with one, metrics flow to its exporters.
* **Prometheus** (``pip install pgque[prometheus]``): ``Worker(metrics_port=...)``
  serves the same instruments of that worker (and of its Ticker) in the
  Prometheus text format, for users without OpenTelemetry. The database-side
  figures (backlog per slot, dead letters, rotation) are ``pgque exporter``'s.

Names follow OpenTelemetry's messaging conventions where one fits
(``messaging.process.duration``, ``messaging.client.sent.messages`` ...),
``pgque.*`` otherwise; every attribute set carries ``messaging.system=pgque``.
In Prometheus a name becomes ``pgque_`` plus its words, and the attributes
short labels (queue, group, slot, type, outcome, operation, ticker).

A worker records once per batch piece, not per event: an SDK's record costs
4 to 7 µs, a no-op handler's event about 16. So ``messaging.process.duration``
and the pickup latency are a piece's (the pickup of its oldest event, the time
its handlers took together), and the event counts are added per piece. With
one event a piece (a quiet queue) the two are the same. The instruments and
their meanings are listed in docs/operations.md ("Monitoring").
"""

from __future__ import annotations

import collections
import operator
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from prometheus_client import CollectorRegistry

    from pgque.types import Batch

__all__ = ["INSTRUMENTS", "Instrument", "Metrics", "MetricsServer", "ProducerMetrics",
           "TickerMetrics", "WorkerMetrics", "parse_labels", "report_sends_to"]

# Seconds: from a millisecond (a pickup on a busy queue) to a minute (a stuck one).
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0, 60.0)
_EVENTS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0)


@dataclass(frozen=True)
class Instrument:
    """One metric: its OpenTelemetry name, kind (counter, updown or histogram),
    unit, the labels it carries, and for a histogram its bucket bounds."""

    name: str
    kind: str
    unit: str
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    #: Its Prometheus name when the rule below would not give a good one.
    prometheus: str = ""

    @property
    def prometheus_name(self) -> str:
        """``pgque_`` and the name's words, ``_seconds`` for a unit of seconds
        (prometheus_client adds a counter's ``_total`` itself)."""
        if self.prometheus:
            return self.prometheus
        words = self.name.removeprefix("pgque.").replace(".", "_")
        return f"pgque_{words}_seconds" if self.unit == "s" else f"pgque_{words}"


_WORKER = ("queue", "group")
_SLOT = ("queue", "group", "slot")

INSTRUMENTS: dict[str, Instrument] = {i.name: i for i in (
    # A worker's.
    Instrument("pgque.worker.events", "counter", "{event}",
               "Events of the worker's batch pieces (retries too), by type (the first 100 "
               "types, then '(other)') and outcome: ok, failed (its handler raised; the "
               "server retries it, or dead-letters it once out of tries), dead (not "
               "retryable: the worker dead-letters it), held (not handed to the handler: "
               "behind a failed event of its key, under the pause policy).",
               (*_SLOT, "type", "outcome")),
    Instrument("messaging.process.duration", "histogram", "s",
               "How long the handlers of a batch piece took, first start to last end.",
               _SLOT, _SECONDS, prometheus="pgque_worker_process_duration_seconds"),
    Instrument("pgque.worker.pickup.latency", "histogram", "s",
               "From the send of a piece's oldest event (the database's clock) to the start "
               "of its handling (the worker's clock): their skew is in it.", _SLOT, _SECONDS),
    Instrument("pgque.worker.batch.size", "histogram", "{event}",
               "Events in a batch piece.", _SLOT, _EVENTS),
    Instrument("pgque.worker.retries", "counter", "{event}",
               "Events handed out again after a failure (retry_count above 0).", _SLOT),
    Instrument("pgque.worker.dead_letters", "counter", "{event}",
               "Events the worker sent to the dead letters as not retryable (those the "
               "server dead-letters once out of tries count as failed).",
               _SLOT),
    Instrument("pgque.worker.slots.owned", "updown", "{slot}",
               "Slots the worker owns.", _WORKER),
    Instrument("pgque.worker.claims", "counter", "{claim}",
               "Slots the worker claimed; each claim takes the slot's next fencing epoch.",
               _SLOT),
    Instrument("pgque.worker.losses", "counter", "{slot}",
               "Slots the worker lost without releasing them: found owned by another, or "
               "gone with a lost session.", _SLOT),
    Instrument("pgque.worker.reconnects", "counter", "{session}",
               "Sessions lost and opened again: the control session's, a lane's.", _WORKER),
    Instrument("pgque.worker.sessions", "updown", "{session}",
               "Lane sessions the worker has open.", _WORKER),
    # A ticker's.
    Instrument("pgque.ticker.ticks", "counter", "{tick}", "Ticks the ticker made.",
               ("ticker",)),
    Instrument("pgque.ticker.look.duration", "histogram", "s",
               "How long a look for ticks due took (one call, every queue or the hot ones).",
               ("ticker",), _SECONDS),
    Instrument("pgque.ticker.elections", "counter", "{election}",
               "Times the ticker became the database's active one.", ("ticker",)),
    Instrument("pgque.ticker.active", "updown", "{ticker}",
               "1 while the ticker is the active one.", ("ticker",)),
    # A producer's (Client.send, send_batch).
    Instrument("messaging.client.sent.messages", "counter", "{event}",
               "Events sent (as written; a send that rolls back later counts too).",
               ("queue", "operation"), prometheus="pgque_producer_sent_events"),
    Instrument("messaging.client.operation.duration", "histogram", "s",
               "How long a send call took, its round trip included.",
               ("queue", "operation"), _SECONDS,
               prometheus="pgque_producer_operation_duration_seconds"),
)}

# Labels as OpenTelemetry attributes.
_ATTRIBUTES = {
    "queue": "messaging.destination.name",
    "group": "messaging.consumer.group.name",
    "slot": "messaging.destination.partition.id",
    "type": "pgque.event.type",
    "outcome": "pgque.outcome",
    "operation": "messaging.operation.name",
    "ticker": "pgque.ticker.name",
}


class _Backend:
    """Where measurements go: ``add`` for counters and updown counters,
    ``record`` for histograms; labels in the instrument's order."""

    def add(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        raise NotImplementedError

    def record(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        raise NotImplementedError


class _OpenTelemetry(_Backend):
    """The instruments on an OpenTelemetry meter; attribute dicts made once per
    label set (the SDK hashes them on every call)."""

    def __init__(self, provider: MeterProvider) -> None:
        from pgque._version import __version__

        meter = provider.get_meter("pgque", __version__)
        self._instruments: dict[str, Any] = {}
        for instrument in INSTRUMENTS.values():
            if instrument.kind == "counter":
                made: Any = meter.create_counter(instrument.name, instrument.unit,
                                                 instrument.description)
            elif instrument.kind == "updown":
                made = meter.create_up_down_counter(instrument.name, instrument.unit,
                                                    instrument.description)
            else:
                made = meter.create_histogram(
                    instrument.name, instrument.unit, instrument.description,
                    explicit_bucket_boundaries_advisory=list(instrument.buckets))
            self._instruments[instrument.name] = made
        self._attributes: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}

    def _attrs(self, name: str, labels: tuple[str, ...]) -> dict[str, str]:
        attrs = self._attributes.get((name, labels))
        if attrs is None:
            attrs = {"messaging.system": "pgque"}
            attrs.update(zip((_ATTRIBUTES[key] for key in INSTRUMENTS[name].labels), labels,
                             strict=True))
            self._attributes[name, labels] = attrs
        return attrs

    def add(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        self._instruments[name].add(value, self._attrs(name, labels))

    def record(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        self._instruments[name].record(value, self._attrs(name, labels))


class _Prometheus(_Backend):
    """The instruments in a prometheus_client registry of their own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        import prometheus_client

        self.registry = registry
        self._metrics: dict[str, Any] = {}
        for instrument in INSTRUMENTS.values():
            args = (instrument.prometheus_name, instrument.description, instrument.labels)
            if instrument.kind == "counter":
                made: Any = prometheus_client.Counter(*args, registry=registry)
            elif instrument.kind == "updown":
                made = prometheus_client.Gauge(*args, registry=registry)
            else:
                made = prometheus_client.Histogram(*args, registry=registry,
                                                   buckets=instrument.buckets)
            self._metrics[instrument.name] = made
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def _child(self, name: str, labels: tuple[str, ...]) -> Any:
        child = self._children.get((name, labels))
        if child is None:
            child = self._children[name, labels] = self._metrics[name].labels(*labels)
        return child

    def add(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        self._child(name, labels).inc(value)

    def record(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        self._child(name, labels).observe(value)


class MetricsServer:
    """A WSGI app (a registry's metrics, the exporter's scrape) served by a
    thread of its own, a thread per request, from :meth:`start` to
    :meth:`stop`, without an access log line per scrape. Not prometheus_client's
    start_http_server: its loop polls for a stop every half second, and a
    worker's stop would wait for it."""

    def __init__(self, app: Any, host: str, port: int, *,
                 name: str = "pgque-metrics") -> None:
        import socket
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds is not news

        self._server = make_server(host, port, app, Server, handler_class=Quiet)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, name=name, daemon=True)

    @classmethod
    def of_registry(cls, registry: CollectorRegistry, host: str, port: int, *,
                    name: str = "pgque-metrics") -> MetricsServer:
        """The registry's metrics at /metrics."""
        from prometheus_client import make_wsgi_app

        return cls(make_wsgi_app(registry), host, port, name=name)

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on: the port chosen when 0 was asked."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


# One label as pgque.metrics() and Prometheus's text format write it.
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_labels(labels: str) -> list[tuple[str, str]]:
    """A label set as pgque.metrics() writes it (``queue="q",slot="3"``), as
    (name, value) pairs, the values unescaped."""
    return [(name, re.sub(r"\\.", lambda m: _UNESCAPE.get(m.group(), m.group()), raw))
            for name, raw in _LABEL.findall(labels)]


def opentelemetry_provider(provider: MeterProvider | None = None) -> MeterProvider | None:
    """The provider to report on: the one given, else the global one when
    opentelemetry-api is installed, else None (no OpenTelemetry)."""
    if provider is not None:
        return provider
    try:
        from opentelemetry import metrics
    except ImportError:
        return None
    return metrics.get_meter_provider()


class Metrics:
    """Measurements fanned out to the backends there are. Thread-safe as the
    backends are (both lock their own state)."""

    def __init__(self, backends: Sequence[_Backend]) -> None:
        self._backends = tuple(backends)

    @classmethod
    def of(cls, provider: MeterProvider | None = None,
           registry: CollectorRegistry | None = None) -> Metrics | None:
        """On OpenTelemetry (the provider given, or the global one when the API is
        installed) and on a Prometheus registry when one is given; None when
        there is neither."""
        backends: list[_Backend] = []
        resolved = opentelemetry_provider(provider)
        if resolved is not None:
            backends.append(_OpenTelemetry(resolved))
        if registry is not None:
            backends.append(_Prometheus(registry))
        return cls(backends) if backends else None

    def add(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        for backend in self._backends:
            backend.add(name, value, labels)

    def record(self, name: str, value: float, labels: tuple[str, ...]) -> None:
        for backend in self._backends:
            backend.record(name, value, labels)


#: Event types a worker labels its counts with, at most; the others are OTHER_TYPE.
MAX_TYPES = 100
OTHER_TYPE = "(other)"
_TYPE = operator.attrgetter("type")
_RETRY_COUNT = operator.attrgetter("retry_count")


class WorkerMetrics:
    """A worker's instruments, labelled with its queue and group."""

    def __init__(self, metrics: Metrics, queue: str, group: str) -> None:
        self.metrics = metrics
        self._worker = (queue, group)
        self._slots: dict[int, tuple[str, str, str]] = {}
        self._types: set[str] = set()

    def _slot(self, slot: int) -> tuple[str, str, str]:
        labels = self._slots.get(slot)
        if labels is None:
            labels = self._slots[slot] = (*self._worker, str(slot))
        return labels

    def piece(self, batch: Batch[Any], reasons: dict[int, str], dead: Iterable[int],
              started: float, duration: float) -> None:
        """A batch piece's handlers returned: ``reasons`` of its failed events
        (held ones too), ``dead`` those sent to the dead letters, ``started``
        the first handler's start (time.time()), ``duration`` their length."""
        messages = batch.messages
        if not messages:
            return
        assert batch.slot is not None
        labels = self._slot(batch.slot)
        add, record = self.metrics.add, self.metrics.record
        retries = sum(map(bool, map(_RETRY_COUNT, messages)))  # (C loops: no bytecode an event)
        dead_ids = set(dead) if reasons else set()
        if reasons:
            outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
            for message in messages:
                reason = reasons.get(message.id)
                outcome = ("ok" if reason is None else "dead" if message.id in dead_ids
                           else "held" if reason.startswith("held:") else "failed")
                outcomes[message.type, outcome] += 1
        else:
            outcomes = collections.Counter({(type_, "ok"): count for type_, count
                                            in collections.Counter(map(_TYPE, messages)).items()})
        for (type_, outcome), count in outcomes.items():
            add("pgque.worker.events", count, (*labels, self._type(type_), outcome))
        if retries:
            add("pgque.worker.retries", retries, labels)
        if dead_ids:
            add("pgque.worker.dead_letters", len(dead_ids), labels)
        record("messaging.process.duration", duration, labels)
        record("pgque.worker.batch.size", len(messages), labels)
        record("pgque.worker.pickup.latency",
               max(0.0, started - messages[0].created_at.timestamp()), labels)

    def _type(self, type_: str) -> str:
        """The event type as a label: the first MAX_TYPES types a worker sees,
        then OTHER_TYPE. Producers choose types freely: a label per type
        without a bound would let one grow a worker's memory and every scrape
        without end."""
        if type_ in self._types:
            return type_
        if len(self._types) < MAX_TYPES:
            self._types.add(type_)
            return type_
        return OTHER_TYPE

    def claimed(self, slot: int) -> None:
        self.metrics.add("pgque.worker.claims", 1, self._slot(slot))
        self.metrics.add("pgque.worker.slots.owned", 1, self._worker)

    def released(self, slot: int, *, lost: bool = False) -> None:
        """The worker no longer owns the slot: released, or ``lost``."""
        if lost:
            self.metrics.add("pgque.worker.losses", 1, self._slot(slot))
        self.metrics.add("pgque.worker.slots.owned", -1, self._worker)

    def session(self, opened: bool) -> None:
        """A lane's session opened (True) or ended (False)."""
        self.metrics.add("pgque.worker.sessions", 1 if opened else -1, self._worker)

    def reconnected(self) -> None:
        self.metrics.add("pgque.worker.reconnects", 1, self._worker)


class TickerMetrics:
    """A ticker's instruments, labelled with its name."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.metrics = metrics
        self._labels = (name,)

    def looked(self, ticks: int, duration: float) -> None:
        self.metrics.record("pgque.ticker.look.duration", duration, self._labels)
        if ticks:
            self.metrics.add("pgque.ticker.ticks", ticks, self._labels)

    def ticked(self, ticks: int) -> None:
        """Ticks made outside a look (a standby's overdue ones)."""
        if ticks:
            self.metrics.add("pgque.ticker.ticks", ticks, self._labels)

    def active(self, active: bool) -> None:
        if active:
            self.metrics.add("pgque.ticker.elections", 1, self._labels)
        self.metrics.add("pgque.ticker.active", 1 if active else -1, self._labels)


class ProducerMetrics:
    """The sends of every client of the process, on the global OpenTelemetry
    provider (made at the first send: the application sets its provider up
    before it sends), or on the one given to :func:`report_sends_to`."""

    _lock = threading.Lock()
    _made: ProducerMetrics | None = None
    _none = False  # opentelemetry-api is not installed: never look again

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    @classmethod
    def get(cls) -> ProducerMetrics | None:
        made = cls._made
        if made is not None or cls._none:
            return made
        with cls._lock:
            if cls._made is None and not cls._none:
                metrics = Metrics.of()
                if metrics is None:
                    cls._none = True
                else:
                    cls._made = ProducerMetrics(metrics)
            return cls._made

    @classmethod
    def use(cls, provider: MeterProvider | None) -> None:
        """Report the sends on ``provider`` from now on; None: on the global one
        again (looked up at the next send)."""
        with cls._lock:
            cls._none = False
            cls._made = None
            if provider is not None:
                metrics = Metrics.of(provider)
                assert metrics is not None
                cls._made = ProducerMetrics(metrics)

    def sent(self, queue: str, operation: str, events: int, began: float) -> None:
        """``events`` sent by one call that began at ``began`` (time.perf_counter())."""
        labels = (queue, operation)
        self.metrics.record("messaging.client.operation.duration",
                            time.perf_counter() - began, labels)
        self.metrics.add("messaging.client.sent.messages", events, labels)


def report_sends_to(provider: MeterProvider | None) -> None:
    """Have every client of the process report its sends on this OpenTelemetry
    MeterProvider (None: on the global one, the default)."""
    ProducerMetrics.use(provider)
