"""Property: delayed, keyed and idempotent sends, with producers and consumers
crashing anywhere, deliver every committed event once, in the order it entered
the log.

A run is a sequence of steps: sends (each with or without a partition key, a
delay and an idempotency key, committed or lost with its producer's
connection), delayed events made due (their time set to the database clock's
now, as the clock reaching them would), ticks, a consumer's receives, some of
which crash before the ack, and maintenance passes (the delayed events'
rotation due at each, copying the rows still waiting). The model is the log's
promise: an event sent at once enters at its commit; a delayed one at the
first tick that has passed its time, after everything committed before that
tick; a key sent before (committed) makes a send a duplicate that writes
nothing. One consumer reads the whole log, so what it gets first must be the
model's order exactly, which orders each key's events as a consequence.
"""

from __future__ import annotations

from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

KEYS = [None, "a", "b"]
IDEMPOTENCY_KEYS = [None, None, "x", "y", "z"]


@st.composite
def send_runs(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    steps: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["send", "send", "send", "due", "tick", "consume",
                                     "maintenance"]))
        if kind == "send":
            steps.append(("send", draw(st.sampled_from(KEYS)), draw(st.booleans()),
                          draw(st.sampled_from(IDEMPOTENCY_KEYS)),
                          draw(st.sampled_from(["commit", "commit", "crash"]))))
        elif kind == "due":
            steps.append(("due", draw(st.integers(0, 5))))
        elif kind == "consume":
            steps.append(("consume", draw(st.booleans())))
        else:
            steps.append((kind,))
    return steps


class Model:
    """What the log must hold: the order events entered it, the delayed events
    still waiting (in send order, with whether they were made due), and the
    idempotency keys committed (with the id their first send returned)."""

    def __init__(self) -> None:
        self.entered: list[int] = []
        # Waiting, in send order: (n, when made due: a step number, or None).
        self.waiting: list[tuple[int, int | None]] = []
        self.keys: dict[str, int] = {}

    def sent(self, n: int, delayed: bool) -> None:
        if delayed:
            self.waiting.append((n, None))
        else:
            self.entered.append(n)

    def ticked(self) -> None:
        """The tick moves, after what is committed, the delayed events made due,
        by due time (then in send order)."""
        due = [(when, i, n) for i, (n, when) in enumerate(self.waiting) if when is not None]
        self.entered += [n for _when, _i, n in sorted(due)]
        self.waiting = [(n, when) for n, when in self.waiting if when is None]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=send_runs())
def test_every_committed_event_is_delivered_once_in_the_order_it_entered_the_log(
        dsn: str, run: list[tuple[Any, ...]]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pgque.drop_queue('q', true) from pgque.queue where queue_name = 'q'")
        client = pgque.Client(conn)
        client.create_queue("q")
        client.subscribe("q", "c")
        conn.execute("update pgque.rotation set rt_period = '0' where rt_name = 'delayed'")
        model = Model()
        ids: dict[int, int] = {}  # the model's n: the id its send returned
        delayed: set[int] = set()  # the n sent delayed
        delivered: list[int] = []  # n, in the order first received
        seen: set[int] = set()  # log ids received
        counter = 0
        due_steps = 0  # orders the due times the steps give

        def consume(crash: bool) -> bool:
            with psycopg.connect(dsn, autocommit=True) as consumer_conn:
                consumer = pgque.Client(consumer_conn)
                batch = consumer.receive("q", "c")
                if batch is None:
                    return False
                for m in batch:
                    if m.id not in seen:
                        seen.add(m.id)
                        delivered.append(m.payload)
                    # A delayed event carries the id its send returned.
                    assert m.delayed_id == (ids[m.payload] if m.payload in delayed else None)
                if not crash:
                    assert consumer.ack(batch)
                # A crash: the connection ends with the batch open; it comes again.
                return True

        for step in run:
            if step[0] == "send":
                _, key, delayed_send, idempotency_key, outcome = step
                counter += 1
                producer_conn = psycopg.connect(dsn)
                try:
                    sent = pgque.Client(producer_conn).send(
                        "q", "e", counter, key,
                        deliver_after=3600 if delayed_send else None,
                        idempotency_key=idempotency_key)
                    if outcome == "commit":
                        producer_conn.commit()
                finally:
                    producer_conn.close()  # a crash: the transaction is lost with it
                if outcome != "commit":
                    continue
                first = model.keys.get(idempotency_key) if idempotency_key else None
                if first is not None:
                    assert sent.duplicate and int(sent) == first
                    continue
                assert not sent.duplicate
                assert (sent.deliver_at is not None) == delayed_send
                ids[counter] = int(sent)
                if delayed_send:
                    delayed.add(counter)
                if idempotency_key:
                    model.keys[idempotency_key] = int(sent)
                model.sent(counter, delayed_send)
            elif step[0] == "due":
                pending = [i for i, (_n, when) in enumerate(model.waiting) if when is None]
                if pending:
                    i = pending[step[1] % len(pending)]
                    n, _ = model.waiting[i]
                    conn.execute("update pgque.delayed_event set de_due = clock_timestamp()"
                                 " where ev_id = %s", (ids[n],))
                    due_steps += 1
                    model.waiting[i] = (n, due_steps)  # later steps: later due times
            elif step[0] == "tick":
                client.tick("q")
                model.ticked()
            elif step[0] == "maintenance":
                client.maintenance()  # the delayed events' rotation, due at every pass
            else:
                consume(step[1])
        # Time passes for everything left (one due time: by send order); two
        # ticks: one moves them, one hands them out.
        conn.execute("update pgque.delayed_event set de_due = statement_timestamp()"
                     " where de_due > clock_timestamp()")
        model.waiting = [(n, when if when is not None else due_steps + 1)
                         for n, when in model.waiting]
        client.tick("q")
        model.ticked()
        client.tick("q")
        while consume(False):
            pass
        assert delivered == model.entered
