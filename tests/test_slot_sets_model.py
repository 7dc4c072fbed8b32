"""receive_slots against receive_partitioned, step by step (slots/sets.sql).

Two queues get the same events, keys and ticks. One is consumed with
receive_slots + ack_slots over random sets of slots, the other slot by slot
with receive_partitioned + ack, in the same steps: every slot must get the
same pieces (the events are compared by their payload, their ids differ),
with the same nacks and retries, whichever path receive_slots takes (all its
slots together, some of them together and the rest one by one, or one by
one only: slots with open batches, at other ticks, with empty batches).

The same at the SQL level (Twins): one queue, two groups of the same slot
count, A consumed with receive_slots / ack_slots and B slot by slot with
receive_partitioned / ack_partitioned, in the same transaction (so that both
see the same now() for the one-second idle rule). Both groups read the same
events, so everything is compared exactly: event ids, retries, keys, piece
boundaries, finished flags, the epoch changes and every slot's cursor (its
cur_seq counts the writes, so an idle poll that writes shows).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from helpers import scalar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

EVENT_COLUMNS = "batch_id, ev_id, ev_time, ev_retry, ev_type, ev_data, ev_extra1, epoch"

_example = itertools.count()


@dataclass(frozen=True)
class Send:
    keys: tuple[int, ...]  # one event per key (key None: -1)


@dataclass(frozen=True)
class Receive:
    slots: tuple[int, ...]      # the slots asked for together
    max_events: int | None
    ack: bool                   # ack what came (else leave the pieces open)
    nack_first: bool            # nack each piece's first event (retried at once)


STEP = st.one_of(
    st.builds(Send, st.lists(st.integers(-1, 30), min_size=1, max_size=25).map(tuple)),
    st.just("tick"),
    st.just("maintenance"),
    st.builds(Receive,
              st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True).map(tuple),
              st.sampled_from([None, 1, 3, 10]), st.booleans(), st.booleans()),
)


def _pieces(batches: list[pgque.Batch[Any]]) -> dict[int, list[Any]]:
    return {b.slot or 0: [(m.payload, m.retry_count) for m in b] for b in batches}


@settings(deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(slots=st.sampled_from([1, 4, 6]), steps=st.lists(STEP, min_size=1, max_size=40))
def test_receive_slots_hands_out_what_receive_partitioned_does(
        dsn: str, slots: int, steps: list[Any]) -> None:
    n = next(_example)
    together, alone = f"together{n}", f"alone{n}"
    with pgque.connect(dsn) as client:
        for queue in (together, alone):
            client.create_queue(queue)
            client.subscribe_slots(queue, "g", slots=slots)
            client.maintenance(queue)  # the slot index and the reader's branch
            for slot in range(slots):
                assert client.claim_slot(queue, "g", slot)
        sent = 0
        for step in steps:
            if isinstance(step, Send):
                for queue in (together, alone):
                    client.send_batch(queue, [
                        ("e", {"n": sent + i}, None if key < 0 else f"k{key}")
                        for i, key in enumerate(step.keys)])
                sent += len(step.keys)
            elif step == "tick":
                for queue in (together, alone):
                    client.tick(queue)
            elif step == "maintenance":
                for queue in (together, alone):
                    client.maintenance(queue)  # nacked events back into the log
            else:
                asked = sorted({k % slots for k in step.slots})
                got = client.receive_slots(together, "g", slots=slots, owned=asked,
                                           max_events=step.max_events)
                assert [b.slot for b in got] == sorted(b.slot for b in got)
                one_by_one = [b for k in asked
                              if (b := client.receive_partitioned(
                                  alone, "g", slot=k, slots=slots,
                                  max_events=step.max_events)) is not None]
                assert _pieces(got) == _pieces(one_by_one)
                if step.ack:
                    nacks = [b.messages[0] for b in got if step.nack_first and b.messages]
                    finished = client.ack_slots(got, nack=nacks, retry_after=0)
                    for batch in one_by_one:
                        nack = [batch.messages[0]] if step.nack_first and batch.messages else []
                        assert client.ack(batch, nack=nack, retry_after=0) \
                            == finished[one_by_one.index(batch)]
        # Whatever is left comes out the same way too, and then nothing.
        for queue in (together, alone):
            client.tick(queue)
        for _ in range(200):
            got = client.receive_slots(together, "g", slots=slots, owned=range(slots))
            one_by_one = [b for k in range(slots)
                          if (b := client.receive_partitioned(alone, "g", slot=k,
                                                              slots=slots)) is not None]
            assert _pieces(got) == _pieces(one_by_one)
            if not got:
                break
            client.ack_slots(got)
            for batch in one_by_one:
                client.ack(batch)
        else:
            raise AssertionError("the queues never drained")


def test_idle_slots_write_nothing(dsn: str) -> None:
    """receive_slots over slots with nothing to receive takes no lock and writes
    nothing (no transaction id), as receive_partitioned's idle poll."""
    with pgque.connect(dsn) as client, psycopg.connect(dsn, autocommit=True) as raw:
        client.create_queue("idle")
        client.subscribe_slots("idle", "g", slots=4)
        client.maintenance("idle")
        client.tick("idle")
        raw.execute("select pgque.claim_slot('idle', 'g', k) from generate_series(0, 3) k")
        with raw.transaction():
            rows = raw.execute("select * from pgque.receive_slots('idle', 'g', 4, '{0,1,2,3}')"
                               ).fetchall()
            assigned = raw.execute("select pg_current_xact_id_if_assigned()").fetchone()
        assert rows == [] and assigned == (None,)


def test_a_fenced_slot_waits_while_the_others_go_together(dsn: str) -> None:
    """A slot whose previous owner's epoch is held by a fenced transaction gets
    nothing from receive_slots (as from receive_partitioned) until that
    transaction ends; the group's other slots are received meanwhile."""
    with pgque.connect(dsn) as old, pgque.connect(dsn) as new, \
            psycopg.connect(dsn) as handler:
        old.create_queue("f")
        old.subscribe_slots("f", "g", slots=4)
        old.maintenance("f")
        keys = [f"k{n}" for n in range(40)]
        old.send_batch("f", [("e", {"n": n}, key) for n, key in enumerate(keys)])
        old.tick("f")
        for slot in range(4):
            assert old.claim_slot("f", "g", slot)
        first = old.receive_slots("f", "g", slots=4, owned=range(4))
        assert [b.slot for b in first] == [0, 1, 2, 3]
        fence = first[1].fence
        assert fence is not None
        old.ack_slots(first)
        # A handler of slot 1 checks its fence in a transaction still open ...
        handler.execute("select pgque.check_fence(%s, %s, %s, %s)",
                        (fence.queue, fence.consumer, fence.slot, fence.epoch))
        # ... while its slots pass to another session, and new events come.
        for slot in range(4):
            assert old.release_slot("f", "g", slot)
            assert new.claim_slot("f", "g", slot)
        old.send_batch("f", [("e", {"n": n}, key) for n, key in enumerate(keys)])
        old.tick("f")
        meanwhile = new.receive_slots("f", "g", slots=4, owned=range(4))
        assert [b.slot for b in meanwhile] == [0, 2, 3]
        new.ack_slots(meanwhile)
        handler.commit()
        after = new.receive_slots("f", "g", slots=4, owned=range(4))
        assert [b.slot for b in after] == [1]
        assert after[0].fence is not None and after[0].fence.epoch > fence.epoch
        new.ack_slots(after)


def test_a_fenced_slot_beside_an_open_batch_and_the_set(dsn: str) -> None:
    """The slot-by-slot loop with a fenced slot: slot 1's previous owner's epoch
    is held by an open check_fence transaction, slot 3 has an open batch; the
    fenced slot gets nothing (no write) until the transaction ends, then a newer
    epoch. A fence checked by the current owner's own handler holds nothing back."""
    with pgque.connect(dsn) as old, pgque.connect(dsn) as new, \
            psycopg.connect(dsn) as handler, psycopg.connect(dsn) as own:
        old.create_queue("f")
        old.subscribe_slots("f", "g", slots=4)
        old.maintenance("f")
        old.send_batch("f", [("e", n, f"k{n % 40}") for n in range(80)])
        old.tick("f")
        for k in range(4):
            assert old.claim_slot("f", "g", k)
        first = old.receive_slots("f", "g", slots=4, owned=range(4), max_events=1)
        fence = first[1].fence
        assert fence is not None
        handler.execute("select pgque.check_fence(%s, %s, %s, %s)",
                        (fence.queue, fence.consumer, fence.slot, fence.epoch))
        old.ack_slots([b for b in first if b.slot != 3])  # slot 3 stays open (piece 1)
        for k in range(4):
            assert old.release_slot("f", "g", k)
            assert new.claim_slot("f", "g", k)
        meanwhile = new.receive_slots("f", "g", slots=4, owned=range(4), max_events=2)
        assert [b.slot for b in meanwhile] == [0, 2, 3]
        slot_3 = next(b for b in meanwhile if b.slot == 3)
        assert slot_3.batch_id == first[3].batch_id  # its open batch, delivered again
        # The new owner's own handler checks its fence and stays open: no hold-up.
        f0 = meanwhile[0].fence
        assert f0 is not None
        own.execute("select pgque.check_fence(%s, %s, %s, %s)",
                    (f0.queue, f0.consumer, f0.slot, f0.epoch))
        new.ack_slots(meanwhile)
        assert [b.slot for b in new.receive_slots("f", "g", slots=4, owned=[0, 2, 3])]
        own.commit()
        handler.commit()
        after = new.receive_slots("f", "g", slots=4, owned=[1])
        assert [b.slot for b in after] == [1]
        assert after[0].fence is not None and after[0].fence.epoch > fence.epoch


# -- the same in SQL, step by step: two groups of one queue ---------------------------------


CURSOR = ("select c.cur_seq, c.cur_last_tick, c.cur_batch is null, c.cur_next_tick, c.cur_pos,"
          " c.cur_handed, c.cur_end from pgque.subscription s"
          " cross join lateral pgque._current_cursor(s.sub_id) c"
          " join pgque.queue q on q.queue_id = s.sub_queue"
          " where q.queue_name = %s and s.sub_consumer = %s")


class Twins:
    """Queue ``name`` with groups A and B of ``slots`` slots, all owned by ``owner``
    (a connection not in autocommit: each step is one transaction)."""

    def __init__(self, dsn: str, name: str, slots: int, config: str = "{}") -> None:
        self.name, self.slots = name, slots
        self.admin = psycopg.connect(dsn, autocommit=True)
        self.owner = psycopg.connect(dsn)
        self.slow = psycopg.connect(dsn)  # a producer whose transactions stay open
        self.admin.execute("select pgque.create_queue(%s, %s::jsonb)", (name, config))
        for group in ("A", "B"):
            self.admin.execute("select pgque.subscribe_slots(%s, %s, %s)", (name, group, slots))
        self.admin.execute("select pgque.maint(%s)", (name,))
        self.qid = scalar(self.admin, "select queue_id from pgque.queue where queue_name = %s",
                          (name,))
        self.sent = 0
        self.epochs: dict[tuple[str, int], list[int]] = {}
        self.claim_all()

    def close(self) -> None:
        for conn in (self.slow, self.owner, self.admin):
            conn.close()

    def claim_all(self) -> None:
        for group in ("A", "B"):
            for k in range(self.slots):
                assert scalar(self.owner, "select pgque.claim_slot(%s, %s, %s)",
                              (self.name, group, k))
        self.owner.commit()

    def reclaim_all(self) -> None:
        for group in ("A", "B"):
            for k in range(self.slots):
                self.owner.execute("select pgque.release_slot(%s, %s, %s)", (self.name, group, k))
        self.owner.commit()
        self.claim_all()

    def send(self, keys: list[str | None], *, slow: bool = False) -> None:
        conn = self.slow if slow else self.admin
        for key in keys:
            conn.execute("select pgque.send(%s, 'e', %s, %s)", (self.name, str(self.sent), key))
            self.sent += 1

    def tick(self) -> None:
        self.admin.execute("select pgque.tick(%s)", (self.name,))

    def maint(self) -> None:
        self.admin.execute("select pgque.maint(%s)", (self.name,))

    def drop_reader(self) -> None:
        self.admin.execute(f"drop function if exists pgque._batch_reader_{self.qid}")

    def age_ticks(self) -> None:
        """As if the ticks were 3 s older (the one-second idle rule)."""
        self.admin.execute("update pgque.tick set tick_time = tick_time - interval '3 seconds'"
                           " where tick_queue = %s", (self.qid,))

    def cursors(self, group: str) -> list[Any]:
        return [self.admin.execute(CURSOR, (self.name, f"{group}#{k}/{self.slots}")).fetchone()
                for k in range(self.slots)]

    def step(self, asked: list[int], max_events: int | None = None, *, ack: bool = True,
             nack_first: bool = False) -> dict[int, list[tuple[int | None, int | None, Any]]]:
        """One receive of ``asked`` by both groups, compared; then (ack) the acks,
        with the first event of each piece nacked (nack_first), compared too."""
        owner, q, n = self.owner, self.name, self.slots
        # Rows as (slot, then the event columns up to the epoch).
        a_rows = owner.execute(f"select slot, {EVENT_COLUMNS}"
                               " from pgque.receive_slots(%s, 'A', %s, %s::int[], %s)",
                               (q, n, asked, max_events)).fetchall()
        b_rows = []
        for k in sorted(set(asked)):
            b_rows += [(k, *r) for r in owner.execute(
                f"select {EVENT_COLUMNS} from pgque.receive_partitioned(%s, 'B', %s, %s, %s)",
                (q, k, n, max_events)).fetchall()]
        owner.commit()
        assert [r[0] for r in a_rows] == sorted(r[0] for r in a_rows)  # ascending by slot
        a, b = self._by_slot(a_rows, "A"), self._by_slot(b_rows, "B")
        pieces = {k: [(r[2], r[4], r[7]) for r in rows] for k, rows in a.items()}
        assert pieces == {k: [(r[2], r[4], r[7]) for r in rows] for k, rows in b.items()}
        if ack and a:
            ks = sorted(a)
            for k in ks:
                if nack_first and a[k][0][2] is not None:
                    for group, got in (("A", a), ("B", b)):
                        owner.execute("select pgque.nack_partitioned(%s, %s, %s, %s, %s, %s)",
                                      (q, group, k, n, got[k][0][1], [got[k][0][2]]))
            done_a = scalar(owner, "select pgque.ack_slots(%s, 'A', %s, %s::int[], %s::bigint[])",
                            (q, n, ks, [a[k][0][1] for k in ks]))
            done_b = [scalar(owner, "select pgque.ack_partitioned(%s, 'B', %s, %s, %s)",
                             (q, k, n, b[k][0][1])) for k in ks]
            owner.commit()
            assert done_a == done_b
        assert self.cursors("A") == self.cursors("B")
        changes = {g: {k: len(v) for (gg, k), v in self.epochs.items() if gg == g}
                   for g in ("A", "B")}
        assert changes["A"] == changes["B"]
        return pieces

    def _by_slot(self, rows: list[Any], group: str) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for row in rows:
            out.setdefault(row[0], []).append(row)
        for k, slot_rows in out.items():
            assert len({r[1] for r in slot_rows}) == 1  # one batch per slot
            epoch = slot_rows[0][8]
            assert epoch is not None and all(r[8] == epoch for r in slot_rows)
            seen = self.epochs.setdefault((group, k), [])
            if not seen or seen[-1] != epoch:
                seen.append(epoch)
        return out

    def drain(self, max_events: int | None = None) -> list[int]:
        got: list[int] = []
        for _ in range(500):
            pieces = self.step(list(range(self.slots)), max_events)
            if not pieces:
                return got
            got += [ev for rows in pieces.values() for ev, _, _ in rows if ev is not None]
        raise AssertionError("never drained")


@pytest.fixture
def twins(dsn: str) -> Iterator[Callable[..., Twins]]:
    made: list[Twins] = []

    def make(slots: int, config: str = "{}") -> Twins:
        made.append(Twins(dsn, f"t{len(made)}", slots, config))
        return made[-1]
    yield make
    for t in made:
        if not t.slow.closed:
            t.slow.rollback()
        t.close()


def keys(n: int, *, nulls: bool = True) -> list[str | None]:
    return [None if nulls and i % 7 == 0 else f"k{i % 23}" for i in range(n)]


def test_idle_and_open_slots_beside_a_set_take_no_lock_on_the_idle_one(twins: Any,
                                                                       dsn: str) -> None:
    """A mixed call: slots 0 and 1 together, slot 2 with an open batch, slot 3 idle.
    The idle slot's receive lock is not even waited for, and nothing is written for it."""
    t = twins(4)
    key: dict[int, str] = {}
    for i in range(200):
        key.setdefault(scalar(t.admin, "select pgque.slot_of(%s, 4)", (f"k{i}",)), f"k{i}")
    t.send([key[0], key[1], key[2], key[2]])
    t.tick()
    t.step([2], max_events=1, ack=True)  # slot 2: an open batch, a piece acked
    t.step([0, 1, 3])                    # the others finish theirs
    t.send([key[0], key[1], key[2]])
    t.tick()
    before = t.cursors("A")[3]
    with psycopg.connect(dsn) as blocker:
        blocker.execute("select 1 from pgque.subscription where sub_consumer = 'A#3/4' "
                        "for update")
        t.owner.execute("set lock_timeout = '300ms'")
        rows = t.owner.execute("select slot, ev_id from pgque.receive_slots(%s, 'A', 4, "
                               "'{0,1,2,3}')", (t.name,)).fetchall()
        t.owner.commit()
        blocker.rollback()
    assert sorted({r[0] for r in rows}) == [0, 1, 2]
    assert t.cursors("A")[3] == before


def test_an_idle_set_writes_nothing_even_when_every_slot_is_asked(twins: Any) -> None:
    t = twins(3)
    t.tick()
    before = t.cursors("A")
    rows = t.owner.execute("select * from pgque.receive_slots(%s, 'A', 3, '{0,1,2}')",
                           (t.name,)).fetchall()
    xid = scalar(t.owner, "select pg_current_xact_id_if_assigned()")
    t.owner.commit()
    assert rows == [] and xid is None and t.cursors("A") == before


def test_events_of_transactions_open_across_ticks_come_as_slot_by_slot(twins: Any) -> None:
    """Snapshot xip lists: an event of a transaction open at a tick lands in the
    batch of the first tick after its commit, for the set read as slot by slot."""
    t = twins(4)
    t.send(keys(10), slow=True)    # open across the next tick
    t.send(keys(20))
    t.tick()
    t.step([0, 1, 2, 3], max_events=3, nack_first=True)
    t.slow.commit()
    t.send(keys(5))
    t.tick()
    t.maint()
    t.tick()
    for _ in range(3):
        t.step([0, 1, 2, 3], max_events=2)
    t.drain()
    assert t.step([0, 1, 2, 3]) == {}


def test_a_lagging_cursor_bounded_by_ticker_max_count_reads_as_slot_by_slot(
        twins: Any) -> None:
    t = twins(4, '{"ticker_max_count": 3}')
    for _ in range(6):
        t.send(keys(4))
        t.tick()
    for _ in range(4):
        t.step([0, 1, 2, 3], max_events=2)
    t.drain(max_events=1)


def test_slots_at_different_ticks_with_open_batches_and_subsets_read_as_slot_by_slot(
        twins: Any) -> None:
    t = twins(6)
    t.send(keys(60))
    t.tick()
    t.step([0, 1], ack=True)                      # two ahead
    t.step([2], max_events=1, ack=False)           # one with an open batch
    t.send(keys(30))
    t.tick()
    t.step([5, 4, 3, 2, 1, 0], max_events=2)       # every path at once
    t.step([1, 3, 5], max_events=1, nack_first=True)  # exactly half
    t.step([0, 4], max_events=1)                   # less than half
    t.maint()
    t.tick()
    t.drain(max_events=3)


def test_rotation_while_batches_are_open_reads_as_slot_by_slot(twins: Any) -> None:
    t = twins(4, '{"rotation_period": 0}')
    tables = set()
    for round_ in range(6):
        t.send(keys(12))
        t.tick()
        t.step([0, 1, 2, 3], max_events=2, ack=round_ % 2 == 0, nack_first=True)
        t.maint()   # switches tables and truncates the consumed ones
        t.maint()
        tables.add(scalar(t.admin, "select queue_cur_table from pgque.queue where queue_id = %s",
                          (t.qid,)))
    t.tick()
    t.drain()
    assert len(tables) >= 2  # the rotation did happen


def test_without_the_batch_reader_the_dynamic_span_read_is_the_same(twins: Any) -> None:
    t = twins(4)
    t.send(keys(40))
    t.tick()
    t.drop_reader()
    assert scalar(t.admin, "select to_regproc(%s)", (f"pgque._batch_reader_{t.qid}",)) is None
    t.step([0, 1, 2, 3], max_events=4, nack_first=True)
    t.maint()  # writes the reader again
    t.tick()
    t.drop_reader()
    t.drain(max_events=2)


def test_a_group_of_one_slot_with_max_events_one_reads_as_slot_by_slot(twins: Any) -> None:
    t = twins(1)
    t.send(keys(9))
    t.tick()
    t.step([0], max_events=1, nack_first=True)
    t.maint()
    t.tick()
    assert len(t.drain(max_events=1)) == 9  # 8 + the retried one


def test_null_keys_and_retries_go_to_slot_zero(twins: Any) -> None:
    t = twins(3)
    t.send([None] * 5 + ["x"] * 3)
    t.tick()
    got = t.step([0, 1, 2], nack_first=True)
    assert len(got[0]) >= 5
    t.maint()
    t.tick()
    again = t.step([0, 1, 2])
    assert any(retry == 1 for _, retry, key in again[0] if key is None)


def test_idle_slots_move_their_cursors_after_a_second_as_slot_by_slot(twins: Any) -> None:
    """Slots with nothing in ticks over a second old move their cursors (as
    receive_partitioned does), the others are read together."""
    t = twins(4)
    t.send(["k1"] * 4)
    t.tick()
    t.age_ticks()
    t.step([0, 1, 2, 3])
    t.tick()
    t.step([0, 1, 2, 3])
    t.age_ticks()
    t.step([0, 1, 2, 3])


def random_run(t: Twins, rng: random.Random, length: int) -> None:
    slow_open = False
    for _ in range(length):
        x = rng.random()
        if x < 0.22:
            slow = rng.random() < 0.25
            t.send([None if rng.random() < 0.1 else f"k{rng.randint(0, 20)}"
                    for _ in range(rng.randint(1, 15))], slow=slow)
            slow_open = slow_open or slow
        elif x < 0.40:
            t.tick()
        elif x < 0.44:
            t.slow.commit()
            slow_open = False
        elif x < 0.49:
            t.maint()
        elif x < 0.51:
            t.drop_reader()
        elif x < 0.53:
            t.reclaim_all()
        elif x < 0.57:
            t.age_ticks()
        elif x < 0.62:
            t.step(list(range(t.slots)))
        else:
            asked = (list(range(t.slots)) if rng.random() < 0.5
                     else rng.sample(range(t.slots), rng.randint(0, t.slots)))
            t.step(asked, rng.choice([None, 1, 2, 3, 7]), ack=rng.random() < 0.8,
                   nack_first=rng.random() < 0.3)
    if slow_open:
        t.slow.commit()
    t.tick()
    t.drain()


@pytest.mark.parametrize("seed", range(8))
def test_random_steps_match_receive_partitioned(twins: Any, seed: int) -> None:
    """Random sends (NULL keys, open producer transactions), ticks, maintenance
    (retries back, rotation), a dropped batch reader, reclaims (new epochs),
    aged ticks and receives of random subsets with max_events, acks and nacks:
    every step equal."""
    rng = random.Random(seed)
    for _ in range(2):
        slots = rng.choice([1, 2, 3, 4, 8])
        config = (f'{{"ticker_max_count": {rng.choice([1, 2, 3, 500])}, '
                  f'"rotation_period": 0}}')
        random_run(twins(slots, config), rng, 50)


def test_slots_idle_since_older_ticks_are_read_in_one_span_as_slot_by_slot(
        twins: Any) -> None:
    """A worker's slots drift apart: a slot with events moves its cursor at each
    tick, the idle ones leave theirs where they were. Slots whose next batches end
    at the same tick are still read together, in one read of the span from the
    oldest start (no slot-by-slot receive in the transaction), each event kept
    only for a slot whose own start did not see it; pieces and cursor writes
    equal the slot-by-slot receives'."""
    t = twins(4)
    key: dict[int, str] = {}
    for i in range(200):
        key.setdefault(scalar(t.admin, "select pgque.slot_of(%s, 4)", (f"k{i}",)), f"k{i}")
    t.send([key[0], key[0]])
    t.tick()
    t.step([0, 1, 2, 3])  # slot 0 moves to the new tick; the others write nothing
    t.send([key[1]])
    t.tick()
    t.step([0, 1, 2, 3])  # slot 1 too: the slots now start at three ticks
    starts = [c[1] for c in t.cursors("A")]
    assert len(set(starts)) == 3, starts
    t.send([key[k] for k in range(4)] * 2)
    t.tick()
    t.owner.execute("set track_functions = 'pl'")
    rows = t.owner.execute("select slot, ev_data from pgque.receive_slots(%s, 'A', 4, "
                           "'{0,1,2,3}')", (t.name,)).fetchall()
    one_by_one = scalar(t.owner, "select coalesce(pg_stat_get_xact_function_calls("
                                 "'pgque._receive_slot'::regproc), 0)")
    t.owner.rollback()
    assert one_by_one == 0  # all four in the set-based read
    assert sorted(rows) == sorted((k, str(n)) for n, k in enumerate([0, 1, 2, 3] * 2, start=3))
    pieces = t.step([0, 1, 2, 3])  # and the same as slot by slot, cursors included
    assert {k: len(v) for k, v in pieces.items()} == {0: 2, 1: 2, 2: 2, 3: 2}
