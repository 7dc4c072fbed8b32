"""The pause failure policy in SQL (pgque/sql/code/slots/pause.sql): a failed
event of key K blocks K in its slot; later events of K are set aside, in order,
and handed out after the failed one is handled or dead-lettered; other keys
go on. Every step through the public SQL functions, on one session that owns
the slot."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest
from helpers import assert_one_line_error, ok, run_cli, scalar, slot_keys, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

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


# -- the ledger ---------------------------------------------------------------------------

def test_the_ledger_lists_and_its_verbs_act_on_a_blocked_key(
        conn: psycopg.Connection[Any], client: pgque.Client, dsn: str) -> None:
    slot = Slot(conn)
    slot.send(("a", 1), ("a", 2), ("b", 1), ("c", 1), ("c", 2))
    batch, _ = slot.receive()
    ids = dict(slot.ids)
    slot.ack(batch, failed=(("a", 1), ("a", 2), ("b", 1), ("c", 1), ("c", 2)),
             retry_after="1 hour")
    [a, b, c] = client.blocked_keys("q", "g")
    assert (a.key, a.event_id, a.attempts, a.held_behind, a.first_error, a.payload) == \
        ("a", ids[("a", 1)], 1, 1, "boom", {"n": 1})
    assert a.retry_at > a.blocked_since and (b.key, c.key) == ("b", "c")
    # retry: a's head is due now, and comes first.
    client.retry_head("q", "g", "a")
    held, events = slot.receive()
    assert events == [("a", 1, 1), ("a", 2, 0)]
    # While that piece is out, the verbs refuse to touch a.
    with pytest.raises(pgque.HeadInFlight):
        client.skip_head("q", "g", "a")
    slot.ack(held)
    # skip: b's head to the dead letters, b is unblocked (nothing was held behind it).
    assert client.skip_head("q", "g", "b", "not needed") == ids[("b", 1)]
    [letter] = client.dead_letters("q", "g")
    assert (letter.event_id, letter.reason, letter.partition_key) == \
        (ids[("b", 1)], "not needed", "b")
    # resume: c's head to the retry queue, c2 is handed out now, before it.
    assert client.resume_key("q", "g", "c") == ids[("c", 1)]
    held, events = slot.receive()
    assert events == [("c", 2, 0)]
    slot.ack(held)
    assert client.blocked_keys("q", "g") == []
    assert scalar(conn, "select count(*) from pgque._retry_waiting") == 1
    # Refused, changing nothing: a key that is not blocked, a group that is not there.
    for call in (lambda: client.retry_head("q", "g", "a"),
                 lambda: client.skip_head("q", "g", "zzz"),
                 lambda: client.resume_key("q", "g", "b")):
        with pytest.raises(pgque.KeyNotBlocked):
            call()
    with pytest.raises(pgque.ConsumerNotFound):
        client.blocked_keys("q", "nobody")
    out = ok(run_cli("blocked", "list", "q", "g", "--json", "--dsn", dsn))
    assert json.loads(out) == []


def test_a_role_that_may_not_use_the_group_is_refused_by_the_ledger(
        conn: psycopg.Connection[Any], role_clients: dict[str, pgque.Client]) -> None:
    owner, stranger = role_clients["reader"], role_clients["other"]
    owner.set_failure_policy("q", "g", "pause")
    slot = scalar(conn, "select pgque.slot_of('a', 4)")
    assert scalar(conn, "select pgque.claim_slot('q', 'g', %s)", (slot,))
    conn.execute("select pgque.send('q', 'e', '1', 'a')")
    conn.execute("select pgque.tick('q')")
    [(batch, ev_id)] = conn.execute("select batch_id, ev_id from"
                                    " pgque.receive_partitioned('q', 'g', %s, 4)",
                                    (slot,)).fetchall()
    conn.execute("select pgque.ack_partitioned('q', 'g', %s, 4, %s, %s, '{boom}', '1 hour')",
                 (slot, batch, [ev_id]))
    for call in (lambda: stranger.blocked_keys("q", "g"),
                 lambda: stranger.failure_policy("q", "g"),
                 lambda: stranger.retry_head("q", "g", "a"),
                 lambda: stranger.skip_head("q", "g", "a"),
                 lambda: stranger.resume_key("q", "g", "a"),
                 lambda: stranger.set_failure_policy("q", "g", "skip")):
        with pytest.raises(pgque.ConsumerAccessDenied):
            call()
    [blocked] = owner.blocked_keys("q", "g")
    assert (blocked.key, blocked.attempts, blocked.event_id) == ("a", 1, ev_id)
    assert owner.failure_policy("q", "g").policy == "pause"


def test_the_cli_lists_shows_retries_and_skips(conn: psycopg.Connection[Any], dsn: str) -> None:
    slot = Slot(conn)
    slot.send(("acct-1", 1), ("acct-1", 2))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("acct-1", 1), ("acct-1", 2)), retry_after="1 hour")
    assert "acct-1" in ok(run_cli("blocked", "list", "q", "g", "--dsn", dsn))
    shown = json.loads(ok(run_cli("blocked", "show", "q", "g", "acct-1", "--json",
                                  "--dsn", dsn)))
    assert (shown["key"], shown["payload"], shown["held_behind"]) == ("acct-1", {"n": 1}, 1)
    assert "due now" in ok(run_cli("blocked", "retry", "q", "g", "acct-1", "--dsn", dsn))
    assert scalar(conn, "select bk_retry_at <= now() from pgque.blocked_key")
    conn.execute("update pgque.blocked_key set bk_retry_at = now() + interval '1 hour'")
    assert "dead-lettered" in ok(run_cli("blocked", "skip", "q", "g", "acct-1", "--yes",
                                         "--dsn", dsn))
    error = assert_one_line_error(
        run_cli("blocked", "retry", "q", "g", "acct-9", "--dsn", dsn), 1)
    assert "not blocked" in error
    # The status shows the policy, and the key acct-1 still has a2 to go.
    status = json.loads(ok(run_cli("status", "--json", "--dsn", dsn)))
    [group] = status["groups"]
    assert (group["failure_policy"], group["max_attempts"], group["blocked_keys"],
            group["dead_letters"]) == ("pause", 10, 1, 1)
    [slot_row] = status["slots"]
    assert slot_row["blocked_keys"] == 1 and slot_row["oldest_blocked_age"] is not None


# -- the engine around it -------------------------------------------------------------------

def test_receive_slots_goes_slot_by_slot_for_a_slot_with_blocked_keys(
        conn: psycopg.Connection[Any], client: pgque.Client) -> None:
    conn.execute("select pgque.create_queue('q'), pgque.subscribe_slots('q', 'g', 2, 'pause')")
    k0 = slot_keys(conn, 0, 2, 2)
    k1 = slot_keys(conn, 1, 2, 1)[0]
    for slot in (0, 1):
        assert scalar(conn, "select pgque.claim_slot('q', 'g', %s)", (slot,))
    for key in (*k0, k1, k0[0], k0[1], k1):
        conn.execute("select pgque.send('q', 'e', '1', %s)", (key,))
    conn.execute("select pgque.tick('q')")
    rows = conn.execute("select batch_id, ev_id, ev_extra1 from"
                        " pgque.receive_partitioned('q', 'g', 0, 2, 1)").fetchall()
    assert rows[0][2] == k0[0]
    conn.execute("select pgque.ack_partitioned('q', 'g', 0, 2, %s, %s, '{x}', '1 hour')",
                 (rows[0][0], [rows[0][1]]))
    # Together: slot 0 leaves k0[0]'s second event out, slot 1 is untouched.
    got = conn.execute("select slot, ev_extra1 from pgque.receive_slots('q', 'g', 2, '{0,1}')"
                       " where ev_id is not null").fetchall()
    assert sorted(got) == sorted([(0, k0[1]), (0, k0[1]), (1, k1), (1, k1)])
    batches = conn.execute("select slot, batch_id from pgque.receive_slots('q', 'g', 2, '{0,1}')"
                           " group by 1, 2").fetchall()
    conn.execute("select pgque.ack_slots('q', 'g', 2, %s, %s)",
                 ([b[0] for b in batches], [b[1] for b in batches]))
    conn.execute("select pgque.retry_head('q', 'g', %s)", (k0[0],))
    got = conn.execute("select slot, batch_id, ev_extra1 from"
                       " pgque.receive_slots('q', 'g', 2, '{0}')").fetchall()
    assert [g[2] for g in got] == [k0[0], k0[0]]  # the head, then what waited
    assert conn.execute("select pgque.ack_slots('q', 'g', 2, '{0}', %s)",
                        ([got[0][1]],)).fetchone() == ([True],)
    assert client.blocked_keys("q", "g") == []


def test_the_next_owner_gets_the_held_events_again_and_the_loss_is_no_failure(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """A piece of held events whose owner lost the slot before its ack comes to
    the next owner again, in a new piece; the loss is noted as the head's last
    error but is no attempt of it (a crash or a restart is not the handler's
    failure)."""
    slot = Slot(conn, max_attempts=3)
    slot.send(("a", 1), ("a", 2), ("b", 1))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2)))
    held, events = slot.receive()
    assert events == [("a", 1, 1), ("a", 2, 0)]
    conn.execute("select pgque.release_slot('q', 'g', 0)")  # dies with the piece out
    with psycopg.connect(dsn, autocommit=True) as other:
        assert scalar(other, "select pgque.claim_slot('q', 'g', 0)")
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("select pgque.ack_partitioned('q', 'g', 0, 1, %s)", (held,))
        assert refused.value.sqlstate == "PQ024"
        rows = other.execute("select batch_id, ev_extra1, ev_retry from"
                             " pgque.receive_partitioned('q', 'g', 0, 1)").fetchall()
        again = rows[0][0]
        assert again != held and rows == [(again, "a", 1), (again, "a", 0)]
        assert scalar(other, "select bk_last_error from pgque.blocked_key").startswith("lost")
        other.execute("select pgque.send('q', 'e', '{\"n\": 3}', 'a')")
        other.execute("select pgque.tick('q')")
        other.execute("select pgque.ack_partitioned('q', 'g', 0, 1, %s)", (again,))
        rows = other.execute("select ev_data from pgque.receive_partitioned('q', 'g', 0, 1)"
                             " where ev_extra1 = 'a'").fetchall()
        assert rows == [('{"n": 3}',)]


def test_held_events_rotate_without_dead_rows_and_what_is_needed_survives(
        conn: psycopg.Connection[Any]) -> None:
    """Held rows are never updated or deleted: the rotation copies those still
    needed and empties the partition; a key blocked across two rotations comes
    back whole and in order."""
    slot = Slot(conn)
    conn.execute("update pgque.rotation set rt_period = '0' where rt_name = 'held'")
    slot.send(("a", 1), ("a", 2), ("b", 1))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2), ("b", 1)), retry_after="1 hour")
    conn.execute("select pgque.skip_head('q', 'g', 'b')")  # b goes on: its row is not needed
    client_steps = []
    for n in range(3, 6):
        slot.send(("a", n), ("b", n))
        batch, events = slot.receive()
        assert events == [("b", n, 0)]  # a's is set aside
        slot.ack(batch)
        client_steps += [s for _q, s, _n in conn.execute("select * from pgque.maint()")]
        client_steps += [s for _q, s, _n in conn.execute("select * from pgque.maint()")]
    assert client_steps.count("rotate_held") >= 3
    conn.execute("select pg_stat_force_next_flush()")
    conn.execute("select pg_stat_clear_snapshot()")
    assert conn.execute("select relname, n_tup_ins > 0, n_tup_upd + n_tup_del"
                        "  from pg_stat_user_tables"
                        " where relname in ('held_event_0', 'held_event_1') order by 1"
                        ).fetchall() == [("held_event_0", True, 0), ("held_event_1", True, 0)]
    conn.execute("select pgque.retry_head('q', 'g', 'a')")
    _held, events = slot.receive()
    assert [(k, n) for k, n, _r in events] == [("a", n) for n in range(1, 6)]


def test_the_held_rotation_never_waits_for_a_slot_owners_transaction(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """The rotation's copy of held events must not wait for the receive lock a
    worker's transaction holds (a foreign key check would: a share lock on the
    subscription's row), or the worker's next read of the partition being
    emptied deadlocks with it."""
    slot = Slot(conn)
    conn.execute("update pgque.rotation set rt_period = '0' where rt_name = 'held'")
    slot.send(("a", 1), ("a", 2))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2)), retry_after="1 hour")
    conn.execute("select * from pgque.maint()")  # switch: a's rows are in the other partition
    with conn.transaction():
        conn.execute("select pgque.retry_head('q', 'g', 'a')")  # holds the receive lock
        done = threading.Event()
        errors: list[BaseException] = []

        def maintain() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True) as other:
                    steps = [s for _q, s, _n in other.execute("select * from pgque.maint()")]
                    assert "rotate_held" in steps
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=maintain)
        thread.start()
        wait_for(done.is_set, timeout=10, what="maint() to finish beside the open transaction",
                 dsn=dsn)
        thread.join()
        assert errors == []
        rows = conn.execute("select ev_extra1 from pgque.receive_partitioned('q', 'g', 0, 1)"
                            ).fetchall()
    assert rows == [("a",), ("a",)]


# -- dead letters replayed in key order ------------------------------------------------------

@pytest.mark.parametrize("policy", ["pause", "skip"])
def test_a_dead_letter_replayed_as_next_comes_before_its_keys_later_events(
        conn: psycopg.Connection[Any], client: pgque.Client, policy: str) -> None:
    slot = Slot(conn, policy=policy, max_attempts=1)
    conn.execute("update pgque.queue set queue_max_retries = 0")
    slot.send(("a", 1), ("b", 1))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1),))  # a1 dead at once (max_attempts 1 / max_retries 0)
    [letter] = client.dead_letters("q", "g")
    assert slot.blocked() == []
    slot.send(("a", 2), ("a", 3), ("b", 2))
    batch, events = slot.receive(max_events=1)  # a2 handed out: it goes on before a1
    assert events == [("a", 2, 0)]
    assert client.replay_dead_letter("q", letter.id, as_next=True) == letter.event_id
    slot.ack(batch)
    held, events = slot.receive()
    assert events == [("a", 1, 0)]  # due at once, ahead of a3 (not handed out yet)
    slot.ack(held)
    batch, events = slot.receive()
    assert events == [("a", 3, 0), ("b", 2, 0)]
    slot.ack(batch)
    assert slot.blocked() == [] and client.dead_letters("q") == []


def test_as_next_on_a_blocked_key_goes_ahead_of_its_head_and_bulk_replay_keeps_order(
        conn: psycopg.Connection[Any], client: pgque.Client, dsn: str) -> None:
    slot = Slot(conn, max_attempts=1)
    slot.send(("a", 1), ("a", 2), ("a", 3), ("a", 4))
    batch, _ = slot.receive(max_events=1)
    slot.ack(batch, failed=(("a", 1),))  # dead
    batch, _ = slot.receive(max_events=1)
    slot.ack(batch, failed=(("a", 2),))  # dead
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 3), ("a", 4)), retry_after="1 hour")  # a3 the head, a4 held
    # With max_attempts 1 each head is dead at its first failure; a4 waits, due now.
    assert [d.payload for d in client.dead_letters("q")] == [{"n": 1}, {"n": 2}, {"n": 3}]
    conn.execute("update pgque.blocked_key set bk_retry_at = now() + interval '1 hour'")
    assert client.replay_dead_letters("q", "g", key="a", dry_run=True) == 3
    out = ok(run_cli("dlq", "replay", "q", "--all", "--key", "a", "--dry-run", "--dsn", dsn))
    assert "would replay 3 dead letters" in out
    assert client.replay_dead_letters("q", "g", key="a", as_next=True) == 3
    held, events = slot.receive()
    assert [(k, n) for k, n, _r in events] == [("a", 1), ("a", 2), ("a", 3), ("a", 4)]
    slot.ack(held)
    assert slot.blocked() == []


def test_bulk_replay_and_purge_filter_and_refuse_bad_input(
        conn: psycopg.Connection[Any], client: pgque.Client, dsn: str) -> None:
    conn.execute("select pgque.create_queue('q', '{\"max_retries\": 0}')")
    conn.execute("select pgque.subscribe('q', 'plain')")
    for key, kind in (("a", "x"), ("b", "x"), ("c", "y")):
        conn.execute("select pgque.send('q', %s, '{}', %s)", (kind, key))
    conn.execute("select pgque.tick('q')")
    rows = conn.execute("select batch_id, ev_id from pgque.receive('q', 'plain')").fetchall()
    conn.execute("select pgque.ack('q', 'plain', %s, %s, '{disk full}', '0')",
                 (rows[0][0], [r[1] for r in rows]))
    assert client.purge_dead_letters_where("q", type="x", dry_run=True) == 2
    assert client.purge_dead_letters_where("q", reason="nope") == 0
    assert client.purge_dead_letters_where("q", older_than=3600) == 0
    with pytest.raises(pgque.InvalidArgument):
        client.purge_dead_letters_where("q", older_than=-1)
    with pytest.raises(pgque.InvalidArgument):  # a plain consumer's: no key order to keep
        client.replay_dead_letters("q", as_next=True)
    assert len(client.dead_letters("q")) == 3  # all or none
    assert client.replay_dead_letters("q", type="y") == 1
    assert "purged 2 dead letters" in ok(run_cli("dlq", "purge", "q", "--reason", "disk",
                                                 "--yes", "--dsn", dsn))
    assert client.dead_letters("q") == []


def test_bulk_dead_letter_calls_reach_only_what_the_role_may_use(
        conn: psycopg.Connection[Any], role_clients: dict[str, pgque.Client]) -> None:
    owner, other = role_clients["reader"], role_clients["other"]
    slot = scalar(conn, "select pgque.slot_of('a', 4)")
    conn.execute("update pgque.queue set queue_max_retries = 0")
    assert scalar(conn, "select pgque.claim_slot('q', 'g', %s)", (slot,))
    conn.execute("select pgque.send('q', 'e', '1', 'a')")
    conn.execute("select pgque.tick('q')")
    [(batch, ev_id)] = conn.execute("select batch_id, ev_id from"
                                    " pgque.receive_partitioned('q', 'g', %s, 4)",
                                    (slot,)).fetchall()
    conn.execute("select pgque.ack_partitioned('q', 'g', %s, 4, %s, %s, '{boom}', '0')",
                 (slot, batch, [ev_id]))
    assert other.replay_dead_letters("q", dry_run=True) == 0
    assert other.purge_dead_letters_where("q") == 0
    with pytest.raises(pgque.ConsumerAccessDenied):
        other.replay_dead_letters("q", "g")
    assert owner.replay_dead_letters("q", "g", dry_run=True) == 1
    assert owner.replay_dead_letters("q", "g", as_next=True) == 1
    [blocked] = owner.blocked_keys("q", "g")
    assert (blocked.key, blocked.event_id, blocked.attempts) == ("a", ev_id, 0)


def test_a_groups_own_max_retries_beats_the_queues(conn: psycopg.Connection[Any],
                                                   client: pgque.Client) -> None:
    slot = Slot(conn, policy="skip")
    client.set_failure_policy("q", "g", "skip", max_retries=0)
    assert client.failure_policy("q", "g").max_retries == 0
    slot.send(("a", 1))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1),))  # the queue allows 5 retries; the group none
    [letter] = client.dead_letters("q", "g")
    assert (letter.payload, letter.retry_count) == ({"n": 1}, 0)
    with pytest.raises(pgque.InvalidArgument):
        client.set_failure_policy("q", "g", "skip", max_retries=-1)
    assert client.failure_policy("q", "g").max_retries == 0


def test_a_head_that_kills_its_worker_every_time_ends_at_pause_timeout(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """Losses do not count as attempts, but they do not outlast pause_timeout:
    once the head has blocked its key that long, the next owner's receive sends
    it to the dead letters and hands out what waited behind it."""
    slot = Slot(conn, max_attempts=3)
    slot.send(("a", 1), ("a", 2))
    batch, _ = slot.receive()
    slot.ack(batch, failed=(("a", 1), ("a", 2)))  # a1's attempt 1
    conn.execute("select pgque.release_slot('q', 'g', 0)")
    seen = []
    for _ in range(3):  # each owner receives the piece and dies before its ack
        with psycopg.connect(dsn, autocommit=True) as worker:
            assert scalar(worker, "select pgque.claim_slot('q', 'g', 0)")
            seen.append(worker.execute(
                "select (ev_data::json->>'n')::int, ev_retry"
                "  from pgque.receive_partitioned('q', 'g', 0, 1)").fetchall())
            pid = worker.info.backend_pid
        # Its backend, and its hold of the slot, end a moment after the close.
        wait_for(lambda pid=pid: not scalar(
            conn, "select count(*) from pg_stat_activity where pid = %s", (pid,)),
            what="the owner's backend to end", dsn=dsn)
    assert seen == [[(1, 1), (2, 0)]] * 3  # no loss counted as an attempt
    assert scalar(conn, "select count(*) from pgque.dead_letter") == 0
    # The hour passes: the next owner finds the head expired.
    conn.execute("update pgque.blocked_key set bk_since = bk_since - interval '2 hours'")
    assert scalar(conn, "select pgque.claim_slot('q', 'g', 0)")
    _held, events = slot.receive()
    assert events == [("a", 2, 0)]
    [(data, reason)] = conn.execute("select ev_data, dl_reason from pgque.dead_letter")
    assert data == '{"n": 1}' and "lost" in reason and "pause_timeout" in reason
