"""A worker process for the fault suite (tests/test_faults.py).

    python tests/fault_worker.py CONFIG_JSON

runs :class:`pgque.Worker` (with ``PGQUE_TEST_WORKER=async``, :class:`pgque.AsyncWorker`
and a coroutine doing the same) until SIGTERM, with a handler that records every
call in the table ``fault_handled`` (made by tests/faults.py): event id, key,
producer, producer sequence, retry count, this process's pid, the worker's
name, and the start and end of the call on the DATABASE clock
(``clock_timestamp()``), plus whether the call failed.

The handler fails an event while its retry count is below the ``fail`` field
of its payload, so which events fail, and how often, follows from the
payload alone (``fail`` larger than the queue's max_retries: it always fails).

Records go over the handler's own connection (never the worker's), straight
to the server (never through a fault proxy), synchronously committed (an
immediate server stop must not lose a record whose effects survived). That
connection survives every fault the suite injects on the worker's sessions;
when the server itself restarts, a record is retried until the server is
back, and a retry after a lost reply cannot count a call twice (each call has
a unique token).

Its own log records (pgque's loggers, INFO and above) go to the table
``fault_log`` (worker, pid, time made, logger, level, message), by a writer
thread over the record DSN: when it connected, noticed a lost session,
reconnected. Warnings and errors also go to stderr (the worker's log file).

Config keys: dsn (the worker's, maybe through a proxy or with options),
record_dsn, queue, consumer, slots, name, max_events, poll_interval,
rebalance_interval, retry_after, delay_ms ([low, high] handler sleep), seed,
network_timeout (passed only when set and when this Worker accepts it),
ticker_dsn (when set: the worker's Ticker connects there instead of to dsn),
ownership and lease (the Worker's: "lease" behind a transaction pooler),
transactional (a transactional handler: it also writes the event's effect,
a row of ``fault_effects`` and its amount added to the key's row of
``fault_balance``, on the worker's connection, before it sleeps and maybe
fails; so a failed call's effect rolls back with its savepoint, and a call
whose batch was not acked leaves none).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import inspect
import itertools
import json
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from typing import Any

import psycopg

import pgque

RECORD_RETRY_SECONDS = 120.0  # a server restart must be over by then


class Recorder:
    """One autocommit connection per handler thread, re-opened when it breaks."""

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn = dsn
        self.name = name
        self.local = threading.local()

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self.local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5,
                                   application_name=f"rec-{self.name}"[:63])
            conn.execute("set synchronous_commit = on")
            self.local.conn = conn
        return conn

    def execute(self, query: str, params: tuple[Any, ...]) -> None:
        """Run one idempotent statement, retrying through connection failures."""
        deadline = time.monotonic() + RECORD_RETRY_SECONDS
        while True:
            try:
                self._conn().execute(query, params)
                return
            except psycopg.OperationalError:
                conn = getattr(self.local, "conn", None)
                if conn is not None:
                    conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


class LogRecorder(logging.Handler):
    """Copies the worker's own log records (pgque's loggers, INFO and above:
    connected, claimed, session gone, reconnecting, stopped) into ``fault_log``
    with the time they were made, so the suite can tell when the worker noticed
    a lost session and when it reconnected. A writer thread does the inserts:
    logging never waits for the database (a restart, a cut link)."""

    def __init__(self, recorder: Recorder, name: str) -> None:
        super().__init__(logging.INFO)
        self.recorder = recorder
        self.name_ = name
        self.pending: queue.Queue[tuple[float, str, str, str] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._write, name="fault-log", daemon=True)
        self.thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.pending.put((record.created, record.name, record.levelname,
                              record.getMessage()[:500]))

    def _write(self) -> None:
        pid = os.getpid()
        while (item := self.pending.get()) is not None:
            created, logger, level, message = item
            with contextlib.suppress(Exception):
                self.recorder.execute(
                    "insert into fault_log (worker, pid, at, logger, level, message) "
                    "values (%s, %s, to_timestamp(%s), %s, %s, %s)",
                    (self.name_, pid, created, logger, level, message))

    def flush_and_stop(self, timeout: float) -> None:
        self.pending.put(None)
        self.thread.join(timeout)


class HandlerFailure(Exception):
    """The failure the payload asked for."""


def main() -> int:
    config: dict[str, Any] = json.loads(sys.argv[1])
    name: str = config["name"]
    pid = os.getpid()
    rng = random.Random(config["seed"])
    low, high = config["delay_ms"]
    recorder = Recorder(config["record_dsn"], name)
    calls = itertools.count()

    def handler(message: pgque.Message[Any], conn: psycopg.Connection[Any] | None = None) -> None:
        payload = message.payload
        if conn is not None:
            amount = (payload["p"] * 7 + payload["s"]) % 13 + 1  # faults.effect_amount
            conn.execute("insert into fault_effects (ev_id, key, amount, worker) "
                         "values (%s, %s, %s, %s)", (message.id, message.partition_key, amount,
                                                     name))
            conn.execute("insert into fault_balance as b (key, total) values (%s, %s) "
                         "on conflict (key) do update set total = b.total + excluded.total",
                         (message.partition_key, amount))
        token = f"{pid}:{next(calls)}"
        recorder.execute(
            "insert into fault_handled (token, ev_id, key, producer, seq, retry, pid, worker, "
            "started) values (%s, %s, %s, %s, %s, %s, %s, %s, clock_timestamp()) "
            "on conflict (token) do nothing",
            (token, message.id, message.partition_key, payload["p"], payload["s"],
             message.retry_count, pid, name))
        threading.Event().wait(rng.uniform(low, high) / 1000)
        failed = message.retry_count < payload.get("fail", 0)
        recorder.execute(
            "update fault_handled set ended = clock_timestamp(), outcome = %s "
            "where token = %s and ended is null",
            ("fail" if failed else "ok", token))
        if failed:
            raise HandlerFailure(f"event {message.id} fails at retry {message.retry_count}")

    async def async_handler(message: pgque.Message[Any],
                            conn: psycopg.AsyncConnection[Any] | None = None) -> None:
        """The same as handler, for the AsyncWorker: its effect on the lane's
        AsyncConnection, its records (blocking, retried) in a thread."""
        payload = message.payload
        if conn is not None:
            amount = (payload["p"] * 7 + payload["s"]) % 13 + 1  # faults.effect_amount
            await conn.execute("insert into fault_effects (ev_id, key, amount, worker) "
                               "values (%s, %s, %s, %s)",
                               (message.id, message.partition_key, amount, name))
            await conn.execute("insert into fault_balance as b (key, total) values (%s, %s) "
                               "on conflict (key) do update set total = b.total + excluded.total",
                               (message.partition_key, amount))
        token = f"{pid}:{next(calls)}"
        await asyncio.to_thread(
            recorder.execute,
            "insert into fault_handled (token, ev_id, key, producer, seq, retry, pid, worker, "
            "started) values (%s, %s, %s, %s, %s, %s, %s, %s, clock_timestamp()) "
            "on conflict (token) do nothing",
            (token, message.id, message.partition_key, payload["p"], payload["s"],
             message.retry_count, pid, name))
        await asyncio.sleep(rng.uniform(low, high) / 1000)
        failed = message.retry_count < payload.get("fail", 0)
        await asyncio.to_thread(
            recorder.execute,
            "update fault_handled set ended = clock_timestamp(), outcome = %s "
            "where token = %s and ended is null",
            ("fail" if failed else "ok", token))
        if failed:
            raise HandlerFailure(f"event {message.id} fails at retry {message.retry_count}")

    kwargs: dict[str, Any] = {
        "queue": config["queue"], "consumer": config["consumer"], "slots": config["slots"],
        "max_events": config["max_events"],
        "poll_interval": config["poll_interval"],
        "rebalance_interval": config["rebalance_interval"],
        "retry_after": config["retry_after"], "name": name,
    }
    if config.get("transactional"):
        kwargs["transactional"] = True
    if config.get("ownership", "advisory") != "advisory":  # behind a transaction pooler
        kwargs["ownership"] = config["ownership"]
        kwargs["lease"] = config["lease"]
    if config.get("failure_policy", "skip") != "skip":
        kwargs["failure_policy"] = config["failure_policy"]
    accepted = inspect.signature(pgque.Worker).parameters
    if "record" in accepted:  # pgque verify checks the record (faults.py)
        kwargs["record"] = True
    if config.get("network_timeout") is not None and "network_timeout" in accepted:
        kwargs["network_timeout"] = config["network_timeout"]
    if config.get("ticker_dsn"):
        # As the Worker makes its own: the same network timeout.
        ticker_kwargs: dict[str, Any] = {"name": f"{name}-ticker"}
        if "network_timeout" in kwargs:
            ticker_kwargs["network_timeout"] = kwargs["network_timeout"]
        kwargs["ticker"] = pgque.Ticker(config["ticker_dsn"], **ticker_kwargs)

    faulthandler.register(signal.SIGUSR1)  # the suite dumps our stacks if we hang
    # Handler failures are expected by the hundred: keep their tracebacks out.
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s [{name} {pid}] %(name)s: %(message)s")
    for handler_ in logging.getLogger().handlers:
        handler_.setLevel(logging.WARNING)  # the log file: warnings and errors
    logging.getLogger("pgque.worker").addFilter(
        lambda record: "handler failed" not in record.getMessage())
    log_recorder = LogRecorder(Recorder(config["record_dsn"], f"{name}-log"), name)
    pgque_log = logging.getLogger("pgque")
    pgque_log.setLevel(logging.INFO)
    pgque_log.addHandler(log_recorder)
    try:
        # Returns after SIGTERM, having released everything.
        if os.environ.get("PGQUE_TEST_WORKER") == "async":  # the AsyncWorker (conftest.py)
            asyncio.run(pgque.AsyncWorker(config["dsn"], handler=async_handler,
                                          **kwargs).run())
        else:
            pgque.Worker(config["dsn"], handler=handler, **kwargs).run()
    finally:
        log_recorder.flush_and_stop(5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
