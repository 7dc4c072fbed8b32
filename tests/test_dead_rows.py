"""No dead rows: the engine's own state (the cursor log, the ticks) is only
inserted into and emptied by TRUNCATE when its tables rotate, as the event
tables are; the hot path updates and deletes no row.

Rotations are made due at every maintenance pass here (rt_period 0), so that a
test crosses many of them; in production they come once a minute.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for

import pgque

HOT_PATH_CYCLES = 1000


def rotate_always(conn: psycopg.Connection[Any]) -> None:
    """Every maintenance pass rotates the cursor and tick tables from now on (the
    update's own counts flushed to the statistics at once)."""
    conn.execute("update pgque.rotation set rt_period = '0'")
    conn.execute("select pg_stat_force_next_flush()")


def table_writes(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int, int]]:
    """(n_tup_upd, n_tup_del, n_dead_tup) of every table of schema pgque, as the
    statistics show them once this session's own counts are flushed."""
    conn.execute("select pg_stat_force_next_flush()")
    conn.execute("select pg_stat_clear_snapshot()")
    rows = conn.execute(
        "select relname, n_tup_upd, n_tup_del, n_dead_tup from pg_stat_user_tables"
        " where schemaname = 'pgque'").fetchall()
    return {name: (upd, dele, dead) for name, upd, dele, dead in rows}


def rotations(steps: list[tuple[str | None, str, int]]) -> int:
    return sum(1 for _queue, step, _amount in steps if step.startswith("rotate_"))


def cursor_state(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """Every subscription's current cursor as _current_cursor reads it."""
    return conn.execute(
        "select s.sub_consumer, (c).cur_seq, (c).cur_last_tick, (c).cur_batch,"
        "       (c).cur_next_tick, (c).cur_pos, (c).cur_handed, (c).cur_end"
        "  from pgque.subscription s, pgque._current_cursor(s.sub_id) c"
        " order by s.sub_consumer").fetchall()


@pytest.mark.parametrize("consumer", ["group16", "plain"])
def test_hot_path_updates_and_deletes_no_row(client: pgque.Client,
                                             conn: psycopg.Connection[Any],
                                             consumer: str) -> None:
    """1,000 send-tick-receive-ack cycles (of a 16-slot group drained with
    receive_slots and ack_slots, or of a plain consumer), with a maintenance
    pass that rotates every 50 cycles: no pgque table has a row updated or
    deleted, except pgque.rotation's, once per rotation."""
    client.create_queue("q")
    if consumer == "group16":
        client.subscribe_slots("q", "g", slots=16)
        for slot in range(16):
            assert client.claim_slot("q", "g", slot)
    else:
        client.subscribe("q", "c")
    rotate_always(conn)
    client.maintenance()
    before = table_writes(client.conn)
    steps: list[tuple[str | None, str, int]] = []
    received = 0
    for cycle in range(HOT_PATH_CYCLES):
        client.send_batch("q", [("e", {"n": i}, f"key-{cycle}-{i}") for i in range(8)])
        client.tick("q")
        if consumer == "group16":
            batches = client.receive_slots("q", "g", slots=16, owned=range(16))
            received += sum(len(b) for b in batches)
            client.ack_slots(batches)
        else:
            batch = client.receive("q", "c")
            assert batch is not None
            received += len(batch)
            assert client.ack(batch)
        if cycle % 50 == 49:
            steps += client.maintenance()
    after = table_writes(client.conn)
    assert received == 8 * HOT_PATH_CYCLES
    assert rotations(steps) == 2 * (HOT_PATH_CYCLES // 50)  # both tables, every pass
    writes = {name: (after[name][0] - before.get(name, (0, 0, 0))[0],
                     after[name][1] - before.get(name, (0, 0, 0))[1])
              for name in after}
    assert writes.pop("rotation") == (rotations(steps), 0)
    assert {name: w for name, w in writes.items() if w != (0, 0)} == {}
    # Dead rows: at most the rotation row's new old versions (vacuum may take them).
    dead = sum(d for _u, _d, d in after.values()) - sum(d for _u, _d, d in before.values())
    assert dead <= rotations(steps)


def test_current_cursor_is_one_index_probe(client: pgque.Client,
                                           conn: psycopg.Connection[Any]) -> None:
    """Whichever partition is written, reading a subscription's cursor probes
    one index once: the partition written now, which holds every subscription's
    current cursor."""
    client.create_queue("q")
    client.subscribe("q", "c")
    rotate_always(conn)
    sub = scalar(conn, "select sub_id from pgque.subscription")
    for n in range(3):
        client.send("q", "e", n)
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None and client.ack(batch)
        assert "rotate_cursors" in [step for _q, step, _n in client.maintenance()]
        before = index_scans(conn)
        assert scalar(conn, "select (pgque._current_cursor(%s)).cur_sub", (sub,)) == sub
        after = index_scans(conn)
        part = scalar(conn, "select rt_part from pgque.rotation where rt_name = 'cursor'")
        assert {i: after[i] - before[i] for i in after if after[i] != before[i]} == {
            f"cursor_{part}_pkey": 1}


def index_scans(conn: psycopg.Connection[Any]) -> dict[str, int]:
    conn.execute("select pg_stat_force_next_flush()")
    conn.execute("select pg_stat_clear_snapshot()")
    return dict(conn.execute(
        "select indexrelname, idx_scan from pg_stat_user_indexes"
        " where schemaname = 'pgque' and indexrelname ~ '^cursor_[0-9]+_pkey$'").fetchall())


def test_rotations_keep_every_cursor_and_tick_a_consumer_needs(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A consumer that lags across many rotations (its batch left open, its
    last tick in a partition emptied since) still receives every event once, in
    order; the tables then hold only what the current cursors need."""
    client.create_queue("q")
    client.subscribe("q", "fast")
    client.subscribe("q", "lagging")
    rotate_always(conn)
    sent: list[int] = []
    got: dict[str, list[int]] = {"fast": [], "lagging": []}
    open_batch = None
    tick_rotations = 0
    for n in range(20):
        sent += client.send_batch("q", [("e", {"n": i}, None) for i in range(5)])
        client.tick("q")
        while (batch := client.receive("q", "fast")) is not None:
            got["fast"] += [m.id for m in batch]
            client.ack(batch)
        if n == 2:  # the lagging consumer reads up to here...
            while (batch := client.receive("q", "lagging")) is not None:
                got["lagging"] += [m.id for m in batch]
                client.ack(batch)
        if n == 3:  # ... opens one more batch and leaves it open
            open_batch = client.receive("q", "lagging", max_events=2)
            assert open_batch is not None
        state = cursor_state(conn)
        steps = [step for _q, step, _n in client.maintenance()]
        assert "rotate_cursors" in steps
        tick_rotations += steps.count("rotate_ticks")
        assert cursor_state(conn) == state
    # One switch, once the lagging consumer had moved; the partition holding
    # its last tick waits for it, as an event table would: no tick is gone.
    assert tick_rotations == 1
    assert scalar(conn, "select count(*) from pgque.tick") == 21
    assert open_batch is not None
    got["lagging"] += [m.id for m in open_batch]
    client.ack(open_batch)
    while (batch := client.receive("q", "lagging")) is not None:
        got["lagging"] += [m.id for m in batch]
        client.ack(batch)
    assert got == {"fast": sent, "lagging": sent}
    for n in range(2):  # both keep up now
        client.send("q", "e", n)
        client.tick("q")
        for consumer in ("fast", "lagging"):
            while (batch := client.receive("q", consumer)) is not None:
                client.ack(batch)
        client.maintenance()
    client.maintenance()
    # One cursor row each, and the queue's newest tick: all the rest emptied.
    assert scalar(conn, "select count(*) from pgque.cursor") == 2
    assert scalar(conn, "select count(*) from pgque.tick") == 1


def test_a_killed_rotation_loses_and_repeats_nothing(client: pgque.Client,
                                                     conn: psycopg.Connection[Any],
                                                     dsn: str) -> None:
    """A maintenance session killed inside a rotation, after it emptied a
    partition and copied the cursors into it and before it switched, leaves
    every cursor and tick as they were; the next rotation completes."""
    client.create_queue("q")
    client.subscribe("q", "c")
    rotate_always(conn)
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(6)])
    client.tick("q")
    first = client.receive("q", "c", max_events=2)
    assert first is not None
    client.ack(first)
    client.maintenance()  # both partitions hold rows now
    second = client.receive("q", "c", max_events=2)  # a batch open across the rotations
    assert second is not None
    last = client.send("q", "e", {"n": 6})
    client.tick("q")
    state = cursor_state(conn)
    counts = partition_counts(conn)
    # The rotation stops at its switch: a trigger waits on a lock this test holds.
    conn.execute("""
        create function pgque_test_wait() returns trigger language plpgsql as $$
        begin perform pg_advisory_lock(4242); return new; end $$;
        create trigger wait_before_switch before update on pgque.rotation
            for each row execute function pgque_test_wait();
        select pg_advisory_lock(4242);""")
    maint = psycopg.connect(dsn, autocommit=True)
    pid = maint.info.backend_pid
    failure: list[BaseException] = []

    def run_maint() -> None:
        try:
            maint.execute("select * from pgque.maint()")
        except psycopg.Error as exc:
            failure.append(exc)

    thread = threading.Thread(target=run_maint)
    thread.start()
    wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (pid,)), what="the rotation at its switch")
    # Inside it: the other cursor partition emptied and holding the copies.
    conn.execute("select pg_terminate_backend(%s)", (pid,))
    thread.join(10)
    assert failure and isinstance(failure[0], psycopg.OperationalError)
    conn.execute("select pg_advisory_unlock(4242)")
    conn.execute("drop trigger wait_before_switch on pgque.rotation")
    assert cursor_state(conn) == state
    assert partition_counts(conn) == counts
    assert (None, "rotate_cursors", 2) in client.maintenance()  # emptied, switched
    assert cursor_state(conn) == state
    assert client.ack(second) is False  # the batch goes on where it was
    rest = []
    while (batch := client.receive("q", "c")) is not None:
        rest += [m.id for m in batch]
        client.ack(batch)
    assert [m.id for m in first] + [m.id for m in second] + rest == [*ids, last]


def partition_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    return {t: scalar(conn, f"select count(*) from pgque.{t}")
            for t in ("cursor_0", "cursor_1", "tick_0", "tick_1")}


def test_a_switch_waits_for_no_receive_lock(client: pgque.Client,
                                            conn: psycopg.Connection[Any], dsn: str) -> None:
    """A switch of the cursor log takes no receive lock: while a transaction
    holds one (a handler between its receive and its commit), the switch
    happens, that subscription's cursor is read in the partition left until it
    moves, and it moves at the first pass after the lock is free."""
    client.create_queue("q")
    client.subscribe("q", "c")
    client.subscribe("q", "busy")
    rotate_always(conn)
    client.send("q", "e", 1)
    client.tick("q")
    for consumer in ("c", "busy"):
        batch = client.receive("q", consumer)
        assert batch is not None and client.ack(batch)  # cursor rows: a switch is due
    state = cursor_state(conn)
    with psycopg.connect(dsn) as handler:
        handler.execute("select * from pgque.subscription where sub_consumer = 'busy'"
                        " for update")
        assert "rotate_cursors" in [s[1] for s in client.maintenance()]
        assert scalar(conn, "select rt_moving from pgque.rotation"
                            " where rt_name = 'cursor'") is True
        assert cursor_state(conn) == state  # "busy" read where it was
        handler.rollback()
    assert "rotate_cursors" in [s[1] for s in client.maintenance()]  # the move ends
    assert scalar(conn, "select rt_moving from pgque.rotation where rt_name = 'cursor'") is False
    assert cursor_state(conn) == state
    ev = client.send("q", "e", 2)
    client.tick("q")
    for consumer in ("c", "busy"):
        batch = client.receive("q", consumer)
        assert batch is not None and [m.id for m in batch] == [ev]


def test_a_subscription_made_during_a_rotation_keeps_its_cursor(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A subscription not committed yet holds the cursor rotation off (its
    first cursor row is not among those a rotation would copy); once it
    commits, rotations carry its cursor like any other."""
    client.create_queue("q")
    client.subscribe("q", "c")
    rotate_always(conn)

    def cycle() -> int:  # an event for both, and cursor rows: a switch is due
        ev = client.send("q", "e", 1)
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None and client.ack(batch)
        return ev

    cycle()
    with psycopg.connect(dsn) as other:
        assert scalar(other, "select pgque.subscribe('q', 'late')") is True
        assert [s for s in client.maintenance() if s[1] == "rotate_cursors"] == []
        other.commit()
    sent = []
    for _ in range(3):
        sent.append(cycle())
        assert "rotate_cursors" in [s[1] for s in client.maintenance()]
    got = []
    while (batch := client.receive("q", "late")) is not None:
        got += [m.id for m in batch]
        client.ack(batch)
    assert got == sent


def test_repeatable_read_across_a_rotation_fails_to_serialize(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A REPEATABLE READ transaction whose snapshot predates a rotation would
    write its cursor into the partition the rotation left: it gets a
    serialization failure (40001) instead, and its retry succeeds."""
    client.create_queue("q")
    client.subscribe("q", "c")
    rotate_always(conn)
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    with psycopg.connect(dsn) as handler:
        handler.execute("set transaction isolation level repeatable read")
        handler.execute("select 1")  # the snapshot
        assert (None, "rotate_cursors", 1) in client.maintenance()
        with pytest.raises(psycopg.errors.SerializationFailure):
            handler.execute("select pgque.ack('q', 'c', %s)", (batch.batch_id,))
        handler.rollback()
        handler.execute("set transaction isolation level repeatable read")
        assert scalar(handler, "select pgque.ack('q', 'c', %s)", (batch.batch_id,)) is True
        handler.commit()
    assert client.receive("q", "c") is None


def test_repeatable_read_behind_another_sessions_receive_fails_to_serialize(
        client: pgque.Client, dsn: str) -> None:
    """A REPEATABLE READ transaction whose snapshot predates another session's
    receive and ack of the same consumer (no rotation between) reads the cursor
    as it was and would write the state that session wrote: a serialization
    failure (40001), not a duplicate key (23505), for a receive and for an ack;
    retried, the receive gets what came after and the ack finds the batch gone."""
    client.create_queue("q")
    client.subscribe("q", "c")
    for n in range(3):
        client.send("q", "e", n)
        client.tick("q")
    with psycopg.connect(dsn) as handler:
        handler.execute("set transaction isolation level repeatable read")
        handler.execute("select 1")  # the snapshot
        batch = client.receive("q", "c")
        assert batch is not None and len(batch) == 3
        client.ack(batch)
        client.send("q", "e", "after")
        client.tick("q")
        with pytest.raises(psycopg.errors.SerializationFailure):
            handler.execute("select count(*) from pgque.receive('q', 'c')")
        handler.rollback()
        opened = handler.execute("select batch_id from pgque.receive('q', 'c')").fetchall()
        assert len(opened) == 1  # the event sent after, once
        handler.commit()
        handler.execute("set transaction isolation level repeatable read")
        handler.execute("select 1")  # a snapshot with that batch open
        again = client.receive("q", "c")
        assert again is not None and again.batch_id == opened[0][0]
        assert client.ack(again) is True
        with pytest.raises(psycopg.errors.SerializationFailure):
            handler.execute("select pgque.ack('q', 'c', %s)", (opened[0][0],))
        handler.rollback()
        with pytest.raises(psycopg.Error) as gone:
            handler.execute("select pgque.ack('q', 'c', %s)", (opened[0][0],))
        assert gone.value.sqlstate == "PQ003"  # not the open batch any more
        handler.rollback()


@pytest.fixture
def group_of_16(client: pgque.Client, conn: psycopg.Connection[Any]) -> Iterator[None]:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=16)
    rotate_always(conn)
    client.maintenance()
    yield


def test_rotations_under_load_lose_repeat_and_reorder_nothing(
        client: pgque.Client, dsn: str, group_of_16: None) -> None:
    """Four sessions drain a 16-slot group (four slots each, receive_slots and
    ack_slots) while a producer sends and ticks and a third session runs
    maintenance, rotating at every pass: every event is handled once, each
    key's events in the order sent."""
    keys = [f"tenant-{i}" for i in range(40)]
    total = 3000
    done = threading.Event()
    handled: list[list[tuple[str, int]]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    rotated = [0]

    def drain(n: int) -> None:
        try:
            with pgque.connect(dsn) as worker:
                owned = range(4 * n, 4 * n + 4)
                for slot in owned:
                    assert worker.claim_slot("q", "g", slot)
                while not done.is_set() or sum(map(len, handled)) < total:
                    batches = worker.receive_slots("q", "g", slots=16, owned=owned)
                    for b in batches:
                        handled[n].extend((m.partition_key or "", m.id) for m in b)
                    worker.ack_slots(batches)
                    if sum(map(len, handled)) >= total:
                        break
        except BaseException as exc:
            errors.append(exc)

    def maintain() -> None:
        try:
            with pgque.connect(dsn) as maint:
                while not done.is_set():
                    rotated[0] += rotations(maint.maintenance())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(n,)) for n in range(4)]
    threads.append(threading.Thread(target=maintain))
    for t in threads:
        t.start()
    rng = random.Random(7)
    sent: list[tuple[str, int]] = []
    while len(sent) < total:
        rows = [("e", {}, rng.choice(keys)) for _ in range(50)]
        ids = client.send_batch("q", rows)
        sent += [(key, ev) for (_t, _p, key), ev in zip(rows, ids, strict=True)]
        client.tick("q")
    wait_for(lambda: sum(map(len, handled)) >= total or errors, timeout=60,
             what="every event handled")
    done.set()
    for t in threads:
        t.join(30)
    assert errors == []
    assert rotated[0] >= 2
    got = [pair for part in handled for pair in part]
    assert sorted(ev for _k, ev in got) == sorted(ev for _k, ev in sent)
    for key in keys:
        assert [ev for k, ev in got if k == key] == sorted(ev for k, ev in got if k == key)


# Nacks and retries: the nack records and the retry queue rotate too.

NACK_CYCLES = 300


def test_nacks_and_retries_update_and_delete_no_row(client: pgque.Client,
                                                    conn: psycopg.Connection[Any]) -> None:
    """300 cycles that nack a quarter of what they receive (retry at once) and
    ack, with a maintenance pass every 10 cycles that moves the due retries
    back into the log and rotates: every nacked event comes back once, and no
    pgque table has a row updated or deleted but pgque.rotation's, once per
    rotation; the nack records and the retry queue hold only the last
    periods' rows."""
    client.create_queue("q")
    client.subscribe("q", "c")
    rotate_always(conn)
    client.maintenance()
    before = table_writes(client.conn)
    steps: list[tuple[str | None, str, int]] = []
    sent: list[int] = []
    first_seen: list[int] = []
    retried: list[int] = []
    nacked: list[int] = []
    for cycle in range(NACK_CYCLES):
        sent += client.send_batch("q", [("e", {"n": i}, None) for i in range(8)])
        client.tick("q")
        while (batch := client.receive("q", "c")) is not None:
            fresh = [m for m in batch if m.retry_count == 0]
            first_seen += [m.id for m in fresh]
            retried += [m.id for m in batch if m.retry_count > 0]
            to_nack = fresh[::4]
            if to_nack:
                assert client.nack(batch, to_nack, reason="flaky") == 0
                nacked += [m.id for m in to_nack]
            client.ack(batch)
        if cycle % 10 == 9:
            steps += client.maintenance()
    for _ in range(3):  # the last retries moved, ticked and read
        steps += client.maintenance()
        client.tick("q")
        while (batch := client.receive("q", "c")) is not None:
            assert all(m.retry_count == 1 for m in batch)
            retried += [m.id for m in batch]
            client.ack(batch)
    after = table_writes(client.conn)
    assert first_seen == sent
    assert sorted(retried) == sorted(nacked) and len(nacked) == 2 * NACK_CYCLES
    kinds = [step for _q, step, _n in steps]
    assert kinds.count("rotate_nacks") >= NACK_CYCLES // 10 - 1
    assert kinds.count("rotate_retries") >= NACK_CYCLES // 10 - 1
    writes = {name: (after[name][0] - before.get(name, (0, 0, 0))[0],
                     after[name][1] - before.get(name, (0, 0, 0))[1])
              for name in after}
    rotation_upd, rotation_del = writes.pop("rotation")  # one update per switch at most
    assert 0 < rotation_upd <= rotations(steps) and rotation_del == 0
    assert {name: w for name, w in writes.items() if w != (0, 0)} == {}
    # At most two passes' worth of nack records and retries are left.
    assert scalar(conn, "select count(*) from pgque.batch_nack") <= 2 * 10 * 2
    assert scalar(conn, "select count(*) from pgque.retry_queue") <= 2 * 10 * 2
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 0


def rotation_part(conn: psycopg.Connection[Any], name: str) -> int:
    return int(scalar(conn, "select rt_part from pgque.rotation where rt_name = %s", (name,)))


def test_a_nack_repeated_after_a_switch_counts_once(client: pgque.Client,
                                                    conn: psycopg.Connection[Any]) -> None:
    """A consumer that nacks an event, then (its batch still open, the nack
    records switched to the other partition meanwhile) nacks it again, as one
    that died before its ack does: one retry, and the record of the open batch
    is kept until the batch ends."""
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    rotate_always(conn)
    client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    part = rotation_part(conn, "nack")
    assert client.nack(batch, batch.messages[0]) == 1  # max_retries 0: a dead letter
    assert "rotate_nacks" in [step for _q, step, _n in client.maintenance()]
    assert rotation_part(conn, "nack") != part  # switched away from its record
    assert client.nack(batch, [batch.messages[0], batch.messages[1]]) == 1  # only the second is new
    assert len(client.dead_letters("q", "c")) == 2
    for _ in range(3):  # the open batch holds its records' partitions
        client.maintenance()
        assert scalar(conn, "select count(*) from pgque.batch_nack") == 2
    assert client.ack(batch)
    for _ in range(3):
        client.maintenance()
    assert scalar(conn, "select count(*) from pgque.batch_nack") == 0


def test_a_retry_not_due_is_carried_over_and_comes_back_once(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A retry due in an hour is copied over at each rotation of the retry
    queue, while the retries due at once are moved, marked and emptied; once it
    is due, it comes back once, and the retry queue ends empty."""
    client.create_queue("q")
    client.subscribe("q", "c")
    rotate_always(conn)
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(4)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages[0], retry_after=3600)
    client.nack(batch, batch.messages[1])
    client.ack(batch)
    back: list[int] = []
    for n in range(6):
        client.maintenance()
        client.tick("q")
        while (batch := client.receive("q", "c")) is not None:
            back += [m.id for m in batch]
            if n < 3:  # more retries due at once, in later partitions
                client.nack(batch, batch.messages[0])
            client.ack(batch)
    assert back == [ids[1]] * 4
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 1
    # The far one, and at most the last two passes' moved retries with their marks.
    assert scalar(conn, "select count(*) from pgque.retry_queue") <= 3
    assert scalar(conn, "select count(*) from pgque.retry_moved") <= 2
    conn.execute("update pgque.retry_queue set ev_retry_after = now() where ev_id = %s",
                 (ids[0],))  # the hour passed
    for _ in range(4):
        client.maintenance()
        client.tick("q")
        while (batch := client.receive("q", "c")) is not None:
            back += [m.id for m in batch]
            client.ack(batch)
    assert back == [ids[1]] * 4 + [ids[0]]
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 0
    assert scalar(conn, "select count(*) from pgque.retry_moved") == 0


@pytest.mark.parametrize("rotation", ["nack", "retry"])
def test_a_killed_nack_or_retry_rotation_loses_and_repeats_nothing(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str, rotation: str) -> None:
    """A maintenance session killed at the switch of the nack records or of the
    retry queue, after it emptied the other partition in the same transaction:
    the records, the retries and their marks are as they were, and every
    retry comes back once."""
    client.create_queue("q", max_retries=5)
    client.subscribe("q", "c")
    rotate_always(conn)
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(4)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages[0])
    client.ack(batch)
    client.maintenance()  # moved, switched: the next pass empties and switches again
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and [m.id for m in batch] == [ids[0]]
    client.nack(batch, batch.messages[0], retry_after=0)
    open_batch = batch
    tables = ("batch_nack", "retry_queue", "retry_moved")
    counts = {t: scalar(conn, f"select count(*) from pgque.{t}") for t in tables}
    conn.execute(f"""
        create function pgque_test_wait() returns trigger language plpgsql as $$
        begin
            if new.rt_name = '{rotation}' then perform pg_advisory_lock(4243); end if;
            return new;
        end $$;
        create trigger wait_before_switch before update on pgque.rotation
            for each row execute function pgque_test_wait();
        select pg_advisory_lock(4243);""")
    maint = psycopg.connect(dsn, autocommit=True)
    pid = maint.info.backend_pid
    failure: list[BaseException] = []

    def run_maint() -> None:
        try:
            maint.execute("select * from pgque.maint()")
        except psycopg.Error as exc:
            failure.append(exc)

    thread = threading.Thread(target=run_maint)
    thread.start()
    wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (pid,)), what="the rotation at its switch")
    conn.execute("select pg_terminate_backend(%s)", (pid,))
    thread.join(10)
    assert failure and isinstance(failure[0], psycopg.OperationalError)
    conn.execute("select pg_advisory_unlock(4243)")
    conn.execute("drop trigger wait_before_switch on pgque.rotation")
    conn.execute("drop function pgque_test_wait()")
    assert {t: scalar(conn, f"select count(*) from pgque.{t}") for t in tables} == counts
    assert client.nack(open_batch, open_batch.messages[0]) == 0  # recorded: changes nothing
    client.ack(open_batch)
    back: list[int] = []
    for _ in range(4):
        client.maintenance()
        client.tick("q")
        while (batch := client.receive("q", "c")) is not None:
            back += [m.id for m in batch]
            client.ack(batch)
    assert back == [ids[0]]
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 0
