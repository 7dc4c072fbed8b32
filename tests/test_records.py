"""The records pgque hands back are frozen and typed: info calls return QueueInfo,
ConsumerInfo and SlotStatus, group_status states the group's facts once, and an
event is the columns pgque uses (no ev_extra2..4)."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec
import pytest
from helpers import scalar
from hypothesis import given
from hypothesis import strategies as st

import pgque
from pgque.info import from_row

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


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

    # Records are plain data: a dict, or JSON.
    document = msgspec.json.decode(msgspec.json.encode(slots[slot]))
    assert document["dead_letters"] == 1 and document["consumer_name"] == "g"
    assert msgspec.structs.asdict(queue)["queue_name"] == "q"


def test_a_record_ignores_columns_a_newer_schema_adds(client: pgque.Client) -> None:
    """A client keeps working while the schema it talks to is newer than itself."""
    client.create_queue("q")
    [queue] = client.queue_info("q")
    row = {**msgspec.structs.asdict(queue), "column_from_the_future": 1}
    assert from_row(pgque.QueueInfo, row) == queue


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


@given(slots=st.integers(1, 64), members=st.integers(1, 70))
def test_fair_shares_add_up_to_the_slots(slots: int, members: int) -> None:
    owners = tuple(pgque.SlotOwner(n, None, False) for n in range(slots))
    shares = [pgque.GroupStatus(members, rank, owners).fair_share() for rank in range(members)]
    assert sum(shares) == slots
    assert max(shares) - min(shares) <= 1


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
                                            "ev_data", "ev_extra1", "epoch"]
    assert not hasattr(pgque.Message(1, "t", None, None, 0, datetime.now()), "extra")
