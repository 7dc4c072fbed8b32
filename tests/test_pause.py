"""The pause failure policy in SQL (pgque/sql/code/slots/pause.sql): a failed
event of key K blocks K in its slot; later events of K are set aside, in order,
and handed out after the failed one is handled or dead-lettered; other keys
go on. Every step through the public SQL functions, on one session that owns
the slot."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from helpers import scalar, slot_keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

Rows = list[tuple[Any, ...]]


class Slot:
    """Slot 0 of a one-slot group of queue 'q', driven through SQL."""

    def __init__(self, conn: psycopg.Connection[Any], *, policy: str = "pause",
                 max_attempts: int | None = 10, pause_timeout: str | None = "1 hour") -> None:
        self.conn = conn
        conn.execute("select pgque.create_queue('q')")
        conn.execute("select pgque.subscribe_slots('q', 'g', 1)")
        conn.execute("select pgque.set_failure_policy('q', 'g', %s, %s, %s::interval)",
                     (policy, max_attempts, pause_timeout))
        assert scalar(conn, "select pgque.claim_slot('q', 'g', 0)")

    def send(self, *events: tuple[str, int]) -> None:
        for key, n in events:
            self.conn.execute("select pgque.send('q', 'e', %s, %s)", (f'{{"n": {n}}}', key))
        self.conn.execute("select pgque.tick('q')")

    def receive(self, max_events: int | None = None) -> tuple[int | None, Rows]:
        """The next piece: its batch id and (key, n, retry) of its events."""
        rows = self.conn.execute(
            "select batch_id, ev_id, ev_extra1, (ev_data::json->>'n')::int, ev_retry"
            "  from pgque.receive_partitioned('q', 'g', 0, 1, %s)", (max_events,)).fetchall()
        if not rows:
            return None, []
        self.ids = {(key, n): ev_id for _b, ev_id, key, n, _r in rows if ev_id is not None}
        return rows[0][0], [(key, n, retry) for _b, ev_id, key, n, retry in rows
                            if ev_id is not None]

    def ack(self, batch: int | None, failed: tuple[tuple[str, int], ...] = (),
            retry_after: str = "0") -> None:
        self.conn.execute(
            "select pgque.ack_partitioned('q', 'g', 0, 1, %s, %s, %s, %s::interval)",
            (batch, [self.ids[f] for f in failed], ["boom"], retry_after))

    def blocked(self) -> Rows:
        return self.conn.execute(
            "select bk_key, bk_attempts, bk_first_error from pgque.blocked_key"
            " order by bk_key").fetchall()


def test_a_failed_event_holds_its_keys_later_events_and_others_go_on(
        conn: psycopg.Connection[Any]) -> None:
    slot = Slot(conn)
    slot.send(("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3))
    batch, events = slot.receive()
    assert events == [("a", 1, 0), ("b", 1, 0), ("a", 2, 0), ("b", 2, 0), ("a", 3, 0)]
    # a2 fails, and a3 is not handled after it: a is blocked from a2 on.
    slot.ack(batch, failed=(("a", 2), ("a", 3)), retry_after="1 hour")
    assert slot.blocked() == [("a", 1, "boom")]
    # Later events: b flows, a is set aside.
    slot.send(("a", 4), ("b", 3), ("a", 5))
    batch, events = slot.receive()
    assert events == [("b", 3, 0)]
    slot.ack(batch)
    assert slot.receive() == (None, [])
    # The head is due again: a's events come in order, the head with its attempts.
    conn.execute("update pgque.blocked_key set bk_retry_at = now()")
    batch, events = slot.receive()
    assert events == [("a", 2, 1), ("a", 3, 0), ("a", 4, 0), ("a", 5, 0)]
    slot.ack(batch)
    assert slot.blocked() == []
    slot.send(("a", 6))
    batch, events = slot.receive()
    assert events == [("a", 6, 0)]


def test_a_held_piece_is_handed_again_until_acked_and_fails_again_in_place(
        conn: psycopg.Connection[Any]) -> None:
    slot = Slot(conn)
    slot.send(("a", 1), ("a", 2), ("a", 3))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2), ("a", 3)))  # due at once
    held, events = slot.receive(max_events=2)
    assert events == [("a", 1, 1), ("a", 2, 0)]
    assert slot.receive(max_events=2) == (held, events)  # not acked: the same piece
    slot.ack(held, failed=(("a", 1),))
    assert slot.blocked() == [("a", 2, "boom")]
    held, events = slot.receive(max_events=2)
    assert events == [("a", 1, 2), ("a", 2, 0)]
    slot.ack(held, failed=(("a", 2),))  # a1 done; a2 is the head now
    assert slot.blocked() == [("a", 1, "boom")]
    held, events = slot.receive()
    assert events == [("a", 2, 1), ("a", 3, 0)]
    slot.ack(held)
    assert slot.blocked() == []


def test_max_attempts_dead_letters_the_head_and_the_key_moves_on(
        conn: psycopg.Connection[Any]) -> None:
    slot = Slot(conn, max_attempts=2)
    slot.send(("a", 1), ("a", 2))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2)))
    held, events = slot.receive()
    assert events == [("a", 1, 1), ("a", 2, 0)]
    slot.ack(held, failed=(("a", 1),))
    dead = conn.execute("select ev_extra1, ev_data, reason, ev_retry"
                        " from pgque.dead_letters('q', 'g')").fetchall()
    assert dead == [("a", '{"n": 1}', "boom", 1)]
    held, events = slot.receive()
    assert events == [("a", 2, 0)]
    slot.ack(held)
    assert slot.blocked() == []


def test_going_to_skip_releases_the_blocked_keys_in_order(conn: psycopg.Connection[Any]) -> None:
    slot = Slot(conn)
    slot.send(("a", 1), ("a", 2))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2)), retry_after="1 hour")
    conn.execute("select pgque.set_failure_policy('q', 'g', 'skip')")
    held, events = slot.receive()
    assert events == [("a", 1, 1), ("a", 2, 0)]
    slot.ack(held, failed=(("a", 1),))  # under skip: to the retry queue
    assert slot.blocked() == []
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 1


@pytest.mark.parametrize(("args", "state"), [
    (("q", "g", "stop", 10, "1 hour"), "22023"),
    (("q", "g", "pause", 0, "1 hour"), "22023"),
    (("q", "g", "pause", 10, "0"), "22023"),
    (("q", "nobody", "pause", 10, "1 hour"), "PQ002"),
])
def test_bad_policies_are_refused_and_change_nothing(
        conn: psycopg.Connection[Any], args: tuple[Any, ...], state: str) -> None:
    conn.execute("select pgque.create_queue('q'), pgque.subscribe_slots('q', 'g', 2)")
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("select pgque.set_failure_policy(%s, %s, %s, %s, %s::interval)", args)
    assert caught.value.sqlstate == state
    assert scalar(conn, "select cg_policy from pgque.consumer_group") == "skip"


def test_keys_of_other_slots_are_untouched(conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q'), pgque.subscribe_slots('q', 'g', 2, 'pause')")
    k0, k1 = slot_keys(conn, 0, 2)[0], slot_keys(conn, 1, 2)[0]
    assert scalar(conn, "select pgque.claim_slot('q', 'g', 0)")
    assert scalar(conn, "select pgque.claim_slot('q', 'g', 1)")
    for key in (k0, k1, k0, k1):
        conn.execute("select pgque.send('q', 'e', '1', %s)", (key,))
    conn.execute("select pgque.tick('q')")
    rows = conn.execute("select batch_id, ev_id from pgque.receive_partitioned('q', 'g', 0, 2)"
                        ).fetchall()
    conn.execute("select pgque.ack_partitioned('q', 'g', 0, 2, %s, %s, '{x}', '1 hour')",
                 (rows[0][0], [rows[0][1]]))
    rows = conn.execute("select ev_extra1 from pgque.receive_partitioned('q', 'g', 1, 2)"
                        ).fetchall()
    assert [r[0] for r in rows] == [k1, k1]


def test_later_events_of_the_key_that_were_handled_are_not_held(
        conn: psycopg.Connection[Any]) -> None:
    """Only what was nacked is set aside: a later event of the key that the
    consumer did handle (nacking the failed one alone) is done, not repeated."""
    slot = Slot(conn)
    slot.send(("a", 1), ("a", 2), ("a", 3))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 3)))
    _held, events = slot.receive()
    assert events == [("a", 1, 1), ("a", 3, 0)]


# -- the ordering property --------------------------------------------------------

@st.composite
def pause_runs(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Steps of a consumer under the pause policy: sends, and pieces received with
    some keys failing at their first event in the piece, then acked or dropped
    (a crash before the ack: the transaction with the handler's effects is lost)."""
    steps: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            steps.append(("send", draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=6))))
        steps.append(("piece", draw(st.integers(1, 5)),
                      draw(st.sets(st.sampled_from("abc"))), draw(st.booleans()),
                      draw(st.sampled_from(["0", "1 hour"]))))
        if draw(st.booleans()):
            steps.append(("due",))  # time passes: every blocked key is due again
    return steps


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=pause_runs(), max_attempts=st.sampled_from([None, 2]))
def test_each_key_is_handled_in_send_order_once_whatever_fails_and_crashes(
        dsn: str, run: list[tuple[Any, ...]], max_attempts: int | None) -> None:
    """Per key, what is handled or dead-lettered comes in send order, each event
    once (the handler's effects commit with the ack, as a transactional
    handler's do), and once the failures stop everything sent is handled."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pgque.drop_queue('q', true) from pgque.queue where queue_name = 'q'")
        slot = Slot(conn, max_attempts=max_attempts)
        sent: dict[str, list[int]] = {k: [] for k in "abc"}
        timeline: dict[str, list[int]] = {k: [] for k in "abc"}
        counter = 0

        def piece(max_events: int | None, failing: set[str], crash: bool,
                  retry_after: str = "0") -> bool:
            batch, events = slot.receive(max_events)
            if batch is None:
                return False
            done: list[tuple[str, int]] = []
            failed: list[tuple[str, int]] = []
            for key, n, _retry in events:
                if key in {k for k, _ in failed} or (key in failing and
                                                     not any(k == key for k, _ in done)):
                    failed.append((key, n))  # fails, or waits behind what failed
                else:
                    done.append((key, n))
            if crash:
                return True  # nothing committed: the piece comes again
            dead_before = len(conn.execute("select 1 from pgque.dead_letters('q')").fetchall())
            slot.ack(batch, failed=tuple(failed), retry_after=retry_after)
            for key, n in done:
                timeline[key].append(n)
            for key, data in conn.execute(
                    "select ev_extra1, ev_data from pgque.dead_letters('q') order by dl_id"
                    " offset %s", (dead_before,)):
                timeline[key].append(json.loads(data)["n"])
            return True

        def due() -> None:
            # Not the keys whose head is handed out (a crash left its piece out).
            for (key,) in conn.execute("select bk_key from pgque.blocked_key"
                                       " where bk_batch is null").fetchall():
                conn.execute("select pgque.retry_head('q', 'g', %s)", (key,))

        for step in run:
            if step[0] == "send":
                events = []
                for key in step[1]:
                    counter += 1
                    sent[key].append(counter)
                    events.append((key, counter))
                slot.send(*events)
            elif step[0] == "due":
                due()
            else:
                piece(*step[1:])
        slot.send()  # a last tick
        due()
        while piece(3, set(), False):
            pass
        assert slot.blocked() == []
        for key in "abc":
            assert timeline[key] == sent[key]
