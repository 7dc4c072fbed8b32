"""receive_slots against receive_partitioned, step by step (69_slot_sets.sql).

Two queues get the same events, keys and ticks. One is consumed with
receive_slots + ack_slots over random sets of slots, the other slot by slot
with receive_partitioned + ack, in the same steps: every slot must get the
same pieces (the events are compared by their payload, their ids differ),
with the same nacks and retries, whichever path receive_slots takes (all its
slots together, some of them together and the rest one by one, or one by
one only: slots with open batches, at other ticks, with empty batches).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

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
