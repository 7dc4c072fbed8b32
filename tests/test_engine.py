"""The log engine end to end: send, tick, receive, ack, fan-out, pieces, the receive lock."""

from __future__ import annotations

import itertools
import re
import threading
from typing import Any

import psycopg
import pytest
from helpers import drain, scalar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)

_example = itertools.count()  # unique queue names across hypothesis examples


def test_send_receive_ack_roundtrip(client: pgque.Client) -> None:
    client.create_queue("orders")
    client.subscribe("orders", "billing")
    first = client.send("orders", "OrderCreated", {"id": 1, "total": 9.5}, partition_key="tenant-1")
    ids = client.send_batch("orders", [pgque.Event("OrderPaid", {"id": 1}, "tenant-1"),
                                       ("OrderShipped", [1, 2]), ("Note", "text", "t2")])
    assert ids == [first + 1, first + 2, first + 3]

    client.tick("orders")
    batch = client.receive("orders", "billing")
    assert batch is not None
    assert [m.id for m in batch] == [first, *ids]
    assert [m.type for m in batch] == ["OrderCreated", "OrderPaid", "OrderShipped", "Note"]
    assert [m.payload for m in batch] == [{"id": 1, "total": 9.5}, {"id": 1}, [1, 2], "text"]
    assert [m.partition_key for m in batch] == ["tenant-1", "tenant-1", None, "t2"]
    assert all(m.retry_count == 0 for m in batch)
    assert client.ack(batch) is True
    # Nothing new: no batch. A tick with nothing in it is consumed inside
    # receive, with no batch handed out to be acked.
    assert client.receive("orders", "billing") is None
    last = client.tick("orders")
    assert client.receive("orders", "billing") is None
    assert client.consumer_info("orders")[0].last_tick_id == last
    # A Batch is truthy even when it holds no messages (a piece may be empty):
    # `while batch := client.receive(...)` must never skip acking one.
    assert pgque.Batch("orders", "billing", 1)


def test_payload_type_decodes_into_struct(client: pgque.Client) -> None:
    import msgspec

    class FileCreated(msgspec.Struct):
        path: str
        size: int

    client.create_queue("files")
    client.subscribe("files", "indexer")
    client.send("files", "FileCreated", FileCreated("/a", 3))
    client.send("files", "FileCreated", {"path": "/b"})  # missing size
    client.tick("files")
    batch = client.receive("files", "indexer", payload_type=FileCreated)
    assert batch is not None
    assert batch.messages[0].payload == FileCreated("/a", 3)
    with pytest.raises(pgque.PayloadError):
        _ = batch.messages[1].payload


def test_event_exists_only_if_callers_transaction_commits(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    with psycopg.connect(dsn) as conn:  # not autocommit: the caller's transaction
        kept = client.send("q", "kept", 1, conn=conn)
        conn.commit()
        client.send("q", "dropped", 2, conn=conn)
        client.send_batch("q", [("dropped", 3)], conn=conn)
        conn.rollback()
    assert [m.id for m in drain(client, "q", "c")] == [kept]


def test_fan_out_each_consumer_sees_every_event(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "a")
    client.subscribe("q", "b")
    ids = client.send_batch("q", [("e", i) for i in range(50)])
    got_a = drain(client, "q", "a")
    got_b = drain(client, "q", "b")
    assert [m.id for m in got_a] == ids
    assert [m.id for m in got_b] == ids


def test_late_subscriber_starts_at_current_tick(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "early")
    client.send("q", "before", 1)
    client.tick("q")
    assert client.subscribe("q", "late") is True
    assert client.subscribe("q", "late") is False  # idempotent
    after = client.send("q", "after", 2)
    assert [m.id for m in drain(client, "q", "late")] == [after]
    assert len(drain(client, "q", "early")) == 2


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       max_events=st.one_of(st.none(), st.integers(1, 15)))
def test_pieces_never_lose_events(client: pgque.Client, sizes: list[int],
                                  max_events: int | None) -> None:
    """Receiving with max_events hands a batch out in pieces; acking a piece never
    drops the rest of the batch (a known bug of the PgQ family)."""
    queue = f"pieces{next(_example)}"
    client.create_queue(queue)
    client.subscribe(queue, "c")
    sent: list[int] = []
    for size in sizes:
        sent += client.send_batch(queue, [("e", i) for i in range(size)])
        client.tick(queue)
    got = drain(client, queue, "c", max_events=max_events, tick=False)
    assert [m.id for m in got] == sent


def test_receive_again_before_ack_returns_same_piece(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    ids = client.send_batch("q", [("e", i) for i in range(5)])
    client.tick("q")
    first = client.receive("q", "c", max_events=2)
    again = client.receive("q", "c", max_events=2)
    assert first is not None and again is not None
    assert first.batch_id == again.batch_id
    assert [m.id for m in again] == ids[:2]
    assert client.ack(again) is False  # more remains
    rest = client.receive("q", "c", max_events=10)
    assert rest is not None and [m.id for m in rest] == ids[2:]
    assert client.ack(rest) is True


def test_concurrent_receive_blocks_then_gets_same_batch(client: pgque.Client, dsn: str) -> None:
    """The receive lock: a second receive on the same subscription waits for the
    first one's transaction and then gets the same open batch, never another."""
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send_batch("q", [("e", i) for i in range(3)])
    client.tick("q")
    client.send("q", "later", 0)
    client.tick("q")  # a second batch is ready too

    holder = psycopg.connect(dsn)  # in a transaction: holds the lock until commit
    waiter = pgque.connect(dsn)
    try:
        first = pgque.Client(holder).receive("q", "c")
        assert first is not None
        result: dict[str, Any] = {}
        started = threading.Event()

        def second_receive() -> None:
            started.set()
            result["batch"] = waiter.receive("q", "c")

        thread = threading.Thread(target=second_receive)
        thread.start()
        started.wait()
        # The waiter is blocked on the subscription row lock: observe it in pg_locks.
        waiter_pid = waiter.conn.info.backend_pid
        observer = psycopg.connect(dsn, autocommit=True)
        deadline = 100
        while deadline and not scalar(
                observer, "select count(*) > 0 from pg_stat_activity "
                          "where pid = %s and wait_event_type = 'Lock'", (waiter_pid,)):
            threading.Event().wait(0.05)
            deadline -= 1
        assert deadline, "second receive never blocked on the receive lock"
        assert thread.is_alive()
        holder.commit()
        thread.join(10)
        assert not thread.is_alive()
        assert result["batch"].batch_id == first.batch_id
        assert [m.id for m in result["batch"]] == [m.id for m in first]
        observer.close()
    finally:
        holder.close()
        waiter.close()


def test_ticker_thresholds(client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q", ticker_max_count=3, ticker_max_lag=3600, ticker_idle_period=3600)
    last = scalar(conn, "select last_tick_id from pgque.queue_info where queue_name = 'q'")
    assert client.ticker() == 0  # nothing pending, not idle long enough
    client.send_batch("q", [("e", 1), ("e", 2)])
    assert client.ticker() == 0  # 2 < max_count, lag not reached
    client.send("q", "e", 3)
    assert client.ticker() == 1  # max_count reached
    assert scalar(conn, "select last_tick_id from pgque.queue_info where queue_name = 'q'") > last
    client.set_queue_config("q", ticker_max_lag=0)
    client.send("q", "e", 4)
    assert client.ticker() == 1  # pending and lag 0 passed


def test_tick_refuses_repeatable_read(client: pgque.Client, dsn: str) -> None:
    """A tick's snapshot must postdate the previous tick; a REPEATABLE READ
    transaction's snapshot may not, so ticking there is refused."""
    client.create_queue("q")
    with psycopg.connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(pgque.NotReadCommitted):
            pgque.Client(conn).tick("q")


def test_ticker_sees_events_of_a_transaction_open_during_the_last_tick(
        client: pgque.Client, dsn: str) -> None:
    """An event whose ev_id was taken before a tick but whose transaction committed
    after it is not covered by that tick; the ticker must still see it as pending
    (counting by sequence alone would strand it until the idle tick)."""
    client.create_queue("q", ticker_max_lag=0, ticker_idle_period=3600)
    client.subscribe("q", "c")
    with psycopg.connect(dsn) as producer:
        late = client.send("q", "late", 1, conn=producer)  # ev_id taken, not committed
        client.tick("q")  # covers nothing: the producer is still in progress
        assert client.ticker() == 0  # nothing new has committed yet
        producer.commit()
    assert client.ticker() == 1, "the committed late event was not seen as pending"
    assert [m.id for m in drain(client, "q", "c", tick=False)] == [late]
    assert client.ticker() == 0  # and once covered, it is not pending any more


def last_tick_state(conn: psycopg.Connection[Any], queue: str) -> tuple[bool, bool]:
    """The queue's newest tick: (settled, has a settle bound)."""
    row = conn.execute("select t.tick_settled, t.tick_settle_xid is not null from pgque.tick t"
                       " join pgque.queue q on q.queue_id = t.tick_queue"
                       " where q.queue_name = %s order by t.tick_id desc limit 1",
                       (queue,)).fetchone()
    assert row is not None
    return row[0], row[1]


def event_table_reads(conn: psycopg.Connection[Any], queue: str) -> int:
    """The scans of the queue's event tables by this session: in the open
    transaction, and maybe before it (the counts since the session last sent its
    statistics): compare two taken in one transaction."""
    return int(scalar(conn, "select coalesce(sum(coalesce(s.idx_scan, 0) + s.seq_scan), 0)"
                            " from pg_stat_xact_user_tables s"
                            " join pgque.queue q"
                            "   on s.relname like 'event\\_' || q.queue_id || '\\_%%'"
                            " where s.schemaname = 'pgque' and q.queue_name = %s", (queue,)))


def test_a_settled_tick_is_never_probed_again_and_an_open_writer_keeps_it_unsettled(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """The poll probes an idle queue's event tables for late commits only while its
    last tick may have missed one: a tick made with no transaction running below
    its own id is settled at once (and a new queue's first tick: nothing can have
    been sent into it); one made while a writer is open (any
    transaction with an id) is probed at each poll, and settled by the first poll
    after the writer has ended; from then on a poll reads none of its tables."""
    client.create_queue("q", ticker_max_lag=0, ticker_idle_period=3600)
    assert last_tick_state(conn, "q") == (True, False)  # a new queue's: nothing sent yet
    client.subscribe("q", "c")
    client.tick("q")
    assert last_tick_state(conn, "q") == (True, True)
    with psycopg.connect(dsn) as writer:
        scalar(writer, "select pg_current_xact_id()")  # a transaction id, running
        client.tick("q")
        assert last_tick_state(conn, "q") == (False, True)
        with conn.transaction():
            reads = event_table_reads(conn, "q")
            assert scalar(conn, "select pgque.ticker()") == 0
            assert event_table_reads(conn, "q") > reads  # probed
        assert last_tick_state(conn, "q") == (False, True)  # the writer may still send
    assert client.ticker() == 0  # the writer is gone: probed once more, and settled
    assert last_tick_state(conn, "q") == (True, True)
    with conn.transaction():
        reads = event_table_reads(conn, "q")
        for _ in range(3):
            assert scalar(conn, "select pgque.ticker()") == 0
        assert event_table_reads(conn, "q") == reads
    late = client.send("q", "e", 2)
    assert client.ticker() == 1
    assert [m.id for m in drain(client, "q", "c", tick=False)] == [late]


def test_only_a_read_committed_poll_settles_a_tick(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A poll in REPEATABLE READ looks with its transaction's snapshot, which may
    be older than a rotation that copied the delayed events and truncated their
    table: it would find no late event where there is one and settle the tick
    for good. Only a READ COMMITTED poll settles."""
    client.create_queue("q", ticker_max_lag=0, ticker_idle_period=3600)
    client.subscribe("q", "c")
    with psycopg.connect(dsn) as writer:
        scalar(writer, "select pg_current_xact_id()")
        client.tick("q")
    assert last_tick_state(conn, "q") == (False, True)
    with psycopg.connect(dsn) as repeatable:
        repeatable.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        assert scalar(repeatable, "select pgque.ticker()") == 0
        repeatable.commit()
    assert last_tick_state(conn, "q") == (False, True)
    assert client.ticker() == 0
    assert last_tick_state(conn, "q") == (True, True)


def test_a_tick_made_after_its_transaction_wrote_is_probed_until_the_next_tick(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A tick made in a transaction that already has an id cannot bound the
    transactions it may miss: it gets no settle bound, stays unsettled, and the
    poll still finds the event of a producer open during it once that commits."""
    client.create_queue("q", ticker_max_lag=0, ticker_idle_period=3600)
    client.subscribe("q", "c")
    with psycopg.connect(dsn) as producer, psycopg.connect(dsn) as ticking:
        late = client.send("q", "late", 1, conn=producer)  # ev_id taken, not committed
        scalar(ticking, "select pg_current_xact_id()")  # this transaction has an id
        scalar(ticking, "select pgque.tick('q')")
        ticking.commit()
        assert last_tick_state(conn, "q") == (False, False)
        assert client.ticker() == 0
        producer.commit()
    assert client.ticker() == 1, "the committed late event was not seen as pending"
    assert [m.id for m in drain(client, "q", "c", tick=False)] == [late]


def test_every_sender_takes_its_transaction_id_before_its_event_id(
        conn: psycopg.Connection[Any]) -> None:
    """A tick's settle bound holds only if every transaction that takes an event
    id had its transaction id already (log/tick.sql, "Settled ticks"): the race
    it guards against cannot be made on purpose, so the rule is checked where it
    is kept, in the source of every function that takes an event id (nextval of
    a queue's sequence, or the event writer's default): before its first, the
    function assigns its id (pg_current_xact_id()) or has written a row."""
    takes_id = re.compile(r"nextval\((v_queue|p_queue)\.queue_event_seq|_write_event\(")
    writes = re.compile(r"pg_current_xact_id\(\)|insert into|delete from", re.IGNORECASE)
    checked = []
    for name, source in conn.execute(
            "select p.proname, p.prosrc from pg_proc p"
            " where p.pronamespace = 'pgque'::regnamespace").fetchall():
        first = takes_id.search(source)
        if first is None:
            continue
        checked.append(name)
        assert writes.search(source[:first.start()]), \
            f"pgque.{name} takes an event id before it has a transaction id"
    assert {"send", "send_batch", "send_with", "_send_events", "_maint_retry",
            "replay_dead_letter"} <= set(checked), checked


def test_the_tickers_poll_does_not_wait_for_a_queue_being_dropped(
        client: pgque.Client, dsn: str) -> None:
    """The poll's one look at a chunk reads every queue's sequence; a drop_queue in
    progress holds one exclusively. The poll must neither wait for it nor fail:
    it looks at each queue by itself, and ticks the others."""
    client.create_queue("doomed")
    client.create_queue("q", ticker_max_lag=0)
    client.tick("q")
    client.send("q", "e", 1)
    with psycopg.connect(dsn) as dropper:
        pgque.Client(dropper).drop_queue("doomed")  # uncommitted: its sequence held
        other = pgque.connect(dsn, pool_size=0)
        try:
            # Waiting for the drop would last until the statement timeout, which
            # no handler catches (a lock timeout is caught by the fallback, so it
            # would not show a wait).
            other.conn.execute("set lock_timeout = 0")
            other.conn.execute("set statement_timeout = '20s'")
            assert other.ticker() == 1
        finally:
            other.close()
        dropper.rollback()


def test_the_tickers_probe_for_late_commits_never_reads_a_whole_event_table(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """An idle queue's ticker polls probe for events committed after the last tick
    below its position (_uncovered_events, through the batch reader's static
    statement). Once its plan is generic (after five calls in a session), it must
    still read the ev_txid index from the tick's xmax, never a whole event table:
    a generic plan of "ev_txid >= $1" did, at every poll, and a busy queue's
    server CPU grew with its table."""
    client.create_queue("q")
    client.subscribe("q", "c")
    for n in range(10):
        client.send_batch("q", [("e", i, f"k{i}") for i in range(n * 500, n * 500 + 500)])
    client.tick("q")
    qid, snap = conn.execute("select t.tick_queue, t.tick_snapshot from pgque.tick t"
                             " join pgque.queue q on q.queue_id = t.tick_queue"
                             " where q.queue_name = 'q' order by t.tick_id desc limit 1"
                             ).fetchone()
    conn.execute(f"analyze pgque.event_{int(qid)}")  # the planner's real row counts
    with conn.transaction():
        found = [scalar(conn, "select pgque._uncovered_events(%s, %s::pg_snapshot)",
                        (qid, snap)) for _ in range(10)]
        seq_scans = scalar(conn, "select coalesce(sum(seq_scan), 0) from pg_stat_xact_user_tables"
                                 " where schemaname = 'pgque' and relname like %s",
                           (f"event_{int(qid)}_%",))
    assert found == [False] * 10
    assert seq_scans == 0


def test_drop_queue_with_force_leaves_nothing_behind(client: pgque.Client,
                                                     conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    client.create_queue("other")
    client.subscribe("q", "c")
    client.subscribe("other", "c")
    client.subscribe_slots("q", "g", slots=2)
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages, retry_after=3600)
    with pytest.raises(pgque.QueueInUse):
        client.drop_queue("q")
    client.drop_queue("q", force=True)
    counts = conn.execute(
        "select (select count(*) from pgque.subscription),"
        " (select count(*) from pgque.retry_queue),"
        " (select count(*) from pgque.consumer_group),"
        " (select count(*) from pg_class where relname like 'event\\_1%%')").fetchone()
    assert counts == (1, 0, 0, 0)  # only "other"'s consumer remains
    # The cursor rows of the consumers dropped are not deleted: the next two
    # rotations of the cursor log empty the partitions that hold them.
    conn.execute("update pgque.rotation set rt_period = '0'")
    client.maintenance()
    client.maintenance()
    assert scalar(conn, "select count(*) from pgque.cursor") == 1  # "other"'s
    assert [m.id for m in drain(client, "other", "c")] == []


def test_receive_with_the_largest_max_events(client: pgque.Client) -> None:
    """max_events up to 2^31 - 1 works (the one-more look-ahead must not overflow)."""
    top = 2**31 - 1
    client.create_queue("q")
    client.subscribe("q", "c")
    client.subscribe_slots("q", "g", slots=1)
    assert client.claim_slot("q", "g", 0)
    sent = client.send_batch("q", [("e", 1), ("e", 2)])
    client.tick("q")
    batch = client.receive("q", "c", max_events=top)
    assert batch is not None and [m.id for m in batch] == sent
    assert client.ack(batch) is True
    piece = client.receive_partitioned("q", "g", slot=0, slots=1, max_events=top)
    assert piece is not None and [m.id for m in piece] == sent
    assert client.ack(piece) is True


def test_send_batch_ids_follow_the_array_order_beside_other_producers(
        client: pgque.Client, dsn: str) -> None:
    """Each send_batch's ids ascend in the array's order, and each id holds the
    event at its position, while other sessions take ids from the same
    sequence at the same time (their ids interleave, never the order)."""
    client.create_queue("q")
    client.subscribe("q", "c")
    results: dict[int, list[tuple[list[int], list[int]]]] = {}
    errors: list[BaseException] = []

    def produce(producer: int) -> None:
        try:
            with pgque.connect(dsn, pool_size=0) as own:
                for call in range(15):
                    values = [producer * 1_000_000 + call * 1_000 + i for i in range(200)]
                    ids = own.send_batch("q", [("e", v, f"k{v % 7}") for v in values])
                    results.setdefault(producer, []).append((ids, values))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    client.tick("q")
    stored = {m.id: m.payload for m in drain(client, "q", "c")}
    for calls in results.values():
        assert len(calls) == 15
        for ids, values in calls:
            assert ids == sorted(ids) and len(set(ids)) == len(ids)
            assert [stored[i] for i in ids] == values
    assert len(stored) == 3 * 15 * 200
