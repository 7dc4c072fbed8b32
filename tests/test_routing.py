"""G1 routing: slot(K) = (hashtextextended(K, 0) % N + N) % N, NULL -> slot 0, and
the slots of a group partition the stream: together everything, pairwise nothing."""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest
from helpers import scalar

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)

# Looked up once on PostgreSQL 15 and 18 (hash functions are stable across
# versions: hash-partitioned tables depend on it).
LITERAL_SLOTS = [
    ("tenant-1", 8, 1), ("tenant-1", 16, 9), ("tenant-1", 3, 1), ("tenant-1", 2, 1),
    ("tenant-2", 8, 3), ("acme", 8, 6), ("acme", 16, 14), ("acme", 3, 0),
    ("", 8, 5), ("ünïcode", 8, 4),
]


def test_hash_of_a_known_key(conn: psycopg.Connection[Any]) -> None:
    assert scalar(conn, "select hashtextextended('tenant-1', 0)") == -5960342201233910903


@pytest.mark.parametrize(("key", "slots", "slot"), LITERAL_SLOTS)
def test_slot_of_literal_keys(conn: psycopg.Connection[Any], key: str, slots: int,
                              slot: int) -> None:
    assert scalar(conn, "select pgque.slot_of(%s, %s)", (key, slots)) == slot


@pytest.mark.parametrize(("key", "slots", "slot"), LITERAL_SLOTS[:6])
def test_event_is_delivered_to_its_slot_only(client: pgque.Client, key: str, slots: int,
                                             slot: int) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    ev = client.send("q", "e", {}, partition_key=key)
    client.tick("q")
    for k in range(slots):
        assert client.claim_slot("q", "g", k)
        batch = client.receive_partitioned("q", "g", slot=k, slots=slots)
        if k == slot:
            assert batch is not None and [m.id for m in batch] == [ev]
            client.ack(batch)
        else:  # nothing for this slot: the batch was consumed inside receive
            assert batch is None


def test_null_key_goes_to_slot_zero(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    ev = client.send("q", "e", 1)
    client.tick("q")
    got = {}
    for k in range(4):
        client.claim_slot("q", "g", k)
        batch = client.receive_partitioned("q", "g", slot=k, slots=4)
        got[k] = [m.id for m in batch] if batch is not None else []
    assert got == {0: [ev], 1: [], 2: [], 3: []}


@pytest.mark.parametrize("slots", [1, 2, 3, 8, 16])
def test_slots_partition_the_stream(client: pgque.Client, slots: int) -> None:
    rng = random.Random(slots)
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    keys = [None if rng.random() < 0.1 else f"tenant-{rng.randrange(60)}" for _ in range(400)]
    sent = []
    for start in range(0, len(keys), 50):  # several batches
        sent += client.send_batch("q", [("e", i, keys[i]) for i in range(start, start + 50)])
        client.tick("q")
    key_of = dict(zip(sent, keys, strict=True))
    per_slot: dict[int, list[int]] = {}
    for k in range(slots):
        assert client.claim_slot("q", "g", k)
        ids: list[int] = []
        while (batch := client.receive_partitioned("q", "g", slot=k, slots=slots,
                                                   max_events=37)) is not None:
            ids += [m.id for m in batch]
            client.ack(batch)
        per_slot[k] = ids
    everything = [i for ids in per_slot.values() for i in ids]
    assert sorted(everything) == sent  # union is the stream, nothing twice
    assert len(set(everything)) == len(everything)  # pairwise disjoint
    for k, ids in per_slot.items():
        assert ids == sorted(ids)  # within a slot, stream order
        for i in ids:
            expected = scalar(client.conn, "select pgque.slot_of(%s, %s)", (key_of[i], slots))
            assert expected == k


@pytest.mark.parametrize("slots", [3, 5])
def test_every_spelling_of_the_formula_routes_alike(client: pgque.Client, slots: int) -> None:
    """The routing formula is written three times: slot_of, the SQL text that
    the batch readers, the slot indexes and the slot status view's backlog and
    age take (_slot_expr), and receive_slots' routing of a span's events
    (slots/sets.sql, where a call per event would cost too much). Every copy
    routes each key where slot_of does: keys whose hash is negative included
    (the "+ N" of the formula), a NULL key to slot 0."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    keys = [None, "", *(f"tenant-{n}" for n in range(40))]
    sent = client.send_batch("q", [("e", n, key) for n, key in enumerate(keys)])
    client.tick("q")
    expected: dict[int, list[int]] = {k: [] for k in range(slots)}
    for ev, key in zip(sent, keys, strict=True):
        expected[scalar(client.conn, "select pgque.slot_of(%s, %s)", (key, slots))].append(ev)
    hashes = [scalar(client.conn, "select hashtextextended(%s, 0)", (k,)) for k in keys[1:]]
    assert any(h < 0 for h in hashes) and any(h > 0 for h in hashes)
    # The status view, before anything is received: the backlog and its age per slot.
    status = {s.slot: s for s in client.partition_slot_status("q")}
    assert {k: s.pending_events for k, s in status.items()} == {
        k: len(evs) for k, evs in expected.items()}
    assert {k: s.oldest_unconsumed_age is not None for k, s in status.items()} == {
        k: bool(evs) for k, evs in expected.items()}
    # receive_slots, all slots in one call.
    for k in range(slots):
        assert client.claim_slot("q", "g", k)
    batches = client.receive_slots("q", "g", slots=slots, owned=range(slots))
    assert {b.slot: [m.id for m in b] for b in batches} == {
        k: evs for k, evs in expected.items() if evs}


def test_slot_count_is_fixed_per_group(client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    assert client.subscribe_slots("q", "g", slots=4) == 4
    assert client.subscribe_slots("q", "g", slots=4) == 0  # idempotent
    before = conn.execute("select * from pgque.subscription order by sub_id").fetchall()
    with pytest.raises(pgque.SlotCountMismatch):
        client.subscribe_slots("q", "g", slots=8)
    with pytest.raises(psycopg.Error) as raw:  # plain SQL: the SQLSTATE says it
        conn.execute("select pgque.subscribe_slot('q', 'g', 1, 8)")
    assert raw.value.sqlstate == "PQ020"
    with pytest.raises(pgque.SlotCountMismatch):
        client.receive_partitioned("q", "g", slot=0, slots=8)
    assert conn.execute("select * from pgque.subscription order by sub_id").fetchall() == before
    assert scalar(conn, "select cg_slots from pgque.consumer_group") == 4
    # Changing N means removing the group first.
    assert client.unsubscribe_slots("q", "g") == 4
    assert client.subscribe_slots("q", "g", slots=8) == 8


def test_single_slot_subscription(conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    assert scalar(conn, "select pgque.subscribe_slot('q', 'g', 2, 4)") is True
    assert scalar(conn, "select pgque.subscribe_slot('q', 'g', 2, 4)") is False
    assert scalar(conn, "select count(*) from pgque.subscription") == 1


BAD = [
    ("slot count 0", pgque.InvalidSlotCount, lambda c: c.subscribe_slots("q", "g", slots=0)),
    ("slot count too big", pgque.InvalidSlotCount,
     lambda c: c.subscribe_slots("q", "g", slots=5000)),
    ("slot equal to N", pgque.InvalidSlot,
     lambda c: c.receive_partitioned("q", "g", slot=4, slots=4)),
    ("negative slot", pgque.InvalidSlot,
     lambda c: c.receive_partitioned("q", "g", slot=-1, slots=4)),
    ("claim slot out of range", pgque.InvalidSlot, lambda c: c.claim_slot("q", "g", 9)),
    ("# in group name", pgque.InvalidName, lambda c: c.subscribe_slots("q", "a#b", slots=2)),
    ("unknown group", pgque.ConsumerNotFound,
     lambda c: c.receive_partitioned("q", "nobody", slot=0, slots=4)),
    ("unknown queue", pgque.QueueNotFound, lambda c: c.subscribe_slots("nope", "g", slots=2)),
    ("plain receive of a slot", pgque.SlotSubscriptionError, lambda c: c.receive("q", "g#0/4")),
    ("plain unsubscribe of a slot", pgque.SlotSubscriptionError,
     lambda c: c.unsubscribe("q", "g#0/4")),
]


@pytest.mark.parametrize(("case", "error", "call"), BAD, ids=[b[0] for b in BAD])
def test_bad_slot_input(client: pgque.Client, conn: psycopg.Connection[Any], case: str,
                        error: type[pgque.PgqueError], call: Any) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.send("q", "e", 1, partition_key="k")
    client.tick("q")
    before = (conn.execute("select * from pgque.subscription order by sub_id").fetchall(),
              conn.execute("select * from pgque.consumer_group").fetchall())
    with pytest.raises(error):
        call(client)
    after = (conn.execute("select * from pgque.subscription order by sub_id").fetchall(),
             conn.execute("select * from pgque.consumer_group").fetchall())
    assert after == before
