"""The records pgque hands back are frozen and typed: info calls return QueueInfo,
ConsumerInfo and SlotStatus, group_status states the group's facts once, and an
event is the columns pgque uses (no ev_extra2..4). A setting is never reported
as the opposite of what it is, the CLI's JSON is the records, and each field
of a Message, received in binary, is what a text-mode read of the event table
gives.

The tests marked both_clients run with the Client and the AsyncClient (conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pgtest
import psycopg
import pytest
from helpers import dbname, scalar, wait_for
from hypothesis import given
from hypothesis import strategies as st

import pgque
from pgque.info import from_row

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.both_clients
def test_info_calls_return_typed_records(client: pgque.Client) -> None:
    client.create_queue("q", max_retries=0)
    client.create_queue("other")
    client.subscribe("q", "c")
    client.subscribe_slots("q", "g", slots=2)
    client.send("q", "e", 1, partition_key="k")
    client.tick("q")

    [queue] = client.queue_info("q")
    assert isinstance(queue, pgque.QueueInfo)
    assert (queue.queue_name, queue.consumers, queue.max_retries) == ("q", 3, 0)
    assert isinstance(queue.rotation_period, timedelta)
    assert isinstance(queue.last_tick_time, datetime) and queue.last_tick_id is not None
    assert [q.queue_name for q in client.queue_info()] == ["other", "q"]
    assert client.queue_info("missing") == []

    consumers = client.consumer_info("q")
    assert all(isinstance(c, pgque.ConsumerInfo) for c in consumers)
    assert [c.consumer_name for c in consumers] == ["c", "g#0/2", "g#1/2"]
    assert consumers[0].ticks_behind == 1 and consumers[0].open_batch_id is None

    # A dead letter of a slot is counted on that slot's row.
    slot = scalar(client.conn, "select (hashtextextended('k', 0) %% 2 + 2) %% 2")
    assert client.claim_slot("q", "g", slot)
    batch = client.receive_partitioned("q", "g", slot=slot, slots=2)
    assert batch is not None and len(batch) == 1
    assert client.nack(batch, batch.messages[0], reason="bad") == 1  # max_retries 0: dead
    client.ack(batch)
    slots = client.partition_slot_status("q")
    assert all(isinstance(s, pgque.SlotStatus) for s in slots)
    assert [(s.slot, s.slots, s.dead_letters) for s in slots] == [
        (n, 2, 1 if n == slot else 0) for n in range(2)]
    assert [s.owner_pid for s in slots if s.slot == slot] == [client.conn.info.backend_pid]
    assert not any(s.stalled for s in slots)
    # The slot's epoch came with its batch; the other slot has none yet.
    assert batch.fence is not None
    assert [s.epoch for s in slots] == [batch.fence.epoch if n == slot else None
                                        for n in range(2)]
    assert all(s.stalled_after == timedelta(minutes=2) for s in slots)
    assert queue.stalled_after == timedelta(minutes=2) and queue.stalled is False
    [group] = client.group_info("q")
    assert isinstance(group, pgque.GroupInfo)
    assert (group.consumer_name, group.slots, group.members, group.owned_slots,
            group.newest_epoch) == ("g", 2, 0, 1, batch.fence.epoch)
    ticker = client.ticker_info()
    assert isinstance(ticker, pgque.TickerInfo) and ticker.active_pid is None

    # Records are plain data: a dict, or JSON.
    document = msgspec.json.decode(msgspec.json.encode(slots[slot]))
    assert document["dead_letters"] == 1 and document["consumer_name"] == "g"
    assert msgspec.structs.asdict(queue)["queue_name"] == "q"


@pytest.mark.both_clients
def test_a_record_ignores_columns_a_newer_schema_adds(client: pgque.Client) -> None:
    """A client keeps working while the schema it talks to is newer than itself."""
    client.create_queue("q")
    [queue] = client.queue_info("q")
    row = {**msgspec.structs.asdict(queue), "column_from_the_future": 1}
    assert from_row(pgque.QueueInfo, row) == queue


@pytest.mark.both_clients
def test_group_status_states_the_group_once(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=3)
    assert client.join_group("q", "g")
    assert client.claim_slot("q", "g", 2)
    with pgque.connect(dsn) as other:
        assert other.join_group("q", "g")
        assert other.claim_slot("q", "g", 0)
        # In SQL, one row for the group, not one per slot.
        rows = client.conn.execute(
            "select members, my_rank, my_pid, owner_pids from pgque.group_status('q', 'g')"
        ).fetchall()
        me, them = client.conn.info.backend_pid, other.conn.info.backend_pid
        assert len(rows) == 1
        assert rows[0][0] == 2 and rows[0][2] == me and rows[0][3] == [them, None, me]

        status = client.group_status("q", "g")
        assert isinstance(status, pgque.GroupStatus)
        assert status.members == 2 and status.my_rank == (0 if me < them else 1)
        assert status.slots == (pgque.SlotOwner(0, them, False), pgque.SlotOwner(1, None, False),
                                pgque.SlotOwner(2, me, True))
        assert status.owned == [2]
        shares = [client.group_status("q", "g").fair_share(),
                  other.group_status("q", "g").fair_share()]
        assert sorted(shares) == [1, 2]
    # Not a member: no rank and no share.
    with pgque.connect(dsn) as outsider:
        status = outsider.group_status("q", "g")
        assert status.my_rank is None and status.fair_share() == 0 and status.owned == []


@pytest.mark.both_clients
def test_stalled_after_is_the_callers_or_the_queues(client: pgque.Client) -> None:
    """The info calls judge stalls by the threshold given, else by the queue's own:
    twice its ticker_idle_period, at least 10 seconds."""
    client.create_queue("q", ticker_idle_period=30)
    client.create_queue("brisk", ticker_idle_period=0.5)
    client.subscribe_slots("q", "g", slots=1)
    client.send("q", "e", 1)  # not ticked

    assert [(q.queue_name, q.stalled_after, q.stalled) for q in client.queue_info()] == [
        ("brisk", timedelta(seconds=10), False), ("q", timedelta(minutes=1), False)]
    [slot] = client.partition_slot_status("q")
    assert (slot.stalled_after, slot.stalled) == (timedelta(minutes=1), False)

    for after in (0, timedelta(0), "0 seconds"):
        assert [q.stalled for q in client.queue_info(stalled_after=after)] == [False, True]
        [slot] = client.partition_slot_status("q", stalled_after=after)
        assert (slot.stalled_after, slot.stalled) == (timedelta(0), True)
    # In SQL: the functions under the views take it; the views use the queue's.
    assert client.conn.execute(
        "select stalled_after, stalled from pgque.get_queue_info('1 hour') "
        "where queue_name = 'q'").fetchall() == [(timedelta(hours=1), False)]
    assert client.conn.execute(
        "select stalled from pgque.get_partition_slot_status('0')").fetchall() == [(True,)]
    assert client.conn.execute(
        "select stalled from pgque.partition_slot_status").fetchall() == [(False,)]
    for call in (lambda: client.queue_info(stalled_after=-1),
                 lambda: client.partition_slot_status(stalled_after=timedelta(seconds=-1))):
        with pytest.raises(pgque.InvalidArgument, match="stalled_after"):
            call()


@pytest.mark.both_clients
def test_group_info_counts_members_and_owned_slots(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=3)
    client.subscribe_slots("q", "idle", slots=2)
    assert client.join_group("q", "g") and client.claim_slot("q", "g", 1)
    with pgque.connect(dsn) as other:
        assert other.join_group("q", "g") and other.claim_slot("q", "g", 2)
        infos = client.group_info()
        assert [(i.consumer_name, i.slots, i.members, i.owned_slots, i.newest_epoch)
                for i in infos] == [("g", 3, 2, 2, None), ("idle", 2, 0, 0, None)]
        assert client.group_info("other") == []
    # The other session's locks go when its backend has ended, a moment after the close.
    wait_for(lambda: client.group_info("q")[0].members == 1, what="the other member gone")
    assert client.group_info("q")[0].owned_slots == 1


@pytest.mark.both_clients
def test_ticker_info_names_the_active_ticker(client: pgque.Client, dsn: str) -> None:
    assert client.ticker_info() == pgque.TickerInfo(None, None)
    with pgque.connect(dsn, application_name="ops-ticker") as ticker:
        assert ticker.claim_ticker()
        assert client.ticker_info() == pgque.TickerInfo(ticker.conn.info.backend_pid,
                                                        "ops-ticker")


@pytest.mark.both_clients
@given(slots=st.integers(1, 64), members=st.integers(1, 70))
def test_fair_shares_add_up_to_the_slots(slots: int, members: int) -> None:
    owners = tuple(pgque.SlotOwner(n, None, False) for n in range(slots))
    shares = [pgque.GroupStatus(members, rank, owners).fair_share() for rank in range(members)]
    assert sum(shares) == slots
    assert max(shares) - min(shares) <= 1


@pytest.mark.both_clients
def test_events_carry_only_the_columns_pgque_uses(client: pgque.Client) -> None:
    """ev_extra2..4 came from PgQ's event shape; no pgque function set them."""
    client.create_queue("q")
    columns = {
        table: [r[0] for r in client.conn.execute(
            "select attname from pg_attribute where attrelid = %s::regclass and attnum > 0 "
            "and not attisdropped order by attnum", (table,))]
        for table in ("pgque.batch_event", "pgque.event_template", "pgque.retry_queue",
                      "pgque.dead_letter", "pgque.event_1", "pgque.event_1_0")}
    for table, names in columns.items():
        assert "ev_extra1" in names, table
        assert not {"ev_extra2", "ev_extra3", "ev_extra4"} & set(names), table
    assert columns["pgque.batch_event"] == ["batch_id", "ev_id", "ev_time", "ev_retry", "ev_type",
                                            "ev_data", "ev_extra1", "epoch", "slot", "delayed_id"]
    # A delayed event's new id in the log, and the id its send returned.
    for table in ("pgque.event_template", "pgque.event_1", "pgque.event_1_0"):
        assert columns[table][-1] == "ev_delayed_id", table
    assert not hasattr(pgque.Message(1, "t", None, None, 0, datetime.now()), "extra")


def test_an_infinite_interval_setting_is_not_reported_as_zero(
        client: pgque.Client, pg_server: pgtest.PgServer) -> None:
    """On PostgreSQL 17 and later 'infinity' is an interval: create_queue either
    refuses it for rotation_period (InvalidConfig, as PostgreSQL 15 does) or
    reports it as what it is, never as timedelta(0) in QueueInfo, and in seconds
    in queue_config() (docs/api.md)."""
    if pg_server.major_version < 17:
        pytest.skip("infinite intervals exist from PostgreSQL 17")
    try:
        client.create_queue("q", rotation_period="infinity")
    except pgque.InvalidConfig:
        return
    [info] = client.queue_info("q")
    assert info.rotation_period != timedelta(0)
    assert isinstance(client.queue_config("q")["rotation_period"], (int, float))


def test_cli_json_status_and_queue_list_are_the_records(dsn: str) -> None:
    """`pgque status --json` is {ticker, queues, consumers, groups, slots,
    generated} with
    one object per record, the records' fields as keys, intervals as seconds,
    times as ISO 8601 and unset values null; `pgque queue list --json` is the
    QueueInfo list; a queue that is not there fails with exit code 1."""
    with pgque.connect(dsn) as client:
        client.create_queue("q")
        client.subscribe("q", "p")
        client.subscribe_slots("q", "g", slots=2)
        client.send("q", "e", {"a": 1}, partition_key="k")
    env = {**os.environ, "PGQUE_DSN": dsn, "PYTHONPATH": str(ROOT)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pgque.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    done = cli("status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert set(status) == {"ticker", "queues", "consumers", "groups", "slots", "generated"}
    assert {frozenset(g) for g in status["generated"]} == {
        frozenset(pgque.GeneratedCode.__struct_fields__)}
    assert [set(g) for g in status["groups"]] == [set(pgque.GroupInfo.__struct_fields__)]
    assert [set(q) for q in status["queues"]] == [set(pgque.QueueInfo.__struct_fields__)]
    assert {frozenset(c) for c in status["consumers"]} == {
        frozenset(pgque.ConsumerInfo.__struct_fields__)}
    assert [s["slot"] for s in status["slots"]] == [0, 1]
    assert set(status["slots"][0]) == set(pgque.SlotStatus.__struct_fields__)
    assert status["slots"][0]["owner_pid"] is None
    assert status["queues"][0]["rotation_period"] == 7200.0
    assert status["queues"][0]["events_since_last_tick"] == 1
    listed = cli("queue", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [q["queue_name"] for q in json.loads(listed.stdout)] == ["q"]
    missing = cli("status", "--json", "nope")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


# -- Messages received in binary: what a text-mode read gives ----------------------------------


class Order(msgspec.Struct):
    n: int
    text: str


PAYLOAD_CASES: list[tuple[Any, str | None]] = [
    ({"n": 1, "text": "plain"}, "k-1"),
    (None, None),
    ({"n": 2, "text": "ünïcödé ✓ 日本語 עברית \U0001f600 e\u0301"}, "ключ-\U0001f511"),
    ({"n": 3, "text": "nul \u0000 and quotes \" ' \\ and newlines \n\r\t"}, ""),
    ({"n": 4, "text": "x" * 1_500_000}, "é" * 256),
    ({"n": 5, "text": "big ints", "i": 2**63 - 1, "f": 1e308}, "k-5"),
    ([1, "two", None, {"three": [3]}], "k-6"),
    ("just a string", None),
    (12345678901234567890, "k-8"),
]


def stored_rows(dsn: str, timezone: str) -> dict[tuple[int, int], tuple[Any, ...]]:
    """The event table read in text mode by a session of that TimeZone (and
    psycopg's DateStyle, ISO), by (ev_id, ev_retry): a retried event is in the
    log twice."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select set_config('TimeZone', %s, false)", (timezone,))
        with conn.cursor(binary=False) as cur:
            cur.execute("select ev_id, ev_type, ev_data, ev_extra1, ev_retry, ev_time"
                        " from pgque.event_1")
            return {(row[0], row[4]): row for row in cur.fetchall()}


def check_messages(batch: pgque.Batch[Any] | None,
                   stored: dict[tuple[int, int], tuple[Any, ...]],
                   payload_type: Any = None) -> list[int]:
    """Every message of ``batch`` is its row of ``stored``, field by field, with
    the types text mode gives; returns their ids."""
    assert batch is not None
    for m in batch:
        ev_id, ev_type, ev_data, key, retry, time = stored[m.id, m.retry_count]
        assert (m.id, m.type, m.data, m.partition_key, m.retry_count) == (
            ev_id, ev_type, ev_data, key, retry)
        assert type(m.id) is int and type(m.retry_count) is int and type(m.type) is str
        assert m.data is None or type(m.data) is str
        assert m.partition_key is None or type(m.partition_key) is str
        # The same aware datetime: the instant, the offset and the zone.
        assert m.created_at == time
        assert m.created_at.tzinfo == time.tzinfo, (m.created_at, time)
        assert m.created_at.isoformat() == time.isoformat()
        assert m.created_at.utcoffset() == time.utcoffset()
        if payload_type is None:
            assert m.payload == (None if ev_data is None else msgspec.json.decode(ev_data))
        elif ev_data is not None and ev_data.startswith('{"n"'):
            assert m.payload == msgspec.json.decode(ev_data, type=payload_type)
    if batch.fence is not None:
        assert type(batch.fence.epoch) is int and batch.fence.epoch > 0
        assert all(m.fence == batch.fence for m in batch)
    return [m.id for m in batch]


def fill_everything(client: pgque.Client, slots: int) -> list[int]:
    """Queue q with consumer c and group g (every slot claimed), the payload cases
    sent, one of them nacked and retried (retry count 1), ticked."""
    client.create_queue("q")
    client.subscribe("q", "c")
    client.subscribe("q", "r")
    client.subscribe_slots("q", "g", slots=slots)
    client.maintenance()
    ids = client.send_batch("q", [("Case", payload, key) for payload, key in PAYLOAD_CASES])
    ids.append(client.send("q", "Single", {"n": 9, "text": "one by one"}, partition_key="k-9"))
    client.tick("q")
    batch = client.receive("q", "r")
    assert batch is not None
    client.ack(batch, nack=[batch.messages[0]])
    client.maintenance("q")  # the retry goes back into the log, ev_retry 1
    client.tick("q")
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    return ids


@pytest.mark.both_clients
@pytest.mark.parametrize("timezone", ["UTC", "America/St_Johns", "UTC+3", "<+0545>-05:45",
                                      "Pacific/Chatham"])
def test_every_receive_path_gives_what_text_mode_reads(
        client: pgque.Client, dsn: str, timezone: str) -> None:
    """Every receive path (receive, with a payload type or without, receive_slots,
    ack_and_receive, receive_partitioned) reads its rows in binary and gives each
    field of a Message as a text-mode read of the event table gives it, whatever
    the session's TimeZone, DateStyle and IntervalStyle: NULLs, unicode, NUL
    characters, large payloads and numbers, a retried event."""
    slots = 3
    client.conn.execute("select set_config('TimeZone', %s, false),"
                        " set_config('DateStyle', 'SQL, DMY', false),"
                        " set_config('IntervalStyle', 'sql_standard', false)", (timezone,))
    ids = fill_everything(client, slots)
    stored = stored_rows(dsn, timezone)
    assert any(row[4] == 1 for row in stored.values())  # a retried event is in the table
    seen = check_messages(client.receive("q", "c"), stored)
    seen += check_messages(client.receive("q", "r", payload_type=Order), stored, Order)
    [first, *rest] = client.receive_slots("q", "g", slots=slots, owned=range(slots),
                                          max_events=1)
    seen += check_messages(first, stored) + [i for b in rest for i in check_messages(b, stored)]
    seen += check_messages(client.ack_and_receive(first, max_events=100, payload_type=Order),
                           stored, Order)
    client.ack_slots(rest)
    for batch in rest:
        assert batch.slot is not None
        again = client.receive_partitioned("q", "g", slot=batch.slot, slots=slots)
        if again is not None:
            seen += check_messages(again, stored)
    # Every event of the table came through a plain consumer and the group.
    assert set(ids) <= set(seen)
    assert len(seen) >= 2 * len(ids)


@pytest.mark.both_clients
def test_binary_receives_through_pgbouncer(client: pgque.Client, dsn: str, pgbouncer: Any,
                                           pgbouncer_session: Any) -> None:
    """A plain consumer through a transaction-mode pooler, and a group (which needs
    a session) through a session-mode one: the same fields as a direct read."""
    slots = 2
    ids = fill_everything(client, slots)
    for slot in range(slots):
        client.release_slot("q", "g", slot)
    stored = stored_rows(dsn, "Asia/Kathmandu")
    with pgque.connect(pgbouncer.dsn(dbname(dsn)), prepare_threshold=None) as pooled:
        pooled.conn.execute("set TimeZone = 'Asia/Kathmandu'")
        seen = check_messages(pooled.receive("q", "c", max_events=3), stored)
        for _ in range(3):  # repeat receives: each may land on another server session
            seen += check_messages(pooled.receive("q", "c", max_events=3), stored)
        assert seen[:3] == seen[3:6]
        batch = pooled.receive("q", "r", payload_type=Order)
        check_messages(batch, stored, Order)
        assert batch is not None and pooled.ack(batch)
    with pgque.connect(pgbouncer_session.dsn(dbname(dsn))) as session:
        session.conn.execute("set TimeZone = 'America/St_Johns'")
        stored = stored_rows(dsn, "America/St_Johns")
        for slot in range(slots):
            assert session.claim_slot("q", "g", slot)
        got = [i for b in session.receive_slots("q", "g", slots=slots, owned=range(slots))
               for i in check_messages(b, stored)]
        assert set(got) >= set(ids) - {ids[0]}
