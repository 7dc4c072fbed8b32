"""Several slots in one call (pgque/sql/code/69_slot_sets.sql): receive_slots gives
each owned slot exactly the piece receive_partitioned would, ack_slots acks
them all or none, and neither lets a session touch a slot it does not own."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import scalar

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


def fill(client: pgque.Client, slots: int, events: int) -> dict[int, list[int]]:
    """A queue q with a group g of ``slots`` slots, all owned by ``client``, and
    ``events`` events over 40 keys in one tick; returns each slot's ids in order."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    client.maintenance()
    ids = client.send_batch("q", [("e", {"n": n}, f"k{n % 40}") for n in range(events)])
    client.tick("q")
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    by_slot: dict[int, list[int]] = {k: [] for k in range(slots)}
    for n, ev in enumerate(ids):
        slot = scalar(client.conn, "select pgque.slot_of(%s, %s)", (f"k{n % 40}", slots))
        by_slot[slot].append(ev)
    return by_slot


def test_every_slot_gets_its_own_events_in_order_in_pieces(client: pgque.Client) -> None:
    expected = fill(client, 4, 200)
    got: dict[int, list[int]] = {k: [] for k in range(4)}
    calls = 0
    while batches := client.receive_slots("q", "g", slots=4, owned=[3, 0, 1, 2], max_events=7):
        calls += 1
        assert [b.slot for b in batches] == sorted(b.slot for b in batches)  # ascending
        for batch in batches:
            assert batch.slots == 4 and len(batch) <= 7 and batch.fence is not None
            got[batch.slot].extend(m.id for m in batch)
        finished = client.ack_slots(batches)
        assert len(finished) == len(batches)
    assert got == expected
    assert calls >= max(len(ids) for ids in expected.values()) // 7
    # Nothing left for anyone.
    for slot in range(4):
        assert client.receive_partitioned("q", "g", slot=slot, slots=4) is None


def test_it_is_what_receive_partitioned_returns_slot_by_slot(client: pgque.Client,
                                                             dsn: str) -> None:
    expected = fill(client, 4, 60)
    batches = client.receive_slots("q", "g", slots=4, owned=range(4))
    assert {b.slot: [m.id for m in b] for b in batches} == {
        k: ids for k, ids in expected.items() if ids}
    # Received, not acked: each slot's open batch is what receive_partitioned
    # gives again, the same batch.
    for batch in batches:
        again = client.receive_partitioned("q", "g", slot=batch.slot, slots=4)
        assert again is not None and again.batch_id == batch.batch_id
    assert client.ack_slots(batches) == [True] * len(batches)


def test_a_slot_not_owned_receives_nothing_at_all(client: pgque.Client, dsn: str) -> None:
    fill(client, 4, 60)
    assert client.release_slot("q", "g", 2)
    with pgque.connect(dsn) as other:
        assert other.claim_slot("q", "g", 2)
        with pytest.raises(pgque.SlotNotOwned):
            client.receive_slots("q", "g", slots=4, owned=[0, 1, 2])
        # Nothing was opened for 0 and 1 by the failed call.
        cursors = client.conn.execute(
            "select count(*) from pgque.subscription s"
            " cross join lateral pgque._current_cursor(s.sub_id) c"
            " where s.sub_consumer like 'g#%%' and c.cur_batch is not null").fetchone()
        assert cursors == (0,)
        mine = client.receive_slots("q", "g", slots=4, owned=[0, 1])
        assert [b.slot for b in mine] == [0, 1]
        with pytest.raises(pgque.SlotNotOwned):
            other.ack_slots(mine)
        # Slot 2 is acked after 0 and 1 (ascending) and refused: so are they.
        theirs = pgque.Batch(queue="q", consumer="g", batch_id=0, messages=[], slot=2, slots=4)
        with pytest.raises(pgque.SlotNotOwned):
            client.ack_slots([*mine, theirs])
        # The failed ack acked none of mine: they are still open.
        for batch in mine:
            again = client.receive_partitioned("q", "g", slot=batch.slot, slots=4)
            assert again is not None and again.batch_id == batch.batch_id
        assert client.ack_slots(mine) == [True] * len(mine)


def test_nacks_go_with_their_own_piece(client: pgque.Client) -> None:
    fill(client, 2, 40)
    batches = client.receive_slots("q", "g", slots=2, owned=[0, 1])
    assert len(batches) == 2
    doomed = batches[1].messages[0].id
    client.ack_slots(batches, nack={doomed: "boom"}, retry_after=0)
    client.maintenance()  # the retry goes back into the log
    client.tick("q")
    again = client.receive_slots("q", "g", slots=2, owned=[0, 1])
    assert [(b.slot, [m.id for m in b]) for b in again] == [(1, [doomed])]
    assert again[0].messages[0].retry_count == 1
    with pytest.raises(ValueError, match="none of these batches"):
        client.ack_slots(again, nack=[doomed + 10_000])
    client.ack_slots(again)


def test_a_stale_batch_acks_none_of_them(client: pgque.Client) -> None:
    fill(client, 2, 40)
    batches = client.receive_slots("q", "g", slots=2, owned=[0, 1])
    client.ack(batches[1])  # acked on its own: its id is no longer open
    with pytest.raises(pgque.BatchNotActive):
        client.ack_slots(batches, nack=[batches[0].messages[0].id])
    with pytest.raises(pgque.BatchNotActive):
        client.ack_slots(batches)
    again = client.receive_partitioned("q", "g", slot=0, slots=2)
    assert again is not None and again.batch_id == batches[0].batch_id
    client.ack(again)


@pytest.mark.parametrize(("owned", "error"), [
    ([0, 0], pgque.InvalidArgument), ([4], pgque.InvalidSlot), ([-1], pgque.InvalidSlot)])
def test_bad_slot_lists_are_refused(client: pgque.Client, owned: list[int],
                                    error: type[Exception]) -> None:
    fill(client, 4, 10)
    with pytest.raises(error):
        client.receive_slots("q", "g", slots=4, owned=owned)
    with pytest.raises(pgque.SlotCountMismatch):
        client.receive_slots("q", "g", slots=8, owned=[0])


def test_the_sql_calls_check_their_arguments(conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 2)")
    for statement, sqlstate in [
            ("select * from pgque.receive_slots('q', 'g', 2, null)", "22023"),
            ("select * from pgque.receive_slots('q', 'g', 2, '{0}', 0)", "22023"),
            ("select pgque.ack_slots('q', 'g', 2, '{0,1}', '{1}')", "22023"),
            ("select * from pgque.receive_slots('nope', 'g', 2, '{0}')", "PQ001"),
            ("select * from pgque.receive_slots('q', 'nope', 2, '{0}')", "PQ002"),
            ("select * from pgque.receive_slots('q', 'g', 2, '{1}')", "PQ024")]:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(statement)
        assert caught.value.sqlstate == sqlstate, statement
        conn.rollback()


def test_a_slot_never_subscribed_is_named(client: pgque.Client) -> None:
    """A group made slot by slot (subscribe_slot) may lack a slot: receive_slots
    and ack_slots refuse it as receive_partitioned does (ConsumerNotFound),
    naming the slot, and receive nothing for the others."""
    client.create_queue("q")
    client.conn.execute("select pgque.subscribe_slot('q', 'g', 0, 4)")
    client.conn.execute("select pgque.subscribe_slot('q', 'g', 2, 4)")
    client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
    client.tick("q")
    assert client.claim_slot("q", "g", 0) and client.claim_slot("q", "g", 2)
    with pytest.raises(pgque.ConsumerNotFound, match="g#1/4"):
        client.receive_slots("q", "g", slots=4, owned=[0, 1, 2])
    with pytest.raises(pgque.ConsumerNotFound, match="g#1/4"):
        client.receive_partitioned("q", "g", slot=1, slots=4)
    batches = client.receive_slots("q", "g", slots=4, owned=[0, 2])
    assert {b.slot for b in batches} <= {0, 2}
    fake = pgque.Batch(queue="q", consumer="g", batch_id=1, messages=[], slot=1, slots=4)
    with pytest.raises(pgque.ConsumerNotFound):
        client.ack_slots([*batches, fake])
    assert client.ack_slots(batches) == [True] * len(batches)
