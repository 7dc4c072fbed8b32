"""pgque's database-side metrics for Prometheus: ``pgque exporter``.

:class:`MetricsCollector` is a ``prometheus_client`` collector: each scrape
runs one statement, ``select metric, labels, value from pgque.metrics()``
(pgque/sql/code/info/metrics.sql lists every metric, its labels and what it
counts), on a connection it keeps, and turns the rows into metric families.
:class:`Exporter` serves a collector over HTTP (``/metrics``), which is what
``pgque exporter`` runs; it writes the text format straight from the rows
(:func:`exposition`), which at 1,600 slots took a fraction of the time
prometheus_client's writer took over the families.

Everything a database shows is there for every queue and group the DSN's
role may see, so give the exporter a role in ``pgque_reader`` (or
``pgque_admin`` for all of them). Besides pgque's own metrics, each scrape
says ``pgque_up`` (1: the query answered; 0: it did not, and why is logged
at WARNING on logger ``pgque.exporter``) and ``pgque_scrape_duration_seconds``.

This module needs ``prometheus-client``, the ``prometheus`` extra
(``pip install 'pgque[prometheus]'``); ``import pgque`` does not import it.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pgque._dsn import redact
from pgque.client import open_connection
from pgque.errors import ConnectError
from pgque.metrics import MetricsServer, parse_labels

__all__ = ["METRICS", "Exporter", "MetricsCollector", "ProblemWithDatabase", "exposition",
           "families", "parse_labels"]

log = logging.getLogger("pgque.exporter")

#: The query of a scrape: one round trip.
QUERY = "select metric, labels, value from pgque.metrics()"

#: What /metrics serves: Prometheus' text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: What each metric of pgque.metrics() is: its type and its help text. A name the
#: database returns and this table lacks (a newer engine) is served as a gauge
#: with a generic help text, so an older exporter keeps working.
METRICS: dict[str, tuple[str, str]] = {
    "pgque_up": ("gauge", "1 when pgque.metrics() answered this scrape, else 0."),
    "pgque_scrape_duration_seconds": ("gauge", "Time this scrape spent on pgque.metrics()."),
    "pgque_active_ticker": ("gauge", "1 when a ticker holds the election, else 0."),
    "pgque_active_ticker_info": (
        "gauge", "The active ticker: backend pid and application name (1)."),
    "pgque_newest_tick_age_seconds": (
        "gauge", "Age of the newest tick of any queue shown."),
    "pgque_queue_events": (
        "counter", "Positions taken from the queue's event sequence: events sent (rolled-back "
                   "sends too; a delayed event when sent and when it enters the log)."),
    "pgque_queue_events_since_last_tick": (
        "gauge", "Event sequence positions taken since the queue's newest tick."),
    "pgque_queue_last_tick_age_seconds": ("gauge", "Age of the queue's newest tick."),
    "pgque_queue_stalled": (
        "gauge", "1 when committed events wait for a tick that nobody makes."),
    "pgque_queue_stalled_after_seconds": ("gauge", "The queue's stall threshold."),
    "pgque_queue_current_table": ("gauge", "The event table written now."),
    "pgque_queue_rotation_age_seconds": ("gauge", "Time since the queue last switched tables."),
    "pgque_queue_rotation_period_seconds": ("gauge", "The queue's rotation period."),
    "pgque_queue_table_size_bytes": (
        "gauge", "Estimated size of an event table (pg_class.relpages: as of its last vacuum, "
                 "analyze or truncate)."),
    "pgque_group_slots": ("gauge", "The consumer group's slot count."),
    "pgque_group_members": ("gauge", "Live members of the consumer group."),
    "pgque_slot_owned": ("gauge", "1 when a session the group counts owns the slot."),
    "pgque_slot_owner_info": ("gauge", "The slot's owner: application name and backend pid (1)."),
    "pgque_slot_epoch": ("gauge", "The slot's current fencing epoch."),
    "pgque_slot_blocked_keys": ("gauge", "Keys of the slot that the pause policy blocks."),
    "pgque_slot_oldest_blocked_age_seconds": (
        "gauge", "How long the slot's oldest blocked key has waited."),
}
_PER_SUBSCRIPTION = {
    "behind_events": "Event sequence positions after its last finished tick: the events of "
                     "every key sent since (not only its own), its open batch included.",
    "lag_seconds": "Age of the first tick after its last finished one (0 at the newest tick).",
    "ticks_behind": "Ticks of the queue after its last finished one, counted up to 100.",
    "last_active_age_seconds": "Time since its last receive or ack.",
    "retries_waiting": "Its nacked events not back in the log yet.",
    "dead_letters": "Its dead letters.",
    "stalled": "1 when its lag exceeds the queue's threshold and it has not moved for as "
               "long, or (a slot) nobody owns it.",
}
for _kind, _whose in (("consumer", "The plain consumer"), ("slot", "The slot")):
    for _name, _text in _PER_SUBSCRIPTION.items():
        METRICS[f"pgque_{_kind}_{_name}"] = ("gauge", f"{_whose}: {_text[0].lower()}{_text[1:]}")


class ProblemWithDatabase(RuntimeError):
    """The database cannot give metrics to this role: pgque is not installed
    there, is older than the exporter, or the role may not read them."""


#: A row of pgque.metrics(): metric, labels as the text format writes them, value.
Row = tuple[str, str, float]

# One label of a label set: name="value", the value escaped (\\, \", \n).


def _family_name(metric: str) -> str:
    # A counter's samples end in _total; its family is named without it.
    return metric[:-len("_total")] if metric.endswith("_total") else metric


def _kind_and_help(metric: str) -> tuple[str, str]:
    return METRICS.get(_family_name(metric), ("gauge", "A pgque metric (see pgque.metrics())."))


def families(rows: Iterable[Row]) -> list[Metric]:
    """The metric families of ``pgque.metrics()`` rows, in the order their
    names first appear."""
    found: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    names: dict[str, list[str]] = {}
    for metric, labels, value in rows:
        pairs = parse_labels(labels)
        family = found.get(metric)
        if family is None:
            kind, text = _kind_and_help(metric)
            names[metric] = [name for name, _ in pairs]
            family = found[metric] = (
                CounterMetricFamily(_family_name(metric), text, labels=names[metric])
                if kind == "counter"
                else GaugeMetricFamily(metric, text, labels=names[metric]))
        if [name for name, _ in pairs] != names[metric]:
            continue  # not the labels of the metric's first row: a bug, not served
        family.add_metric([v for _, v in pairs], value)
    return list(found.values())


def _number(value: float) -> str:
    if math.isfinite(value):
        return repr(float(value))
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def exposition(rows: Iterable[Row]) -> str:
    """The rows in Prometheus' text format (version 0.0.4), grouped by metric
    with its HELP and TYPE lines: what :func:`families` gives, written out
    straight from the rows, whose labels pgque.metrics() wrote already.
    (prometheus_client's writer checks and escapes every label of every
    sample again: at 1,600 slots that cost more than the query.)"""
    lines: dict[str, list[str]] = {}
    for metric, labels, value in rows:
        samples = lines.get(metric)
        if samples is None:
            kind, text = _kind_and_help(metric)
            help_text = text.replace("\\", "\\\\").replace("\n", "\\n")
            samples = lines[metric] = [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        samples.append(f"{metric}{{{labels}}} {_number(value)}" if labels
                       else f"{metric} {_number(value)}")
    return "".join(line + "\n" for samples in lines.values() for line in samples)


class MetricsCollector(Collector):
    """Collects ``pgque.metrics()`` at every scrape, on a connection of its own.

    The connection is opened at the first scrape and kept. A scrape that
    fails (the server went away, a lock not had within 100 ms) is logged and
    serves ``pgque_up 0``; a connection that broke is dropped, and the next
    scrape connects again.
    Concurrent scrapes take turns. ``statement_timeout`` (seconds) bounds a
    scrape's query. Register it in a ``prometheus_client`` registry, or serve
    it with :class:`Exporter`.
    """

    def __init__(self, dsn: str, *, connect_timeout: float = 5.0,
                 statement_timeout: float = 10.0,
                 application_name: str = "pgque-exporter") -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout
        self.application_name = application_name
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        """Nothing up front: registering the collector must not query the database."""
        return []

    def rows(self) -> list[Row]:
        """One run of the query: its rows. Raises what psycopg or the connection
        raises, and ProblemWithDatabase for a database that cannot answer it."""
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = open_connection(
                        self.dsn, timeout=self.connect_timeout,
                        application_name=self.application_name)
                    # Whole milliseconds: the setting's unit.
                    self._conn.execute(f"set statement_timeout = "
                                       f"{max(1, round(self.statement_timeout * 1000))}")
                return self._conn.execute(QUERY, binary=True).fetchall()
            except (psycopg.errors.UndefinedFunction,
                    psycopg.errors.InvalidSchemaName) as exc:
                self.close_connection()
                raise ProblemWithDatabase(
                    "pgque.metrics() is not installed in this database: run 'pgque install' "
                    "with this version of pgque") from exc
            except psycopg.errors.InsufficientPrivilege as exc:
                role = self._conn.info.user if self._conn is not None else "of the DSN"
                self.close_connection()
                raise ProblemWithDatabase(
                    f"role {role} may not read pgque's metrics: grant it pgque_reader "
                    "(the queues and groups it may use) or pgque_admin (all)") from exc
            except psycopg.Error:
                # A query that failed (a lock not had in time) leaves a usable session.
                if self._conn is not None and (self._conn.broken or self._conn.closed):
                    self.close_connection()
                raise
            except BaseException:
                self.close_connection()  # an interrupted query leaves it in no known state
                raise

    def _scrape(self) -> tuple[list[Row], float, float]:
        """The rows (none when the query failed: logged), up and the seconds taken."""
        started = time.perf_counter()
        try:
            rows = self.rows()
        except (psycopg.Error, ProblemWithDatabase, ConnectError, OSError) as exc:
            # The first line: an error's CONTEXT would quote all of pgque.metrics().
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            log.warning("scrape failed: %s", redact(f"{type(exc).__name__}: {first}", self.dsn))
            return [], 0.0, time.perf_counter() - started
        return rows, 1.0, time.perf_counter() - started

    def collect(self) -> Iterator[Metric]:
        """The families of one scrape, then ``pgque_up`` and the scrape's duration."""
        rows, up, seconds = self._scrape()
        yield from families(rows)
        for name, value in (("pgque_up", up), ("pgque_scrape_duration_seconds", seconds)):
            yield GaugeMetricFamily(name, METRICS[name][1], value=value)

    def exposition(self) -> str:
        """One scrape in the text format: :meth:`collect`'s families, written out."""
        rows, up, seconds = self._scrape()
        return exposition([*rows, ("pgque_up", "", up),
                           ("pgque_scrape_duration_seconds", "", seconds)])

    def close_connection(self) -> None:
        """Close the connection, if any (the next scrape opens another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()


class Exporter:
    """Serves a :class:`MetricsCollector` at ``http://host:port/metrics``.

    ``port`` 0 takes a free port (:attr:`port` says which). Use as a context
    manager, or :meth:`start` and :meth:`stop`. ``host`` defaults to the
    loopback interface: queue names are visible to nobody but pgque's roles,
    so listen wider (``0.0.0.0``) only where the network is trusted.
    """

    def __init__(self, dsn: str, *, host: str = "127.0.0.1", port: int = 9187,
                 connect_timeout: float = 5.0, statement_timeout: float = 10.0) -> None:
        self.collector = MetricsCollector(dsn, connect_timeout=connect_timeout,
                                          statement_timeout=statement_timeout)
        self.host = host
        self._port = port
        self._server: MetricsServer | None = None

    @property
    def port(self) -> int:
        """The port it listens on (once started, the one taken for port 0)."""
        return self._port if self._server is None else self._server.address[1]

    @property
    def url(self) -> str:
        """Where Prometheus scrapes it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def check(self) -> int:
        """One run of the query now: how many rows it gave. Raises
        ProblemWithDatabase where no scrape can succeed until someone acts, and
        what connecting raises (pgque.ConnectError) when the server does not
        answer."""
        return len(self.collector.rows())

    def _app(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        """The WSGI application: the scrape at /metrics (and /), gzipped when
        the client takes it (Prometheus does)."""
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"pgque exporter: the metrics are at /metrics\n"]
        body = self.collector.exposition().encode()
        headers = [("Content-Type", CONTENT_TYPE)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            # The fastest level: a tenth of the size for a few milliseconds.
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [body]

    def start(self) -> Exporter:
        """Listen and serve on a thread of its own."""
        self._server = MetricsServer(self._app, self.host, self._port, name="pgque-exporter")
        self._server.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the database connection."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        self.collector.close_connection()

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
