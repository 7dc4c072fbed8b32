"""Idempotency keys: ``send(..., idempotency_key=...)``.

Within the queue's idempotency window a second send of a key writes nothing
and returns the first event's id, marked as a duplicate: in one session, in
one batch, and between two sessions sending at once (the second waits for the
first to commit or roll back). A rolled-back send leaves no key. The keys'
table rotates, emptied by TRUNCATE once its keys are past the window, and a
REPEATABLE READ sender whose snapshot predates a switch gets 40001.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from helpers import drain, scalar, wait_for

import pgque


@pytest.fixture
def queue(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")


def log_payloads(client: pgque.Client) -> list[Any]:
    client.tick("q")
    return [m.payload for m in drain(client, "q", "c")]


def key_rows(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "select count(*) from pgque.idempotency_key"))


@pytest.mark.usefixtures("queue")
def test_a_repeated_key_returns_the_first_id_and_writes_nothing(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    first = client.send("q", "e", "first", "k", idempotency_key="order-1")
    again = client.send("q", "e", "second", "k", idempotency_key="order-1")
    other = client.send("q", "e", "other", "k", idempotency_key="order-2")
    assert (int(again), again.duplicate, first.duplicate) == (first, True, False)
    assert other != first and not other.duplicate
    assert log_payloads(client) == ["first", "other"]
    # Another queue remembers its own keys.
    client.create_queue("q2")
    assert not client.send("q2", "e", 1, idempotency_key="order-1").duplicate


@pytest.mark.usefixtures("queue")
def test_a_batch_repeating_keys_sends_each_once_in_order(client: pgque.Client) -> None:
    """Duplicates within the batch and of an earlier send; ids ascending for what is sent."""
    earlier = client.send("q", "e", "earlier", idempotency_key="b")
    ids = client.send_batch("q", [pgque.Event("e", "a1", "k", idempotency_key="a"),
                                  pgque.Event("e", "b1", "k", idempotency_key="b"),
                                  pgque.Event("e", "a2", "k", idempotency_key="a"),
                                  pgque.Event("e", "plain", "k"),
                                  pgque.Event("e", "c1", "k", idempotency_key="c")])
    assert [i.duplicate for i in ids] == [False, True, True, False, False]
    assert ids[1] == earlier and ids[2] == ids[0]
    assert ids[0] < ids[3] < ids[4]
    assert log_payloads(client) == ["earlier", "a1", "plain", "c1"]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
@pytest.mark.usefixtures("queue")
def test_two_sessions_sending_one_key_at_once_make_one_event(
        client: pgque.Client, dsn: str, outcome: str) -> None:
    """B sends while A's send of the key is uncommitted: B waits; A commits and B
    gets A's id as a duplicate, or A rolls back and B sends its own. No error."""
    result: list[pgque.SentId] = []
    errors: list[BaseException] = []
    with psycopg.connect(dsn) as a_conn, psycopg.connect(dsn, autocommit=True) as b_conn:
        a, b = pgque.Client(a_conn), pgque.Client(b_conn)
        a_id = a.send("q", "e", "from A", idempotency_key="same")
        b_pid = b_conn.info.backend_pid

        def send_b() -> None:
            try:
                result.append(b.send("q", "e", "from B", idempotency_key="same"))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=send_b)
        thread.start()
        wait_for(lambda: scalar(client.conn, "select wait_event_type = 'Lock' from"
                                " pg_stat_activity where pid = %s", (b_pid,)) or None)
        getattr(a_conn, outcome)()
        thread.join(10)
        assert not thread.is_alive() and errors == []
    (b_id,) = result
    if outcome == "commit":
        assert (int(b_id), b_id.duplicate) == (a_id, True)
        assert log_payloads(client) == ["from A"]
    else:
        assert b_id != a_id and not b_id.duplicate
        assert log_payloads(client) == ["from B"]


@pytest.mark.usefixtures("queue")
def test_a_batch_repeating_an_uncommitted_batchs_keys_waits_and_takes_its_ids(
        client: pgque.Client, dsn: str) -> None:
    """A's batch [k1, k2, k3] uncommitted; B's [k3, new, k1] waits for it; A
    commits: B's k1 and k3 are A's events, only its new key sends, no error."""
    result: list[list[pgque.SentId]] = []
    with psycopg.connect(dsn) as a_conn, psycopg.connect(dsn, autocommit=True) as b_conn:
        a, b = pgque.Client(a_conn), pgque.Client(b_conn)
        a_ids = a.send_batch("q", [pgque.Event("e", k, idempotency_key=k)
                                   for k in ("k1", "k2", "k3")])
        thread = threading.Thread(target=lambda: result.append(b.send_batch(
            "q", [pgque.Event("e", k, idempotency_key=k) for k in ("k3", "new", "k1")])))
        thread.start()
        b_pid = b_conn.info.backend_pid
        wait_for(lambda: scalar(client.conn, "select wait_event_type = 'Lock' from"
                                " pg_stat_activity where pid = %s", (b_pid,)) or None)
        a_conn.commit()
        thread.join(10)
        assert not thread.is_alive()
    (b_ids,) = result
    assert [int(i) for i in b_ids] == [a_ids[2], b_ids[1], a_ids[0]]
    assert [i.duplicate for i in b_ids] == [True, False, True]
    assert log_payloads(client) == ["k1", "k2", "k3", "new"]


@pytest.mark.usefixtures("queue")
def test_a_rolled_back_send_leaves_no_key(client: pgque.Client, dsn: str,
                                          conn: psycopg.Connection[Any]) -> None:
    with psycopg.connect(dsn) as producer:
        pgque.Client(producer).send("q", "e", "lost", idempotency_key="k")
        producer.rollback()
    assert key_rows(conn) == 0
    assert not client.send("q", "e", "kept", idempotency_key="k").duplicate
    assert log_payloads(client) == ["kept"]


@pytest.mark.usefixtures("queue")
def test_a_delayed_duplicate_returns_the_first_sends_schedule(client: pgque.Client) -> None:
    first = client.send("q", "e", 1, deliver_after=3600, idempotency_key="later")
    again = client.send("q", "e", 2, idempotency_key="later")
    assert again.duplicate and int(again) == first
    assert again.deliver_at == first.deliver_at is not None


def window_passed(conn: psycopg.Connection[Any], since: Any, seconds: float) -> bool | None:
    return scalar(conn, "select clock_timestamp() > %s + make_interval(secs => %s)",
                  (since, seconds)) or None


@pytest.mark.usefixtures("queue")
def test_after_its_window_a_key_sends_again(client: pgque.Client,
                                            conn: psycopg.Connection[Any]) -> None:
    """A key past its window sends a new event; its expired record is replaced."""
    client.set_queue_config("q", idempotency_window=0.3)
    first = client.send("q", "e", "one", idempotency_key="k")
    sent_at = scalar(conn, "select ik_time from pgque.idempotency_key")
    assert client.send("q", "e", "dup", idempotency_key="k").duplicate
    wait_for(lambda: window_passed(conn, sent_at, 0.3))
    again = client.send("q", "e", "two", idempotency_key="k")
    assert not again.duplicate and again != first
    assert key_rows(conn) == 1
    assert client.queue_info("q")[0].idempotency_keys == 1
    # In a batch too: an expired key (and its repeat in the batch) sends again.
    batch_key = client.send("q", "e", "three", idempotency_key="b")
    wait_for(lambda: window_passed(conn, scalar(
        conn, "select ik_time from pgque.idempotency_key where ik_key = 'b'"), 0.3))
    ids = client.send_batch("q", [pgque.Event("e", "four", idempotency_key="b"),
                                  pgque.Event("e", "dup", idempotency_key="b")])
    assert ids[0] != batch_key and [i.duplicate for i in ids] == [False, True]
    assert ids[1] == ids[0]
    assert key_rows(conn) == 2
    assert log_payloads(client) == ["one", "two", "three", "four"]


@pytest.mark.usefixtures("queue")
def test_the_keys_rotate_by_truncate_and_are_remembered_across_a_switch(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """With a 0.5 s window: a switch leaves a key in the partition not written,
    still found; once the window has passed since the switch, that partition is
    emptied and the key sends again. No row updated or deleted."""
    client.set_queue_config("q", idempotency_window=0.5)
    conn.execute("update pgque.rotation set rt_time = now() - interval '1 hour'"
                 " where rt_name = 'idempotency'")
    conn.execute("select pg_stat_force_next_flush()")
    writes = ("select coalesce(sum(n_tup_upd + n_tup_del), 0) from pg_stat_user_tables"
              " where relname ~ '^idempotency_key'")
    before = scalar(conn, writes)
    first = client.send("q", "e", "one", idempotency_key="k")
    assert "rotate_idempotency" in [s for _q, s, _n in client.maintenance()]  # the switch
    assert scalar(conn, "select count(*) from pgque.idempotency_key_0") == 1
    assert int(client.send("q", "e", "dup", idempotency_key="k")) == first
    switched = scalar(conn, "select rt_time from pgque.rotation where rt_name = 'idempotency'")
    wait_for(lambda: window_passed(conn, switched, 0.5))
    assert "rotate_idempotency" in [s for _q, s, _n in client.maintenance()]
    assert key_rows(conn) == 0
    assert not client.send("q", "e", "two", idempotency_key="k").duplicate
    conn.execute("select pg_stat_force_next_flush()")
    assert scalar(conn, writes) == before
    assert log_payloads(client) == ["one", "two"]


@pytest.mark.usefixtures("queue")
def test_repeatable_read_across_a_switch_fails_to_serialize(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """Its snapshot predates the switch, so it might not see a key recorded in the
    partition left: 40001, and nothing written; a retry sends."""
    client.send("q", "e", "seed", idempotency_key="seed")
    conn.execute("update pgque.rotation set rt_time = now() - interval '2 days'"
                 " where rt_name = 'idempotency'")
    with psycopg.connect(dsn) as rr:
        rr.execute("set transaction isolation level repeatable read")
        rr.execute("select 1")  # the snapshot
        assert "rotate_idempotency" in [s for _q, s, _n in client.maintenance()]
        with pytest.raises(psycopg.errors.SerializationFailure):
            pgque.Client(rr).send("q", "e", "rr", idempotency_key="rr")
        rr.rollback()
        assert not pgque.Client(rr).send("q", "e", "rr", idempotency_key="rr").duplicate
        rr.commit()
    assert log_payloads(client) == ["seed", "rr"]


@pytest.mark.usefixtures("queue")
def test_bad_keys_and_windows_raise_and_write_nothing(client: pgque.Client,
                                                      conn: psycopg.Connection[Any]) -> None:
    client.send("q", "e", 1, idempotency_key="ok")
    before = (key_rows(conn), scalar(conn, "select count(*) from pgque.event_1"))
    with pytest.raises(pgque.InvalidIdempotencyKey, match="empty"):
        client.send("q", "e", 1, idempotency_key="")
    with pytest.raises(pgque.InvalidIdempotencyKey, match="longer than 512 bytes"):
        client.send("q", "e", 1, idempotency_key="é" * 257)
    with pytest.raises(pgque.InvalidIdempotencyKey):  # one bad key: none of the batch
        client.send_batch("q", [pgque.Event("e", 1, idempotency_key="fine"),
                                pgque.Event("e", 2, idempotency_key="")])
    for window in (0, -1, 31 * 86400, "forever"):
        with pytest.raises(pgque.InvalidConfig):
            client.set_queue_config("q", idempotency_window=window)
    assert client.queue_config("q")["idempotency_window"] == 86400
    assert (key_rows(conn), scalar(conn, "select count(*) from pgque.event_1")) == before
    assert not client.send("q", "e", 1, idempotency_key="k" * 512).duplicate


def test_a_sent_id_prints_formats_and_encodes_as_its_int() -> None:
    """A SentId is used where an id was: printed, formatted, in JSON, in a payload."""
    import json

    from pgque.codec import encode_payload

    sent = pgque.SentId.of(42, True, None)
    assert (str(sent), f"{sent}", f"{sent:>4}", f"{sent:d}") == ("42", "42", "  42", "42")
    assert json.dumps({"id": sent}) == '{"id": 42}'
    assert encode_payload({"ref": sent}) == '{"ref":42}'
    assert sent == 42 and hash(sent) == hash(42) and sent.duplicate
    assert repr(sent) == "SentId(42, duplicate)"
    assert not pgque.SentId(7).duplicate and pgque.SentId(7).deliver_at is None


@pytest.mark.usefixtures("queue")
def test_a_switch_is_dated_by_the_clock_not_by_maintenances_start(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A key committed after a maintenance transaction began but before its switch
    stays in the partition left: the switch's time must not be earlier than that
    key, or the partition would be emptied before the key's window ends."""
    client.set_queue_config("q", idempotency_window=0.5)
    conn.execute("update pgque.rotation set rt_time = now() - interval '1 hour'"
                 " where rt_name = 'idempotency'")
    client.send("q", "e", "seed", idempotency_key="seed")
    with psycopg.connect(dsn) as maint:
        maint.execute("select now()")  # the transaction's start
        client.send("q", "e", "late", idempotency_key="late")
        assert "rotate_idempotency" in [r[1] for r in maint.execute(
            "select * from pgque.maint()").fetchall()]
        maint.commit()
    assert scalar(conn, "select rt_time >= (select ik_time from pgque.idempotency_key"
                        "                   where ik_key = 'late')"
                        "  from pgque.rotation where rt_name = 'idempotency'")
