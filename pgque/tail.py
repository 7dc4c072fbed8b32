"""``pgque tail`` as a :class:`~pgque.lifecycle.Service`: follow a queue through a
temporary consumer.

The tail subscribes a consumer of its own (``tail-<pid>-<random>``), shows each
event once, acks, and removes the consumer on the way out whatever ends it: the
limit, a stop (SIGINT or SIGTERM), or an error. A consumer left behind holds
back rotation of its queue until someone removes it, so when the server cannot
be reached to remove it, the tail says how to do it by hand.

From the Service it has its stops: noticed within ``STOP_LATENCY`` in every
wait, and a call in flight is cut (``abandon_on_stop``), since nothing a tail
does needs finishing: a batch it has not acked is delivered again. Once it has
connected, a lost connection is retried with backoff until the server is back;
anything else ends the tail with its error, as does a server that cannot be
reached when it starts (like any other command).

Events need ticks. A role that may tick (pgque_admin) ticks the queue itself,
within the queue's thresholds; for one that may not (pgque_reader), a ticker or
a worker must run.

The tail knows nothing of terminals: it hands each event to ``show`` and each
note for its user (to stderr, in the CLI) to ``say``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import psycopg

from pgque.client import Client, Conn, open_connection
from pgque.display import describe_error, one_line
from pgque.errors import ConnectError, QueueNotFound
from pgque.info import QueueInfo
from pgque.lifecycle import STOP_LATENCY, CallWatch, Service, client_keepalives
from pgque.types import Message

__all__ = ["NO_TICKS_NOTE", "TAIL_MAX_EVENTS", "ConsumerLeftBehind", "Tail", "queue_info"]

TAIL_MAX_EVENTS = 500  # events per receive

NO_TICKS_NOTE = ("note: this role may not tick (pgque_admin may): events show up as a "
                 "running ticker or worker ticks them")

# How long removing the consumer may take before the tail says it is at it.
_REMOVING_NOTE_AFTER = 0.5

_log = logging.getLogger("pgque.tail")
# The tail speaks to its user through say(). Its log is for those who configure
# logging: without a handler Python would print its warnings on stderr.
_log.addHandler(logging.NullHandler())


class ConsumerLeftBehind(Exception):
    """The tail could not remove its consumer; the message says how to do it by hand."""


class _ConnectionLost(Exception):
    """The tail's session is gone, or the server is out of reach: reconnect."""


def queue_info(client: Client, queue: str) -> QueueInfo:
    """The info of one queue; QueueNotFound when there is none."""
    for info in client.queue_info(queue):
        return info
    raise QueueNotFound(f"queue {queue!r} does not exist")


def _tick_privileges(client: Client) -> tuple[bool, bool]:
    """Whether this role may call pgque.ticker(queue) and pgque.tick(queue):
    pgque_admin may, pgque_reader may not."""
    row = client.conn.execute(
        "select has_function_privilege('pgque.ticker(text)', 'execute'),"
        " has_function_privilege('pgque.tick(text)', 'execute')").fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1])


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class Tail(Service):
    """Follow ``queue``, handing each event (of ``key`` only, when given) to ``show``,
    until ``limit`` events were shown or a stop; see the module docstring.

    ``from_now`` skips the events that no tick has cut yet when the tail starts (a
    role that may not tick waits for the next tick instead). ``connect_timeout``
    bounds each connection attempt, and the removal of the consumer at the end;
    ``connect_kwargs`` go to psycopg.connect.
    """

    log = _log
    abandon_on_stop = True

    def __init__(self, dsn: str, queue: str, *, show: Callable[[Message[Any]], object],
                 say: Callable[[str], object], key: str | None = None,
                 limit: int | None = None, from_now: bool = False, poll_interval: float = 0.2,
                 consumer: str | None = None, connect_timeout: float = 5.0,
                 network_timeout: float = 30.0,
                 connect_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__("pgque-tail", connect_timeout=connect_timeout)
        self.dsn = dsn
        self.queue = queue
        self.consumer = consumer or f"tail-{os.getpid()}-{secrets.token_hex(3)}"
        self.key = key
        self.limit = limit
        self.from_now = from_now
        self.poll_interval = poll_interval
        self.network_timeout = network_timeout
        self.shown = 0  # events handed to show
        self._show = show
        self._say = say
        self._connect_kwargs = {"application_name": self.name,
                                **client_keepalives(network_timeout), **(connect_kwargs or {})}
        self._may_tick: bool | None = None  # asked on the first session
        self._may_force = False
        self._connected = False  # ever: until then an unreachable server is an error
        self._away = False  # from a lost connection to the next one
        self._subscribing = False  # from the subscribe call on, cleanup removes the consumer
        self._subscribed = False
        self._kept: Conn | None = None  # the last session, when intact: cleanup uses it
        self._batch_id: int | None = None
        self._printed: set[int] = set()  # events of the open batch already shown

    @property
    def following(self) -> bool:
        """Whether its consumer is subscribed: events sent from now on will show."""
        return self._subscribed

    # -- the service -----------------------------------------------------------

    def retryable(self, exc: Exception) -> bool:
        return isinstance(exc, _ConnectionLost)

    def serve(self) -> None:
        try:
            conn = self.connect(self.dsn, **self._connect_kwargs)
        except ConnectError as exc:
            if exc.transient and self._connected:
                self._lost(exc)
            raise
        self._connected = True
        if self._away:
            self._away = False
            self._say("reconnected")
        # A call unanswered for half the network timeout: a network no TCP
        # timeout sees; give the connection up (see Worker.serve).
        watch = self.watch(conn, self.network_timeout / 2)
        try:
            client = Client(conn)
            if not self._subscribed and not self._subscribe(client, watch):
                return  # stopped before subscribing
            self._follow(client, watch)
        except psycopg.OperationalError as exc:
            if not (watch.lost or conn.broken):
                raise
            self._lost(exc)
        finally:
            self.unwatch(watch)
            if watch.lost or conn.broken:
                conn.close()
            else:
                self._keep(conn)

    def cleanup(self) -> None:
        kept, self._kept = self._kept, None
        if not self._subscribing:
            if kept is not None:
                kept.close()
            return
        reason = self._unsubscribe(kept)
        if reason is None:
            return
        message = (f"could not remove the tail's consumer {self.consumer} ({reason}); it holds "
                   f"back rotation of {self.queue} until removed: select pgque.unsubscribe("
                   f"{_sql_literal(self.queue)}, {_sql_literal(self.consumer)})")
        if self.error is None:
            self.error = ConsumerLeftBehind(message)
        else:  # the error that ended the tail goes first; this is said on the way
            self._say(f"warning: {one_line(message)}")

    # -- following -------------------------------------------------------------

    @property
    def _done(self) -> bool:
        return self.limit is not None and self.shown >= self.limit

    def _subscribe(self, client: Client, watch: CallWatch) -> bool:
        """Subscribe the tail's consumer (after --from-now's wait); False when a stop
        came first."""
        if self._may_tick is None:
            with watch.call():
                self._may_tick, self._may_force = _tick_privileges(client)
        if self.from_now and not self._subscribing:
            if self._may_force:
                with watch.call():
                    client.tick(self.queue)  # the subscription starts at the newest tick
            elif not self._wait_for_next_tick(client, watch):
                return False
        # From here on, whatever happens, cleanup removes the consumer (removing
        # one that never came to be is harmless).
        self._subscribing = True
        with watch.call():
            client.subscribe(self.queue, self.consumer)
        self._subscribed = True
        self._say(f"tailing {self.queue} as consumer {self.consumer} (Ctrl-C to stop)")
        if not self._may_tick:
            self._say(NO_TICKS_NOTE)
        return True

    def _wait_for_next_tick(self, client: Client, watch: CallWatch) -> bool:
        """--from-now for a role that may not tick: wait until someone else's ticker
        has cut what was sent so far (at once when nothing was sent since the last
        tick). False when a stop came first."""
        with watch.call():
            first = queue_info(client, self.queue)
        if not first.events_since_last_tick:
            return True
        self._say(f"waiting for the next tick of {self.queue} (this role may not tick; "
                  "a ticker or a worker must run)")
        while True:
            with watch.call():
                if queue_info(client, self.queue).last_tick_id != first.last_tick_id:
                    return True
            if self.sleep(self.poll_interval):
                return False

    def _follow(self, client: Client, watch: CallWatch) -> None:
        """Receive, show and ack until the limit or a stop."""
        while not self.stopping:
            with watch.call():
                batch = client.receive(self.queue, self.consumer, max_events=TAIL_MAX_EVENTS)
            if batch is None:
                if not self._tick(client, watch):
                    self.sleep(self.poll_interval)
                continue
            if batch.batch_id != self._batch_id:
                self._batch_id, self._printed = batch.batch_id, set()
            for message in batch:
                if self._done:
                    break
                if message.id in self._printed:
                    continue  # shown before the connection was lost, and the batch not acked
                self._printed.add(message.id)
                if self.key is not None and message.partition_key != self.key:
                    continue
                self._show(message)
                self.shown += 1
            with watch.call():
                client.ack(batch)
            if self._done:
                self.request_stop()

    def _tick(self, client: Client, watch: CallWatch) -> bool:
        """Tick the queue if its thresholds ask for it and this role may; whether it did."""
        if not self._may_tick:
            return False
        try:
            with watch.call():
                return bool(client.ticker(self.queue))
        except psycopg.errors.InsufficientPrivilege:
            self._may_tick = False
            self._say(NO_TICKS_NOTE)
            return False

    def _lost(self, exc: Exception) -> NoReturn:
        """Say that the connection is lost (once an outage, and not when it is the stop
        that cut it), and raise what makes the Service reconnect."""
        if not self._away and not self.stopping:
            self._say(f"connection lost ({describe_error(exc)}); reconnecting")
        self._away = True
        raise _ConnectionLost(describe_error(exc)) from exc

    def _keep(self, conn: Conn) -> None:
        previous, self._kept = self._kept, conn
        if previous is not None:
            previous.close()

    # -- removing the consumer -------------------------------------------------

    def _unsubscribe(self, kept: Conn | None) -> str | None:
        """Remove the consumer; None when done (or gone with its queue), else why not.

        Waits at most connect_timeout (at least a second); a further signal ends
        the wait sooner, leaving the consumer.
        """
        outcome: list[BaseException | None] = []

        def remove() -> None:
            try:
                self._remove(kept)
            except QueueNotFound:
                outcome.append(None)  # dropped with its queue
            except BaseException as exc:
                outcome.append(exc)
            else:
                outcome.append(None)

        # A thread, so that a server that does not answer cannot hold the exit.
        remover = threading.Thread(target=remove, name=f"{self.name}-unsubscribe", daemon=True)
        remover.start()
        started = time.monotonic()
        deadline = started + max(self.connect_timeout, 1.0)
        signals = self.signals
        reason = "the server did not answer in time"
        noted = False
        while remover.is_alive() and (now := time.monotonic()) < deadline:
            if self.signals > signals:
                reason = "interrupted"
                break
            if not noted and now - started >= _REMOVING_NOTE_AFTER:
                noted = True
                again = " again" if signals else ""
                self._say(f"removing consumer {self.consumer} (Ctrl-C{again} to leave it)")
            remover.join(min(STOP_LATENCY, deadline - now))
        if outcome:
            failure = outcome[0]
            return None if failure is None else describe_error(failure)
        return reason

    def _remove(self, kept: Conn | None) -> None:
        """Unsubscribe on the kept session, or on a new one when that one fails."""
        if kept is not None:
            try:
                Client(kept).unsubscribe(self.queue, self.consumer)
                return
            except psycopg.Error:
                pass  # lost, or left mid-call by the stop: a new session
            finally:
                kept.close()
        with open_connection(self.dsn, timeout=self.connect_timeout,
                             **self._connect_kwargs) as conn:
            Client(conn).unsubscribe(self.queue, self.consumer)
