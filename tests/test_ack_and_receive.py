"""Ack and the next receive in one call (pgque.ack_receive_partitioned,
Client.ack_and_receive): a slot worked piece after piece gets exactly what
receive_partitioned + ack would give it, and a refused call acks nothing."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from helpers import owned_group
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)

SLOTS = 4


def fill(client: pgque.Client, per_tick: int, *, ticks: int = 1,
         **queue: Any) -> dict[int, list[int]]:
    """Queue q, group g of SLOTS slots all owned by ``client`` (helpers.owned_group)."""
    return owned_group(client, per_tick, ticks=ticks, slots=SLOTS, **queue)


def open_batch(client: pgque.Client, slot: int) -> int | None:
    [info] = [r for r in client.consumer_info("q") if r.consumer_name == f"g#{slot}/{SLOTS}"]
    return info.open_batch_id


def test_each_slot_gets_its_events_in_order_across_pieces_and_batches(
        client: pgque.Client) -> None:
    expected = fill(client, ticks=3, per_tick=90)
    for slot in range(SLOTS):
        got: list[int] = []
        calls = 0
        batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=4)
        while batch is not None:
            assert batch.slot == slot and len(batch) <= 4 and batch.fence is not None
            got += [m.id for m in batch]
            calls += 1
            batch = client.ack_and_receive(batch, max_events=4)
        assert got == expected[slot]
        assert calls >= len(expected[slot]) // 4
        # The last piece was acked by the call that found nothing after it.
        assert open_batch(client, slot) is None
        assert client.receive_partitioned("q", "g", slot=slot, slots=SLOTS) is None


def test_nacks_go_to_retry_with_the_ack(client: pgque.Client) -> None:
    expected = fill(client, ticks=1, per_tick=40)
    slot = max(expected, key=lambda k: len(expected[k]))
    batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=3)
    assert batch is not None
    failed = batch.messages[1]
    rest = client.ack_and_receive(batch, nack={failed.id: "broken"}, max_events=100)
    assert rest is not None and [m.id for m in rest] == expected[slot][3:]
    [info] = [r for r in client.consumer_info("q") if r.consumer_name == f"g#{slot}/{SLOTS}"]
    assert info.retries_waiting == 1
    assert client.ack_and_receive(rest) is None


def test_a_session_that_does_not_own_the_slot_acks_nothing(client: pgque.Client,
                                                            dsn: str) -> None:
    fill(client, ticks=1, per_tick=40)
    batch = client.receive_partitioned("q", "g", slot=1, slots=SLOTS, max_events=2)
    assert batch is not None
    with pgque.connect(dsn) as other, pytest.raises(pgque.SlotNotOwned):
        other.ack_and_receive(batch)
    assert open_batch(client, 1) == batch.batch_id
    # The owner gets the same piece again: nothing moved.
    again = client.receive_partitioned("q", "g", slot=1, slots=SLOTS, max_events=2)
    assert again is not None and [m.id for m in again] == [m.id for m in batch]


def test_a_stale_batch_or_bad_argument_changes_nothing(client: pgque.Client) -> None:
    fill(client, ticks=1, per_tick=40)
    first = client.receive_partitioned("q", "g", slot=2, slots=SLOTS)
    assert first is not None and client.ack(first)  # the whole first batch
    client.send_batch("q", [("e", {"n": n}, f"k{n % 30}") for n in range(40)])
    client.tick("q")
    second = client.receive_partitioned("q", "g", slot=2, slots=SLOTS, max_events=1)
    assert second is not None and second.batch_id != first.batch_id
    with pytest.raises(pgque.BatchNotActive):
        client.ack_and_receive(first)
    with pytest.raises(pgque.InvalidArgument):
        client.ack_and_receive(second, max_events=0)
    assert open_batch(client, 2) == second.batch_id
    again = client.receive_partitioned("q", "g", slot=2, slots=SLOTS, max_events=1)
    assert again is not None and [m.id for m in again] == [m.id for m in second]


def test_a_plain_batch_is_refused_before_any_call(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    with pytest.raises(ValueError, match="slot"):
        client.ack_and_receive(batch)
    assert client.ack(batch) is True  # still open: nothing was sent to the server


def test_a_reader_role_may_call_it(client: pgque.Client, dsn: str) -> None:
    expected = fill(client, ticks=1, per_tick=30)
    for slot in range(SLOTS):
        client.release_slot("q", "g", slot)
    name = f"pgque_test_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {name} login in role pgque_reader")
        su.execute("select pgque.grant_consumer('q', 'g', %s)", (name,))
        try:
            with pgque.connect(make_conninfo(**{**conninfo_to_dict(dsn), "user": name})) as rd:
                assert rd.claim_slot("q", "g", 0)
                got: list[int] = []
                batch = rd.receive_partitioned("q", "g", slot=0, slots=SLOTS, max_events=2)
                while batch is not None:
                    got += [m.id for m in batch]
                    batch = rd.ack_and_receive(batch, max_events=2)
                assert got == expected[0]
        finally:
            su.execute(f"drop owned by {name}")
            su.execute(f"drop role {name}")


def test_the_sql_function_refuses_a_non_owner_with_its_sqlstate(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    fill(client, ticks=1, per_tick=10)
    batch = client.receive_partitioned("q", "g", slot=0, slots=SLOTS)
    assert batch is not None
    with pytest.raises(psycopg.Error) as raised:
        conn.execute("select * from pgque.ack_receive_partitioned('q', 'g', 0, %s, %s, "
                     "'{}', '{}', '0', null)", (SLOTS, batch.batch_id))
    assert raised.value.sqlstate == "PQ024"
    assert open_batch(client, 0) == batch.batch_id


def test_the_next_piece_carries_the_epoch_and_a_new_claim_takes_a_new_one(
        client: pgque.Client) -> None:
    expected = fill(client, ticks=1, per_tick=60)
    slot = max(expected, key=lambda k: len(expected[k]))
    first = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2)
    assert first is not None and first.fence is not None
    second = client.ack_and_receive(first, max_events=2)
    assert second is not None and second.fence == first.fence
    assert all(m.fence == first.fence for m in second)
    # Released and claimed again by the same session: its old epoch ended. The
    # ack still holds (the session owns the slot), but the receive is left to
    # receive_partitioned, which takes the new epoch.
    assert client.release_slot("q", "g", slot) and client.claim_slot("q", "g", slot)
    assert client.ack_and_receive(second, max_events=2) is None
    third = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2)
    assert third is not None and third.fence is not None
    assert third.fence.epoch > first.fence.epoch
    assert [m.id for m in third] == expected[slot][4:6]
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(first.fence)
