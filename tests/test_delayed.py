"""Delayed delivery: ``send(..., deliver_at=, deliver_after=)``.

A delayed event waits in pgque.delayed_event and enters the log, in its key's
order, when it falls due, as if sent then: every event of its key committed
before the tick that moves it comes first, every one sent after that tick
comes after it. It is never handed out before its time, a rolled-back send
leaves nothing, and the table it waits in is emptied by TRUNCATE, never by
DELETE. Bad input raises a specific error and writes nothing.

Time passes for real here, in fractions of a second; where a test needs an
event to fall due at a step of its own, it sets the event's due time to the
database clock's now, which is what the clock reaching it would do.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers import drain, scalar, sqlstate_of

import pgque

# With the Client and with the AsyncClient (tests/async_twin.py): the options of
# send and send_batch take the same path in both.
pytestmark = pytest.mark.both_clients


def received(client: pgque.Client, consumer: str = "c") -> list[tuple[int, str | None, Any]]:
    """(id its send returned, partition key, payload) of every event the consumer
    can receive now, in order; a delayed event's log id is checked to be new."""
    got = []
    for m in drain(client, "q", consumer):
        if m.delayed_id is not None:
            assert m.id > m.delayed_id  # entered the log under a new id
        got.append((m.delayed_id or m.id, m.partition_key, m.payload))
    return got


def make_due(conn: psycopg.Connection[Any], *ids: int) -> None:
    """The delayed events ids fall due now (the clock reaching their time), all at
    one time (so one tick moves them in send order)."""
    conn.execute("update pgque.delayed_event set de_due = statement_timestamp()"
                 " where ev_id = any(%s)", (list(ids),))


def waiting(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "select waiting from pgque._delayed_waiting(1)"))


def state(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """What a refused send must leave as it was: the log, the delayed events, the
    idempotency keys and the event sequence."""
    return (scalar(conn, "select count(*) from pgque.event_1"),
            scalar(conn, "select count(*) from pgque.delayed_event"),
            scalar(conn, "select count(*) from pgque.idempotency_key"),
            scalar(conn, "select last_value from pgque.event_1_id_seq"))


@pytest.fixture
def queue(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")


@pytest.mark.usefixtures("queue")
def test_a_delayed_event_enters_its_keys_order_when_due_and_never_before(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Key k: a, then d delayed 0.4 s, then b before d is due, then c after the
    tick that moved d. The consumer gets a and b at once, nothing of d while
    the database clock is before its time, then d, then c; another key's
    event sent meanwhile is not held back."""
    a = client.send("q", "e", "a", "k")
    d = client.send("q", "e", "d", "k", deliver_after=0.4)
    assert d.deliver_at is not None and not d.duplicate
    b = client.send("q", "e", "b", "k")
    other = client.send("q", "e", "o", "other")
    client.ticker()
    assert received(client) == [(a, "k", "a"), (b, "k", "b"), (other, "other", "o")]
    assert waiting(conn) == 1
    # Polled until it comes: the tick that moved it (written in the same
    # transaction as the moved row) is not before its time, and the polls made
    # before its time got nothing.
    early_polls = 0
    while not (got := received(client)):
        early = scalar(conn, "select clock_timestamp() < %s", (d.deliver_at,))
        client.ticker()
        early_polls += early
    assert got == [(d, "k", "d")]
    assert early_polls > 0
    assert moving_tick_time(conn, d) >= d.deliver_at
    c = client.send("q", "e", "c", "k")
    client.ticker()
    assert received(client) == [(c, "k", "c")]
    assert waiting(conn) == 0


def moving_tick_time(conn: psycopg.Connection[Any], event_id: int) -> Any:
    """The time of the tick that moved a delayed event into the log: the tick
    row its transaction wrote with the event's row."""
    return scalar(conn, "select t.tick_time from pgque.tick t where t.xmin ="
                        " (select e.xmin from pgque.event_1 e where e.ev_delayed_id = %s)",
                  (event_id,))


@pytest.mark.usefixtures("queue")
def test_a_batch_over_several_ticks_keeps_the_order_events_entered_the_log(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A consumer whose batch spans the tick that moved a delayed event gets, in
    id order, the event of its key sent before it fell due (though sent after
    it), then it, then one sent after the move: the moved event's new id says
    when it entered the log."""
    d = client.send("q", "e", "d", "k", deliver_after=3600)
    b = client.send("q", "e", "b", "k")
    make_due(conn, d)
    client.tick("q")  # b's tick; moves d
    c = client.send("q", "e", "c", "k")
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    assert [(m.delayed_id or m.id, m.payload) for m in batch] == [(b, "b"), (d, "d"), (c, "c")]
    assert [m.delayed_id for m in batch] == [None, d, None]
    assert client.ack(batch)


@pytest.mark.usefixtures("queue")
def test_a_due_time_in_the_past_sends_at_once(client: pgque.Client,
                                             conn: psycopg.Connection[Any]) -> None:
    past = datetime.now(timezone.utc) - timedelta(hours=1)
    sent = client.send("q", "e", 1, "k", deliver_at=past)
    now = client.send("q", "e", 2, "k", deliver_after=0)
    assert sent.deliver_at is None and now.deliver_at is None
    assert scalar(conn, "select count(*) from pgque.delayed_event") == 0
    client.tick("q")
    assert [i for i, _k, _p in received(client)] == [sent, now]


@pytest.mark.usefixtures("queue")
def test_a_rolled_back_delayed_send_leaves_nothing(client: pgque.Client,
                                                   conn: psycopg.Connection[Any],
                                                   dsn: str) -> None:
    """Rolled back: no row. Committed in another session: moved by this one's tick."""
    with psycopg.connect(dsn) as producer:
        with pgque.Client(producer) as p:
            p.send("q", "e", "gone", "k", deliver_after=3600)
        producer.rollback()
        assert scalar(conn, "select count(*) from pgque.delayed_event") == 0
        with pgque.Client(producer) as p:
            kept = p.send("q", "e", "kept", "k", deliver_after=3600)
        assert scalar(conn, "select count(*) from pgque.delayed_event") == 0  # not committed
        producer.commit()
    make_due(conn, kept)
    client.ticker()
    client.ticker()
    assert received(client) == [(kept, "k", "kept")]


@pytest.mark.usefixtures("queue")
def test_send_batch_delays_per_event_and_per_call(client: pgque.Client,
                                                  conn: psycopg.Connection[Any]) -> None:
    """Per call, every event without its own; per event, its own; ids in order."""
    ids = client.send_batch("q", [pgque.Event("e", 1, "k"),
                                  pgque.Event("e", 2, "k", deliver_after=timedelta(0)),
                                  ("e", 3, "k")], deliver_after=3600)
    assert ids == sorted(ids)
    assert [i.deliver_at is not None for i in ids] == [True, False, True]
    client.tick("q")
    assert [i for i, _k, _p in received(client)] == [ids[1]]
    make_due(conn, ids[0], ids[2])
    client.tick("q")
    client.tick("q")
    assert [i for i, _k, _p in received(client)] == [ids[0], ids[2]]


@pytest.mark.usefixtures("queue")
def test_bad_delays_raise_and_write_nothing(client: pgque.Client,
                                           conn: psycopg.Connection[Any]) -> None:
    client.send("q", "e", 1, deliver_after=60)
    before = state(conn)
    soon = datetime.now(timezone.utc) + timedelta(minutes=1)
    with pytest.raises(pgque.InvalidDelay, match="more than 30 days"):
        client.send("q", "e", 1, deliver_after=timedelta(days=30, minutes=1))
    with pytest.raises(pgque.InvalidDelay, match="negative"):
        client.send("q", "e", 1, deliver_after=-1)
    with pytest.raises(pgque.InvalidDelay, match="no time zone"):
        client.send("q", "e", 1, deliver_at=datetime.now() + timedelta(minutes=1))
    with pytest.raises(pgque.InvalidArgument, match="not both"):
        client.send_batch("q", [("e", 1)], deliver_at=soon, deliver_after=1)
    with pytest.raises(pgque.InvalidArgument, match="both deliver_at and deliver_after"):
        client.send_batch("q", [pgque.Event("e", 1, deliver_at=soon, deliver_after=1)])
    with pytest.raises(pgque.InvalidDelay):  # one bad event: none of the batch
        client.send_batch("q", [("e", 1), pgque.Event("e", 2, deliver_after=40 * 86400)],
                          deliver_after=1)
    assert sqlstate_of(lambda: conn.execute(
        "select pgque.send_with('q', 'e', '1', p_deliver_at => 'infinity')")) == "PQ031"
    assert state(conn) == before
    longest = client.send("q", "e", 1, deliver_after=timedelta(days=30) - timedelta(seconds=5))
    assert longest.deliver_at is not None


@pytest.mark.usefixtures("queue")
def test_the_delayed_table_is_emptied_by_truncate_keeping_what_waits(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Rotations due at every pass: moved rows go with their partition, rows
    still waiting are copied first and moved later, once each; no row of the
    table is updated or deleted but by the test's own make_due."""
    conn.execute("update pgque.rotation set rt_period = '0' where rt_name = 'delayed'")
    far = client.send_batch("q", [("e", i, f"k{i % 3}") for i in range(6)], deliver_after=3600)
    near = client.send_batch("q", [("e", i, f"k{i % 3}") for i in range(6, 12)],
                             deliver_after=3600)
    make_due(conn, *near)
    client.tick("q")
    conn.execute("select pg_stat_force_next_flush()")
    writes = ("select n_tup_upd + n_tup_del from pg_stat_user_tables"
              " where relname ~ '^delayed_event'")
    before = sum(r[0] for r in conn.execute(writes))
    got = [i for i, _k, _p in received(client)]
    # The first pass switches the writes to the empty partition; the second
    # finds 6 moved and 6 waiting in the other: worth it, the waiting ones are
    # copied, that partition emptied.
    for _ in range(2):
        assert "rotate_delayed" in [s for _q, s, _n in client.maintenance()]
    assert scalar(conn, "select count(*) from pgque.delayed_event") == 6
    assert waiting(conn) == 6
    client.tick("q")
    got += [i for i, _k, _p in received(client)]
    make_due(conn, *far)
    client.tick("q")
    client.tick("q")
    got += [i for i, _k, _p in received(client)]
    assert got == near + far
    for _ in range(3):
        client.maintenance()
    client.tick("q")
    assert received(client) == []
    assert scalar(conn, "select count(*) from pgque.delayed_event") == 0
    conn.execute("select pg_stat_force_next_flush()")
    assert sum(r[0] for r in conn.execute(writes)) == before + len(far)  # make_due's own


@pytest.mark.usefixtures("queue")
def test_status_shows_delayed_events_waiting(client: pgque.Client,
                                             conn: psycopg.Connection[Any]) -> None:
    first = client.send("q", "e", 1, deliver_after=600)
    client.send("q", "e", 2, deliver_after=1200)
    info = {q.queue_name: q for q in client.queue_info()}["q"]
    assert info.delayed_events == 2
    assert info.next_delivery == first.deliver_at
    make_due(conn, first)
    client.tick("q")
    info = {q.queue_name: q for q in client.queue_info()}["q"]
    assert info.delayed_events == 1
    # Durable from the commit: the tables are WAL-logged, as the log's are.
    persistence = conn.execute("select distinct relpersistence from pg_class"
                               " where relname ~ '^(delayed_event|idempotency_key)'").fetchall()
    assert persistence == [("p",)]


@pytest.mark.usefixtures("queue")
def test_maintenance_outside_read_committed_is_refused(client: pgque.Client,
                                                      conn: psycopg.Connection[Any],
                                                      dsn: str) -> None:
    """Its rotations copy what a snapshot shows, then TRUNCATE: in REPEATABLE READ
    an older snapshot would copy less than was committed (a delayed event sent
    meanwhile lost). PQ008, as for a tick; nothing rotated."""
    conn.execute("update pgque.rotation set rt_period = '0' where rt_name = 'delayed'")
    client.send("q", "e", 1, deliver_after=3600)
    client.maintenance()  # the switch: the next pass would empty what it left
    with psycopg.connect(dsn) as rr:
        rr.execute("set transaction isolation level repeatable read")
        with pytest.raises(psycopg.Error) as refused:
            rr.execute("select * from pgque.maint()")
        assert refused.value.sqlstate == "PQ008"
    assert waiting(conn) == 1


def test_delay_arrays_of_another_shape_are_refused(client: pgque.Client,
                                                  conn: psycopg.Connection[Any]) -> None:
    """A delay array read by index must be one-dimensional from 1: a two-dimensional
    or [0:1] array is 22023, not a delay dropped or moved to another event."""
    client.create_queue("q")
    before = state(conn)
    for deliver_afters in ("{{1 hour},{1 hour}}", '[0:1]={"1 hour","1 hour"}'):
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("select * from pgque.send_batch_with('q', array['a', 'b'],"
                         " array['{}', '{}'], null, null, %s::interval[])", (deliver_afters,))
        assert refused.value.sqlstate == "22023"
    with pytest.raises(psycopg.Error) as refused:
        conn.execute("select * from pgque.send_batch_with('q', array['a', 'b'], array['{}', '{}'],"
                     " null, '[0:1]={NULL,\"2100-01-01\"}'::timestamptz[])")
    assert refused.value.sqlstate == "22023"
    for huge in ("1000000 years", "31 days"):
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("select pgque.send_with('q', 'e', '{}', p_deliver_after => %s::interval)",
                         (huge,))
        assert refused.value.sqlstate == "PQ031"
    for bad in (float("nan"), float("inf"), 1e30):
        with pytest.raises(pgque.InvalidDelay):
            client.send("q", "e", 1, deliver_after=bad)
    assert state(conn) == before


@pytest.mark.usefixtures("queue")
def test_a_retried_delayed_event_keeps_its_delayed_id(client: pgque.Client,
                                                     conn: psycopg.Connection[Any]) -> None:
    d = client.send("q", "e", "d", "k", deliver_after=3600)
    make_due(conn, d)
    client.tick("q")
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and [m.delayed_id for m in batch] == [d]
    client.ack(batch, nack=list(batch))
    client.maintenance()  # the retry, due at once, back into the log
    client.tick("q")
    again = client.receive("q", "c")
    assert again is not None
    assert [(m.delayed_id, m.retry_count) for m in again] == [(d, 1)]
    client.ack(again)


def test_an_idle_queue_does_not_read_another_queues_delayed_events(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """The ticker asks every queue every poll whether a delayed event is due: with
    20,000 waiting in one queue, the other's answer is index probes, no scan."""
    client.create_queue("busy")
    client.create_queue("idle")
    for _ in range(20):
        client.send_batch("busy", [("e", None)] * 1_000, deliver_after=3600)
    conn.execute("analyze pgque.delayed_event")
    # The partition that holds them (the other, empty, is scanned: nothing to read).
    scans = ("select seq_scan, idx_scan from pg_stat_user_tables where relname ="
             " (select 'delayed_event_' || rt_part from pgque.rotation where rt_name = 'delayed')")
    conn.execute("select pg_stat_force_next_flush()")
    seq_before, idx_before = conn.execute(scans).fetchone()  # type: ignore[misc]
    for _ in range(20):  # past the plan cache's five custom plans: the generic one too
        assert not scalar(conn, "select pgque._delayed_due(q.queue_id,"
                                " pgque._last_tick(q.queue_id), clock_timestamp())"
                                " from pgque.queue q where queue_name = 'idle'")
    conn.execute("select pg_stat_force_next_flush()")
    seq_after, idx_after = conn.execute(scans).fetchone()  # type: ignore[misc]
    assert seq_after == seq_before
    assert idx_after > idx_before


@pytest.mark.usefixtures("queue")
def test_events_one_tick_moves_enter_by_due_time(client: pgque.Client,
                                                conn: psycopg.Connection[Any]) -> None:
    """Sent d1 then d2, d2 due first: as if each were sent when due, d2 comes first;
    with one due time, send order."""
    d1 = client.send("q", "e", "d1", "k", deliver_after=7200)
    d2 = client.send("q", "e", "d2", "k", deliver_after=3600)
    d3 = client.send("q", "e", "d3", "k", deliver_after=3600)
    conn.execute("update pgque.delayed_event set de_due = clock_timestamp()"
                 " - case ev_id when %s then interval '1 second' else interval '2 seconds' end",
                 (d1,))
    client.tick("q")
    client.tick("q")
    assert [i for i, _k, _p in received(client)] == [d2, d3, d1]


def test_a_groups_slots_get_delayed_events_in_key_order_with_their_delayed_id(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Through receive_partitioned and receive_slots (whose rows lead with the slot),
    and through the pause policy's held events: a delayed event comes to its key's
    slot after the key's events sent before it fell due, with delayed_id."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    client.set_failure_policy("q", "g", "pause")
    for slot in range(2):
        assert client.claim_slot("q", "g", slot)
    keys = {int(scalar(conn, "select pgque.slot_of(%s, 2)", (k,))): k
            for k in ("a", "b", "c", "d", "e", "f")}
    k0, k1 = keys[0], keys[1]
    d0 = client.send("q", "e", "d0", k0, deliver_after=3600)
    d1 = client.send("q", "e", "d1", k1, deliver_after=3600)
    client.send("q", "e", "b0", k0)
    make_due(conn, d0, d1)
    client.tick("q")  # b0's tick; moves d0 and d1
    client.tick("q")
    piece = client.receive_partitioned("q", "g", slot=0, slots=2)
    assert piece is not None
    assert [(m.payload, m.delayed_id) for m in piece] == [("b0", None), ("d0", d0)]
    (other,) = client.receive_slots("q", "g", slots=2, owned=[1])
    assert [(m.payload, m.delayed_id) for m in other] == [("d1", d1)]
    # d0 fails under pause: held, and handed out again as itself.
    client.ack(piece, nack=[piece.messages[1]])
    client.ack(other)
    again = client.receive_partitioned("q", "g", slot=0, slots=2)
    assert again is not None
    assert [(m.payload, m.delayed_id, m.retry_count) for m in again] == [("d0", d0, 1)]
    client.ack(again)
