"""Attacks on the rotation of the nack records and the retry queue (migration 7),
from a review: repeated nacks across switches under every isolation level,
retries due far ahead, concurrent maintenance, the recommended deployment, the
upgrade from 0.4.0 under a live session."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for

import pgque


def rotate(conn: psycopg.Connection[Any], *names: str) -> None:
    """Rotations names at every maintenance pass, the others not for a day (the
    test database may be older than a rotation period: its first pass would
    rotate them all)."""
    conn.execute("update pgque.rotation set rt_period = case when rt_name = any(%s)"
                 " then interval '0' else interval '1 day' end, rt_time = now()",
                 (list(names),))


def records(conn: psycopg.Connection[Any], ev_id: int) -> list[Any]:
    return conn.execute("select bn_part from pgque.batch_nack where bn_ev_id = %s",
                        (ev_id,)).fetchall()


def part(conn: psycopg.Connection[Any], name: str) -> int:
    return int(scalar(conn, "select rt_part from pgque.rotation where rt_name = %s", (name,)))


def drain(client: pgque.Client, q: str = "q", c: str = "c") -> list[int]:
    got: list[int] = []
    client.tick(q)
    while (batch := client.receive(q, c)) is not None:
        got += [m.id for m in batch]
        client.ack(batch)
    return got


# -- Promise 2 / 1: a repeated nack, REPEATABLE READ, across a nack switch ---------------------

def test_a_nack_held_across_a_switch_then_repeated_in_repeatable_read_counts_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """Consumer A nacks event E of open batch B while maintenance tries to
    switch the nack records (A's insert held here by a trigger on
    batch_nack_0, standing for a slow statement): the switch does not happen
    under A, whose nack holds the rotation row. A dies before its ack. Its
    successor T, a transactional handler in REPEATABLE READ whose snapshot was
    taken before A committed, nacks E again: its record goes to the partition
    of batch B, where A's is (_nack_part), and the key catches it (40001, then
    0 once retried): one dead letter."""
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    rotate(conn, "nack")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    b = batch.batch_id
    assert part(conn, "nack") == 0
    assert client.nack(batch, batch.messages[0]) == 1  # a record in partition 0
    conn.execute(f"""
        create function attack_hold() returns trigger language plpgsql as $$
        begin
            if new.bn_ev_id = {ids[1]} then
                perform pg_advisory_lock(5151); perform pg_advisory_unlock(5151);
            end if;
            return new;
        end $$;
        create trigger attack_hold before insert on pgque.batch_nack_0
            for each row execute function attack_hold();
        select pg_advisory_lock(5151);""")
    a = psycopg.connect(dsn, autocommit=True)
    a_pid = a.info.backend_pid
    out: list[Any] = []

    def consumer_a() -> None:
        try:
            out.append(scalar(a, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])",
                              (b, ids[1])))
        except psycopg.Error as exc:
            out.append(exc)

    th = threading.Thread(target=consumer_a)
    th.start()
    wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (a_pid,)), what="A inside its nack")
    client.maintenance()
    assert part(conn, "nack") == 0  # no switch while A's nack holds the rotation row
    t = psycopg.connect(dsn)
    t.execute("set transaction isolation level repeatable read")
    scalar(t, "select 1")  # T's snapshot (its handler began)
    conn.execute("select pg_advisory_unlock(5151)")
    th.join(10)
    a.close()  # A dies before its ack
    assert out == [1]
    conn.execute("drop trigger attack_hold on pgque.batch_nack_0")
    try:
        again = scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
        t.commit()
    except psycopg.errors.SerializationFailure:
        t.rollback()  # acceptable: the handler retries in a fresh snapshot
        again = scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
        t.commit()
    t.close()
    n_dead = scalar(conn, "select count(*) from pgque.dead_letter where ev_id = %s", (ids[1],))
    assert (again, n_dead) == (0, 1), (
        f"the repeated nack counted again: returned {again}, {n_dead} dead letters of E;"
        f" batch_nack rows for E:"
        f" {records(conn, ids[1])}")


def test_a_nack_held_across_a_switch_then_repeated_in_repeatable_read_retries_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """The same with retries (max_retries 3): E comes back once."""
    client.create_queue("q", max_retries=3)
    client.subscribe("q", "c")
    rotate(conn, "nack")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    b = batch.batch_id
    client.nack(batch, batch.messages[0])
    conn.execute(f"""
        create function attack_hold() returns trigger language plpgsql as $$
        begin
            if new.bn_ev_id = {ids[1]} then
                perform pg_advisory_lock(5152); perform pg_advisory_unlock(5152);
            end if;
            return new;
        end $$;
        create trigger attack_hold before insert on pgque.batch_nack_0
            for each row execute function attack_hold();
        select pg_advisory_lock(5152);""")
    a = psycopg.connect(dsn, autocommit=True)
    a_pid = a.info.backend_pid
    th = threading.Thread(target=lambda: a.execute(
        "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1])))
    th.start()
    wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (a_pid,)), what="A inside its nack")
    client.maintenance()
    assert part(conn, "nack") == 0  # no switch while A's nack holds the rotation row
    t = psycopg.connect(dsn)
    t.execute("set transaction isolation level repeatable read")
    scalar(t, "select 1")
    conn.execute("select pg_advisory_unlock(5152)")
    th.join(10)
    a.close()
    conn.execute("drop trigger attack_hold on pgque.batch_nack_0")
    try:
        t.execute("select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
    except psycopg.errors.SerializationFailure:
        t.rollback()  # the handler's transaction is retried, in a fresh snapshot
        t.execute("select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
    t.execute("select pgque.ack('q', 'c', %s)", (b,))
    t.commit()
    t.close()
    conn.execute("update pgque.rotation set rt_period = '1 hour'")
    back: list[int] = []
    for _ in range(3):
        client.maintenance()
        back += drain(client)
    assert sorted(back) == sorted([ids[0], ids[1]]), f"came back: {back} (ids {ids})"


# -- Promise 3: bounded tables --------------------------------------------------------------

def test_a_retry_due_far_ahead_keeps_the_retry_queue_bounded(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """One nack with retry_after = 1 day, then 150 cycles of one retry due at
    once, rotating at every pass: the far retry is copied over at each
    rotation, and the retry queue and its marks hold a few passes' rows, not
    one per cycle."""
    client.create_queue("q", max_retries=100)
    client.subscribe("q", "c")
    rotate(conn, "cursor", "tick", "nack", "retry")
    client.send_batch("q", [("e", {"n": i}, None) for i in range(2)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages[0], retry_after=86400)
    client.ack(batch)
    cycles = 150
    t0 = time.monotonic()
    for n in range(cycles):
        client.send("q", "e", {"n": n})
        client.tick("q")
        while (batch := client.receive("q", "c")) is not None:
            if batch.messages:
                client.nack(batch, batch.messages[0])
            client.ack(batch)
        client.maintenance()
    elapsed = time.monotonic() - t0
    waiting = scalar(conn, "select count(*) from pgque._retry_waiting")
    rows = scalar(conn, "select count(*) from pgque.retry_queue")
    marks = scalar(conn, "select count(*) from pgque.retry_moved")
    print(f"{cycles} cycles in {elapsed:.1f}s: waiting {waiting}, retry_queue {rows},"
          f" retry_moved {marks}")
    assert rows + marks <= 2 * 2 * 4 + waiting, (
        f"retry_queue {rows} rows and retry_moved {marks} marks for {waiting} waiting"
        f" retries after {cycles} cycles (rotation every pass)")


# -- Promise 1: concurrent maintenance sessions, nacks racing rotations ---------------------

def test_concurrent_maint_sessions_under_nack_load_move_each_retry_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    client.create_queue("q", max_retries=1000)
    client.subscribe("q", "c")
    rotate(conn, "cursor", "tick", "nack", "retry")
    stop = threading.Event()
    errors: list[BaseException] = []

    def maint_loop() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as m:
                while not stop.is_set():
                    m.execute("select * from pgque.maint()").fetchall()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=maint_loop) for _ in range(3)]
    for th in threads:
        th.start()
    sent = client.send_batch("q", [("e", {"n": i}, None) for i in range(40)])
    nacks: dict[int, int] = {}
    seen: dict[int, int] = {}
    deadline = time.monotonic() + 40
    try:
        while time.monotonic() < deadline:
            client.tick("q")
            batch = client.receive("q", "c")
            if batch is None:
                if sum(nacks.values()) >= 400 and \
                        scalar(conn, "select count(*) from pgque._retry_waiting") == 0 and \
                        sum(seen.values()) == len(sent) + sum(nacks.values()):
                    break
                continue
            for m in batch:
                seen[m.id] = seen.get(m.id, 0) + 1
            to_nack = [m for m in batch if m.retry_count < 10 and sum(nacks.values()) < 400]
            if to_nack:
                client.nack(batch, to_nack)
                # repeated, as a consumer that died before its ack would: counts once
                client.nack(batch, to_nack)
                for m in to_nack:
                    nacks[m.id] = nacks.get(m.id, 0) + 1
            client.ack(batch)
    finally:
        stop.set()
        for th in threads:
            th.join(20)
    print("nacks", sum(nacks.values()), "seen", sum(seen.values()),
          "rotation", conn.execute("select rt_name, rt_part from pgque.rotation").fetchall())
    assert errors == []
    assert sum(nacks.values()) >= 400
    assert scalar(conn, "select count(*) from pgque.dead_letter") == 0
    expected = {i: 1 + nacks.get(i, 0) for i in sent}
    assert seen == expected
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 0


def test_a_nack_in_repeatable_read_racing_retry_rotations_comes_back_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A transactional handler (REPEATABLE READ) whose snapshot predates several
    switches of the retry queue nacks: its retry goes to the partition its
    snapshot names (a partition left, perhaps already emptied), and must come
    back once."""
    client.create_queue("q", max_retries=5)
    client.subscribe("q", "c")
    client.subscribe("q", "other")
    rotate(conn, "retry")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(2)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    t = psycopg.connect(dsn)
    t.execute("set transaction isolation level repeatable read")
    scalar(t, "select 1")
    seen_part = part(conn, "retry")
    # another consumer's nacks drive the retry rotation on meanwhile
    for _ in range(5):
        ob = client.receive("q", "other")
        if ob is None:
            client.tick("q")
            ob = client.receive("q", "other")
        assert ob is not None
        if ob.messages:
            client.nack(ob, ob.messages[0])
        client.ack(ob)
        client.maintenance()
        client.tick("q")
    print("retry part", seen_part, "->", part(conn, "retry"))
    t.execute("select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (batch.batch_id, ids[0]))
    t.execute("select pgque.ack('q', 'c', %s)", (batch.batch_id,))
    t.commit()
    back: list[int] = []
    for _ in range(6):
        client.maintenance()
        back += drain(client)
    assert back == [ids[0]]
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 0


# -- Promise 6 -----------------------------------------------------------------------------

def test_consumer_info_counts_only_waiting_retries(client: pgque.Client,
                                                   conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages[0])
    client.nack(batch, batch.messages[1], retry_after=3600)
    client.ack(batch)
    client.maintenance()  # the first moved, marked, not deleted
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 2
    assert scalar(conn, "select retries_waiting from pgque.consumer_info"
                        " where consumer_name = 'c'") == 1


def test_two_repeatable_read_handlers_nack_across_a_switch_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """Two transactional handlers (REPEATABLE READ) of the same consumer, no
    instrumentation. A's snapshot predates a switch of the nack records, T's
    follows it. A nacks E in open batch B, commits and dies before its ack; T,
    whose snapshot predates A's commit, nacks E again in B: 40001, and 0 once
    retried; one dead letter."""
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    rotate(conn, "nack")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    b = batch.batch_id
    assert client.nack(batch, batch.messages[0]) == 1  # a record in 0: the switch has work
    a = psycopg.connect(dsn)
    a.execute("set transaction isolation level repeatable read")
    scalar(a, "select 1")  # A's handler began (snapshot: rt_part 0)
    assert "rotate_nacks" in [s for _q, s, _n in client.maintenance()]
    assert part(conn, "nack") == 1
    t = psycopg.connect(dsn)
    t.execute("set transaction isolation level repeatable read")
    scalar(t, "select 1")  # T's handler began (snapshot: rt_part 1, A's nack unseen)
    assert scalar(a, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1])) == 1
    a.commit()
    a.close()  # A dies before its ack
    with pytest.raises(psycopg.errors.SerializationFailure):
        scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
    t.rollback()  # the handler's transaction is retried, in a fresh snapshot
    again = scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
    t.commit()
    t.close()
    n_dead = scalar(conn, "select count(*) from pgque.dead_letter where ev_id = %s", (ids[1],))
    assert (again, n_dead) == (0, 1), (
        f"repeated nack returned {again}; {n_dead} dead letters of one event; records in"
        f" {records(conn, ids[1])}")


# -- Promise 4: the recommended deployment ---------------------------------------------------

def test_deployment_no_login_locks_a_partition_and_a_century_retry_pins_nothing(
        pgque_deployment: Any, conn: psycopg.Connection[Any]) -> None:
    """Owner installed (no superuser); ticker maintains; billing's login nacks.
    Neither the outsider nor the team login may lock a partition of the nack
    records or the retry queue, and a team login's nack with retry_after of
    100 years (accepted: no upper bound) keeps no other retry in the table."""
    d = pgque_deployment
    team = d.login(d.teams[0])
    with pgque.connect(d.dsn(d.owner)) as owner, pgque.connect(d.dsn(d.ticker)) as ticker, \
            pgque.connect(d.dsn(team)) as worker:
        owner.create_queue("q", max_retries=1000)
        worker.subscribe("q", "c")
        with psycopg.connect(d.superuser_dsn(), autocommit=True) as su:
            su.execute("update pgque.rotation set rt_period = '0'")
        for role in (d.outsider, team):
            with psycopg.connect(d.dsn(role)) as other:
                for table in ("batch_nack_0", "batch_nack_1", "retry_queue_0", "retry_queue_1",
                              "retry_moved_0", "retry_moved_1", "rotation"):
                    try:
                        other.execute(f"lock table pgque.{table} in access share mode nowait")
                    except psycopg.errors.InsufficientPrivilege:
                        other.rollback()
                    else:
                        raise AssertionError(f"{role} may lock pgque.{table}")
        worker.send("q", "e", {"n": -1})
        ticker.tick("q")
        batch = worker.receive("q", "c")
        assert batch is not None
        worker.nack(batch, batch.messages[0], retry_after=100 * 365 * 86400)
        worker.ack(batch)
        for n in range(60):
            worker.send("q", "e", {"n": n})
            ticker.tick("q")
            while (batch := worker.receive("q", "c")) is not None:
                if batch.messages:
                    worker.nack(batch, batch.messages[0])
                worker.ack(batch)
            ticker.maintenance()
        with psycopg.connect(d.superuser_dsn()) as su:
            rows = scalar(su, "select count(*) from pgque.retry_queue")
            waiting = scalar(su, "select count(*) from pgque._retry_waiting")
        assert rows <= 2 * 2 * 4 + waiting, f"{rows} retry rows for {waiting} waiting"


# -- Promise 5: upgrade from the frozen 0.4.0 ------------------------------------------------

def test_upgrade_from_0_4_with_waiting_retries_and_open_batch_nacks(empty_dsn: str) -> None:
    from helpers import install_0_4
    install_0_4(empty_dsn)
    with pgque.connect(empty_dsn) as c:
        c.create_queue("q", max_retries=3)
        c.subscribe("q", "c")
        ids = c.send_batch("q", [("e", {"n": i}, None) for i in range(4)])
        c.tick("q")
        batch = c.receive("q", "c")
        assert batch is not None
        c.nack(batch, batch.messages[0])                    # due at once, not moved yet
        c.nack(batch, batch.messages[1], retry_after=3600)  # due in an hour
        bid = batch.batch_id
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.4.0"
        conn.execute("update pgque.rotation set rt_period = '0'")
        with pgque.connect(empty_dsn) as c:
            # the open batch's nacks repeated after the upgrade change nothing
            assert scalar(conn, "select pgque.nack('q', 'c', %s, %s::bigint[])",
                          (bid, [ids[0], ids[1]])) == 0
            assert scalar(conn, "select count(*) from pgque.retry_queue") == 2
            conn.execute("select pgque.ack('q', 'c', %s)", (bid,))
            back: list[int] = []
            for _ in range(5):
                c.maintenance()
                back += drain(c)
            assert back == [ids[0]]
            assert scalar(conn, "select retries_waiting from pgque.consumer_info"
                                " where consumer_name = 'c'") == 1
            conn.execute("update pgque.retry_queue set ev_retry_after = now()"
                         " where ev_id = %s", (ids[1],))
            for _ in range(5):
                c.maintenance()
                back += drain(c)
            assert back == [ids[0], ids[1]]
            assert scalar(conn, "select count(*) from pgque.retry_queue") == 0
            assert scalar(conn, "select count(*) from pgque.batch_nack") == 0


def test_two_serializable_handlers_nack_across_a_switch_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """The same as the REPEATABLE READ case, both handlers SERIALIZABLE."""
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    rotate(conn, "nack")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    b = batch.batch_id
    client.nack(batch, batch.messages[0])
    a = psycopg.connect(dsn)
    a.execute("set transaction isolation level serializable")
    scalar(a, "select 1")
    client.maintenance()
    assert part(conn, "nack") == 1
    t = psycopg.connect(dsn)
    t.execute("set transaction isolation level serializable")
    scalar(t, "select 1")
    scalar(a, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
    a.commit()
    a.close()
    try:
        scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
        t.commit()
    except psycopg.errors.SerializationFailure:
        t.rollback()
        scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
        t.commit()
    t.close()
    assert scalar(conn, "select count(*) from pgque.dead_letter where ev_id = %s",
                  (ids[1],)) == 1


def test_control_0_4_two_rr_handlers_renack_count_once(empty_dsn: str) -> None:
    """Control: the same two REPEATABLE READ handlers on the frozen 0.4.0 (one
    batch_nack table, key without a partition): the second nack fails with
    40001 and, retried, counts nothing."""
    from helpers import install_0_4
    install_0_4(empty_dsn)
    with pgque.connect(empty_dsn) as client, \
            psycopg.connect(empty_dsn, autocommit=True) as conn:
        client.create_queue("q", max_retries=0)
        client.subscribe("q", "c")
        ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None
        b = batch.batch_id
        a = psycopg.connect(empty_dsn)
        a.execute("set transaction isolation level repeatable read")
        scalar(a, "select 1")
        t = psycopg.connect(empty_dsn)
        t.execute("set transaction isolation level repeatable read")
        scalar(t, "select 1")
        assert scalar(a, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])",
                      (b, ids[1])) == 1
        a.commit()
        a.close()
        outcome = None
        try:
            scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (b, ids[1]))
            t.commit()
        except psycopg.errors.SerializationFailure:
            outcome = "40001"
            t.rollback()
            assert scalar(t, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])",
                          (b, ids[1])) == 0
            t.commit()
        t.close()
        assert outcome == "40001"
        assert scalar(conn, "select count(*) from pgque.dead_letter where ev_id = %s",
                      (ids[1],)) == 1


def test_a_nack_held_across_a_retry_switch_and_truncate_comes_back_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A's nack reads the retry partition written (0) and is held (a trigger on
    batch_nack_0, i.e. before its retry row is inserted) while maintenance moves
    the other consumer's retry, switches the retry queue to 1, and at the next
    pass empties partition 0 (TRUNCATE). A then inserts its retry into partition
    0, the one left: it must still come back, once."""
    client.create_queue("q", max_retries=5)
    client.subscribe("q", "c")
    client.subscribe("q", "o")
    conn.execute("update pgque.rotation set rt_period = '1 hour'")
    rotate(conn, "retry")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(2)])
    client.tick("q")
    batch = client.receive("q", "c")
    ob = client.receive("q", "o")
    assert batch is not None and ob is not None
    client.nack(ob, ob.messages[1])  # o's retry in retry partition 0
    client.ack(ob)
    conn.execute("""
        create function attack_hold() returns trigger language plpgsql as $$
        begin
            perform pg_advisory_lock(5153); perform pg_advisory_unlock(5153);
            return new;
        end $$;
        create trigger attack_hold before insert on pgque.batch_nack_0
            for each row execute function attack_hold();
        select pg_advisory_lock(5153);""")
    a = psycopg.connect(dsn, autocommit=True)
    a_pid = a.info.backend_pid
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(scalar(
        a, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (batch.batch_id, ids[0]))))
    th.start()
    wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (a_pid,)), what="A inside its nack")
    steps: list[Any] = []
    for _ in range(3):
        steps += client.maintenance()
    print(steps, part(conn, "retry"))
    assert part(conn, "retry") == 1
    assert ("rotate_retries" in [s for _q, s, _n in steps])
    conn.execute("select pg_advisory_unlock(5153)")
    th.join(10)
    assert out == [0]
    conn.execute("drop trigger attack_hold on pgque.batch_nack_0")
    print(conn.execute("select rq_part, ev_id from pgque._retry_waiting").fetchall())
    client.ack(batch)
    back_c: list[int] = []
    back_o: list[int] = []
    for _ in range(5):
        steps += client.maintenance()
        back_c += drain(client, "q", "c")
        back_o += drain(client, "q", "o")
    assert back_c == [ids[0]] and back_o == [ids[1]], (back_c, back_o, steps)


def test_a_slot_nack_repeated_across_nack_rotations_counts_once(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Partitioned (slot) consumers: a nack repeated in the still-open slot
    batch, across several switches and truncates of the nack records."""
    client.create_queue("q", max_retries=0)
    client.subscribe_slots("q", "g", slots=2)
    rotate(conn, "cursor", "tick", "nack", "retry")
    for i in range(6):
        client.send("q", "e", {"n": i}, partition_key=f"k{i}")
    client.tick("q")
    for s in range(2):
        assert client.claim_slot("q", "g", s)
    batches = [b for b in client.receive_slots("q", "g", slots=2, owned=range(2)) if b.messages]
    assert batches
    b = batches[0]
    assert client.nack(b, b.messages[0]) == 1
    for _ in range(4):
        client.maintenance()
        assert client.nack(b, b.messages[0]) == 0
    assert scalar(conn, "select count(*) from pgque.dead_letter where ev_id = %s",
                  (b.messages[0].id,)) == 1


def test_a_history_of_moved_retries_is_emptied_by_the_next_rotations(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """200k moved retries (an hour of 55 nacks/s) beside one retry due far
    ahead, all in one partition: the next two rotating passes copy the waiting
    one over and empty the rest, so no pass after them reads that history."""
    client.create_queue("q", max_retries=100)
    client.subscribe("q", "c")
    rotate(conn, "retry")
    client.send("q", "e", {})
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages[0], retry_after=86400)
    client.ack(batch)
    client.maintenance()
    p = scalar(conn, "select rq_part from pgque.retry_queue")
    conn.execute("""
        with r as (
            insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                           ev_retry, ev_type, ev_data, rq_part)
            select now() - interval '1 minute', s.sub_queue, s.sub_id, 1000000 + g, now(), 1,
                   'e', '{}', %s
              from pgque.subscription s, generate_series(1, 200000) g
            returning rq_id, rq_part)
        insert into pgque.retry_moved select rq_id, rq_part from r""", (p,))
    for _ in range(2):
        client.maintenance()
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 1
    assert scalar(conn, "select count(*) from pgque.retry_moved") == 0
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 1


def test_an_open_batch_keeps_its_nack_records_across_cursor_and_nack_rotations(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Every table rotating at every pass, another consumer busy (so the cursor
    log switches and moves), consumer c's batch held open: its nack, repeated at
    every pass, counts once (dead letter once), and its retries once."""
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    client.subscribe("q", "busy")
    rotate(conn, "cursor", "tick", "nack", "retry")
    ids = client.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    assert client.nack(batch, batch.messages[0]) == 1
    kinds: list[str] = []
    for n in range(30):
        client.send("q", "e", {"n": n})
        client.tick("q")
        while (ob := client.receive("q", "busy")) is not None:
            if ob.messages:
                client.nack(ob, ob.messages[0])  # a dead letter each (max_retries 0)
            client.ack(ob)
        kinds += [s for _q, s, _n in client.maintenance()]
        assert client.nack(batch, batch.messages[0]) == 0, f"pass {n}: {kinds}"
    # An open batch holds the nack records' rotation (documented); the others go on.
    assert kinds.count("rotate_nacks") >= 1 and kinds.count("rotate_cursors") >= 5
    assert scalar(conn, "select count(*) from pgque.dead_letter where ev_id = %s",
                  (ids[0],)) == 2  # c's and busy's
    client.ack(batch)


def test_upgrade_while_a_0_4_session_nacks_then_acks_in_one_transaction(empty_dsn: str) -> None:
    """A 0.4.0 worker's transaction has nacked (batch_nack, retry_queue written)
    when the upgrade starts; it then acks (the cursor) and commits. No
    deadlock, the upgrade finishes, the nack repeated while the upgrade waits (same
    transaction) counts nothing, and the retry comes back once."""
    from helpers import install_0_4
    install_0_4(empty_dsn)
    with pgque.connect(empty_dsn) as c:
        c.create_queue("q", max_retries=3)
        c.subscribe("q", "c")
        ids = c.send_batch("q", [("e", {"n": i}, None) for i in range(3)])
        c.tick("q")
        batch = c.receive("q", "c")
        assert batch is not None
        bid = batch.batch_id
    outcome: list[object] = []

    def upgrade() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                conn.execute("set deadlock_timeout = '200ms'")
                outcome.append(pgque.install(conn))
        except psycopg.Error as exc:
            outcome.append(exc)

    with psycopg.connect(empty_dsn) as w, psycopg.connect(empty_dsn, autocommit=True) as mon:
        w.execute("set deadlock_timeout = '200ms'")
        scalar(w, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])", (bid, ids[0]))
        th = threading.Thread(target=upgrade)
        th.start()
        wait_for(lambda: scalar(mon, "select count(*) from pg_stat_activity"
                                     " where datname = current_database()"
                                     " and wait_event_type = 'Lock'")
                 or not th.is_alive(), what="the upgrade waits for the worker")
        assert scalar(w, "select pgque.nack('q', 'c', %s, array[%s]::bigint[])",
                      (bid, ids[0])) == 0
        w.execute("select pgque.ack('q', 'c', %s)", (bid,))
        w.commit()
        th.join(60)
    assert outcome == ["0.4.0"]
    with pgque.connect(empty_dsn) as c, psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("update pgque.rotation set rt_period = '0'")
        back: list[int] = []
        for _ in range(5):
            c.maintenance()
            back += drain(c)
        assert back == [ids[0]]
        assert scalar(conn, "select count(*) from pgque._retry_waiting") == 0


def test_a_nack_while_a_nack_switch_is_uncommitted_then_repeated_counts_once(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A batch opened while a switch of the nack records is in flight (its id above
    the new boundary), nacked before the switch commits and again after it: its
    records go to one partition, so the repeat counts nothing."""
    client.create_queue("q", max_retries=10)
    client.subscribe("q", "c")
    rotate(conn, "nack")
    # A record in the partition written, so that the next pass switches.
    client.send("q", "e", 0)
    client.tick("q")
    first = client.receive("q", "c")
    assert first is not None
    client.nack(first, list(first))
    client.ack(first)
    with psycopg.connect(dsn) as switcher:  # one transaction, left open
        assert scalar(switcher, "select pgque._rotate_nacks()") is not None
        ev = client.send("q", "e", 1)
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None and [m.id for m in batch] == [ev]
        done = threading.Event()
        errors: list[BaseException] = []

        def nack_once() -> None:
            try:
                with pgque.connect(dsn, pool_size=0) as other:
                    other.conn.execute("select pgque.nack('q', 'c', %s, %s)",
                                       (batch.batch_id, [ev]))
            except BaseException as exc:
                errors.append(exc)
            done.set()

        thread = threading.Thread(target=nack_once)
        thread.start()
        # Either the nack has ended, or it waits for the switch to commit.
        wait_for(lambda: done.is_set() or scalar(
            conn, "select count(*) from pg_stat_activity where wait_event_type = 'Lock'"
                  " and query like '%%pgque.nack(%%'") == 1,
            what="the nack to end or to wait for the switch", dsn=dsn)
        switcher.commit()
        thread.join(20)
    assert errors == []
    client.nack(batch, list(batch))  # the repeat, after the switch
    client.ack(batch)
    assert len(records(conn, ev)) == 1
    assert scalar(conn, "select count(*) from pgque.retry_queue where ev_id = %s", (ev,)) == 1


def test_a_nack_waiting_for_the_nack_rotation_never_deadlocks_with_maintenance_copying_retries(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """Maintenance holds the nack rotation's row until it commits, and then copies
    the retries still waiting, whose foreign key share-locks their subscription's
    row; a nack holds that row (its receive lock) and waits for the rotation's.
    With the receive lock FOR UPDATE the foreign-key check waited for the nack:
    a deadlock (the test above hit it about once in twenty runs on PostgreSQL
    15). FOR NO KEY UPDATE does not block the check."""
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and len(batch.messages) == 1
    sub_id = scalar(conn, "select sub_id from pgque.subscription where sub_consumer = 'c'")
    outcome: list[BaseException | bool] = []
    with psycopg.connect(dsn) as maint, psycopg.connect(dsn, autocommit=True) as nacker_conn:
        maint.execute("select from pgque.rotation where rt_name = 'nack' for update")
        nacker_pid = nacker_conn.info.backend_pid

        def nack() -> None:
            try:
                pgque.Client(nacker_conn).nack(batch, batch.messages)
                outcome.append(True)
            except BaseException as exc:
                outcome.append(exc)
        thread = threading.Thread(target=nack)
        thread.start()
        wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity "
                                      "where pid = %s", (nacker_pid,)),
                 what="the nack waiting for the rotation's row", dsn=dsn)
        # What maintenance's copy of the retries does, foreign key and all.
        maint.execute("set local lock_timeout = '10s'")
        maint.execute("insert into pgque.batch_nack (bn_sub, bn_batch, bn_ev_id, bn_part) "
                      "values (%s, -1, -1, 0)", (sub_id,))
        maint.rollback()
        thread.join(30)
    assert outcome == [True]
