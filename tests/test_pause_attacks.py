"""Attacks on the pause failure policy (docs/concepts.md "Failure policies",
docs/guarantees.md "Failures: the pause policy", docs/operations.md "Blocked
keys" and "Security"). Each test says which promise it attacks; a failing test
asserts what the documentation promises."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from helpers import scalar, slot_keys, sqlstate_of, wait_for

import pgque

Rows = list[tuple[Any, ...]]


class Sess:
    """A session working slot `slot` of group g (of `slots` slots) of queue q
    through the public SQL functions."""

    def __init__(self, dsn: str, slot: int = 0, slots: int = 1, claim: bool = True) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.slot, self.slots = slot, slots
        self.ids: dict[tuple[str, int], int] = {}
        if claim:
            assert scalar(self.conn, "select pgque.claim_slot('q', 'g', %s)", (slot,))

    def receive(self, max_events: int | None = None) -> tuple[int | None, Rows]:
        rows = self.conn.execute(
            "select batch_id, ev_id, ev_extra1, (ev_data::json->>'n')::int, ev_retry"
            "  from pgque.receive_partitioned('q', 'g', %s, %s, %s)",
            (self.slot, self.slots, max_events)).fetchall()
        if not rows:
            return None, []
        for _b, ev_id, key, n, _r in rows:
            if ev_id is not None:
                self.ids[(key, n)] = ev_id
        return rows[0][0], [(key, n, retry) for _b, ev_id, key, n, retry in rows
                            if ev_id is not None]

    def ack(self, batch: int | None, failed: tuple[tuple[str, int], ...] = (),
            retry_after: str = "0") -> Any:
        return scalar(self.conn,
                      "select pgque.ack_partitioned('q', 'g', %s, %s, %s, %s, %s, %s::interval)",
                      (self.slot, self.slots, batch, [self.ids[f] for f in failed],
                       ["boom"] * len(failed), retry_after))

    def nack(self, batch: int | None, failed: tuple[tuple[str, int], ...],
             retry_after: str = "0") -> Any:
        return scalar(self.conn,
                      "select pgque.nack_partitioned('q', 'g', %s, %s, %s, %s, %s::interval, 'x')",
                      (self.slot, self.slots, batch, [self.ids[f] for f in failed], retry_after))

    def close(self) -> None:
        self.conn.close()


def setup_group(conn: psycopg.Connection[Any], *, slots: int = 1, policy: str = "pause",
                max_attempts: int | None = 10, pause_timeout: str | None = "1 hour") -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', %s)", (slots,))
    conn.execute("select pgque.set_failure_policy('q', 'g', %s, %s, %s::interval)",
                 (policy, max_attempts, pause_timeout))


def send(conn: psycopg.Connection[Any], *events: tuple[str | None, int]) -> None:
    for key, n in events:
        conn.execute("select pgque.send('q', 'e', %s, %s)", (json.dumps({"n": n}), key))
    conn.execute("select pgque.tick('q')")


def blocked(conn: psycopg.Connection[Any]) -> Rows:
    return conn.execute("select key, attempts, held_behind from pgque.blocked_keys('q', 'g')"
                        " order by key").fetchall()


def dead(conn: psycopg.Connection[Any]) -> list[tuple[str, int]]:
    return [(k, json.loads(d)["n"]) for k, d in conn.execute(
        "select ev_extra1, ev_data from pgque.dead_letters('q') order by dl_id")]


def make_due(conn: psycopg.Connection[Any]) -> None:
    conn.execute("update pgque.blocked_key set bk_retry_at = now() - interval '1 second'")


def drain(sess: Sess, limit: int = 20) -> list[tuple[str, int, int]]:
    """Receives and acks (all handled) until nothing comes; what was handed out."""
    out: list[tuple[str, int, int]] = []
    for _ in range(limit):
        batch, events = sess.receive()
        if batch is None:
            break
        out += events
        sess.ack(batch)
    return out


# -- ordering under crashes between calls -------------------------------------------------


def test_nack_partitioned_committed_then_crash_does_not_hand_out_later_events_early(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """guarantees.md: "no later event of K is handed to a handler until that event
    has been handled or dead-lettered" and "a worker that dies before that commit
    gets the piece back, whole". nack_partitioned commits on its own (autocommit),
    then the worker dies before the ack: the next owner must not get a2 before a1
    is handled, and a1/a2 must each come (to a transactional handler) once."""
    setup_group(conn)
    send(conn, ("a", 1), ("a", 2), ("b", 1))
    w1 = Sess(dsn)
    batch, events = w1.receive()
    assert events == [("a", 1, 0), ("a", 2, 0), ("b", 1, 0)]
    w1.nack(batch, (("a", 1), ("a", 2)))  # as the docs ask: a1 and what follows it
    w1.close()  # dies before the ack
    w2 = Sess(dsn)
    handed: list[tuple[str, int, int]] = []
    for _ in range(10):
        make_due(conn)
        batch, events = w2.receive()
        if batch is None:
            break
        handed += events
        w2.ack(batch)
    keyed = [(k, n) for k, n, _r in handed if k == "a"]
    # a1 before a2, each handled once (a transactional handler's effects commit
    # with the ack: a redelivered piece that was never acked does not count).
    assert keyed == [("a", 1), ("a", 2)], handed
    w2.close()


def test_nack_partitioned_then_ack_counts_one_failure(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: "the marker counts only the head's real failures". A
    consumer that nacks a1 with nack_partitioned and then acks the piece has
    failed a1 once, not twice; and a held event's retry count stays as it was."""
    setup_group(conn)
    send(conn, ("a", 1), ("a", 2))
    w = Sess(dsn)
    batch, _ = w.receive()
    w.nack(batch, (("a", 1), ("a", 2)))
    w.ack(batch)
    assert blocked(conn) == [("a", 1, 1)]
    make_due(conn)
    _b, events = w.receive()
    assert events == [("a", 1, 1), ("a", 2, 0)]


def test_re_receive_with_smaller_max_events_does_not_lose_or_duplicate(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """guarantees.md: "every event of K the slot read while K was blocked was set
    aside behind the head, and every later one comes after"; each once. A log
    piece is received with a large max_events (setting a's events aside), not
    acked, received again with max_events=1 and acked: a's events must come,
    after a1, each once, in order; b's each once."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1),), retry_after="1 hour")
    send(conn, ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3))
    batch, first = w.receive(max_events=10)
    batch2, events2 = w.receive(max_events=1)
    assert batch2 == batch
    w.ack(batch2)
    handled = list(events2)
    handled += drain(w)
    make_due(conn)
    handled += drain(w)
    got = [(k, n) for k, n, _r in handled]
    assert sorted(got) == sorted(set(got)), (first, handled)
    assert [x for x in got if x[0] == "a"] == [("a", 1), ("a", 2), ("a", 3)], handled
    assert [x for x in got if x[0] == "b"] == [("b", 1), ("b", 2), ("b", 3)], handled


def test_re_receive_with_larger_max_events_does_not_hand_later_event_out_early(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Same promise with the max_events growing between receives of the same
    held piece: the piece handed out again must not skip the head."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2), ("a", 3))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2), ("a", 3)))
    held, events = w.receive(max_events=1)
    assert events == [("a", 1, 1)]
    held2, events2 = w.receive(max_events=5)
    assert held2 == held
    assert events2[0] == ("a", 1, 1)
    # a1 fails again; the consumer nacks a1 and what came after it in this piece
    w.ack(held2, tuple((k, n) for k, n, _r in events2))
    make_due(conn)
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 1), ("a", 2), ("a", 3)], out


def test_release_mid_held_piece_and_claim_elsewhere_keeps_the_head_first(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """guarantees.md: "a takeover carries the marker and the held events with the
    slot". A held piece is out, its owner releases the slot without acking; the
    next owner gets the head first, and the key's later events after it."""
    setup_group(conn)
    w1 = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w1.receive()
    w1.ack(batch, (("a", 1), ("a", 2)))
    _held, events = w1.receive()
    assert events == [("a", 1, 1), ("a", 2, 0)]
    w1.conn.execute("select pgque.release_slot('q', 'g', 0)")
    send(conn, ("a", 3), ("b", 1))
    w2 = Sess(dsn)
    out = drain(w2)
    keyed = [(k, n) for k, n, _r in out if k == "a"]
    assert keyed == [("a", 1), ("a", 2), ("a", 3)], out


def test_ack_of_an_old_batch_id_is_refused_and_does_not_clear_the_marker(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A slot has at most one piece out; acking the log piece's old batch id
    while a held piece is out must not finish the held piece (PQ003) and must
    leave the key blocked."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    old, _ = w.receive()
    w.ack(old, (("a", 1), ("a", 2)))
    held, _ = w.receive()
    assert held != old
    state = sqlstate_of(lambda: w.ack(old))
    assert state == "PQ003"
    assert blocked(conn) == [("a", 1, 1)]


def test_ack_receive_partitioned_with_nacks_blocks_and_next_piece_holds_key(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """ack_receive_partitioned: nacks then ack then receive, one transaction. The
    piece it returns must not contain a later event of the key it just blocked."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("b", 1))
    batch, _ = w.receive()
    send(conn, ("a", 2), ("b", 2))
    rows = w.conn.execute(
        "select ev_extra1, (ev_data::json->>'n')::int from pgque.ack_receive_partitioned("
        "'q', 'g', 0, 1, %s, %s, '{boom}', '1 hour')", (batch, [w.ids[("a", 1)]])).fetchall()
    assert [r for r in rows if r[0] is not None] == [("b", 2)]
    assert blocked(conn) == [("a", 1, 1)]


def test_receive_slots_and_ack_slots_finish_a_held_piece(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """receive_slots hands out a slot's held piece like receive_partitioned, and
    ack_slots acks it as any piece: the marker goes in that ack."""
    setup_group(conn, slots=2)
    k0 = slot_keys(conn, 0, 2)[0]
    w = Sess(dsn, 0, 2)
    assert scalar(w.conn, "select pgque.claim_slot('q', 'g', 1)")
    send(conn, (k0, 1), (k0, 2))
    batch, _ = w.receive()
    w.ack(batch, ((k0, 1), (k0, 2)))
    rows = w.conn.execute("select slot, batch_id, ev_extra1, (ev_data::json->>'n')::int"
                          " from pgque.receive_slots('q', 'g', 2, '{0,1}')").fetchall()
    got = [(r[2], r[3]) for r in rows if r[2] is not None]
    assert got == [(k0, 1), (k0, 2)]
    bid = next(r[1] for r in rows if r[0] == 0)
    assert w.conn.execute("select pgque.ack_slots('q', 'g', 2, '{0}', %s)",
                          ([bid],)).fetchone()[0] == [True]
    assert blocked(conn) == []


def test_held_piece_nack_is_refused_and_changes_nothing(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """api.md: nack_partitioned of a piece of held events is PQ029."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2)))
    held, _ = w.receive()
    assert sqlstate_of(lambda: w.nack(held, (("a", 1),))) == "PQ029"
    assert blocked(conn) == [("a", 1, 1)]


def test_as_next_replay_while_log_piece_of_the_key_is_out_then_nack(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: a dead letter replayed as_next "comes back as the next event
    of its key in its slot, before the key's events the slot has not handed out
    yet". While a log piece with a5 is out, a0 is replayed as_next; the
    consumer then fails a5. Nothing may be lost: a0 must still come, before a5's
    retry, and a5 must come again."""
    setup_group(conn, max_attempts=1)
    w = Sess(dsn)
    send(conn, ("a", 0))
    batch, _ = w.receive()
    w.ack(batch, (("a", 0),))  # max_attempts=1: a0 goes to the dead letters
    assert dead(conn) == [("a", 0)]
    conn.execute("select pgque.set_failure_policy('q', 'g', 'pause', 10, '1 hour')")
    send(conn, ("a", 5))
    batch, events = w.receive()
    assert events == [("a", 5, 0)]
    dl = scalar(conn, "select dl_id from pgque.dead_letters('q')")
    conn.execute("select pgque.replay_dead_letter('q', %s, true)", (dl,))
    w.ack(batch, (("a", 5),))
    make_due(conn)
    out = drain(w)
    make_due(conn)
    out += drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 0), ("a", 5)], out


def test_as_next_replay_while_held_piece_is_out_is_refused(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """api.md: replay_dead_letter(as_next) is HeadInFlight (PQ028) while the key's
    head is handed out."""
    setup_group(conn, max_attempts=1)
    w = Sess(dsn)
    send(conn, ("a", 0))
    batch, _ = w.receive()
    w.ack(batch, (("a", 0),))
    conn.execute("select pgque.set_failure_policy('q', 'g', 'pause', 10, '1 hour')")
    send(conn, ("a", 1))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1),))
    _held, _ = w.receive()
    dl = scalar(conn, "select dl_id from pgque.dead_letters('q')")
    assert sqlstate_of(lambda: conn.execute(
        "select pgque.replay_dead_letter('q', %s, true)", (dl,))) == "PQ028"


# -- the ledger verbs ---------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["retry_head", "skip_head", "resume_key"])
def test_ledger_verb_while_held_piece_is_out_is_head_in_flight(
        dsn: str, conn: psycopg.Connection[Any], verb: str) -> None:
    """operations.md: "A verb on a key whose head a worker has in hand right now
    is refused (HeadInFlight)"."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2)))
    w.receive()
    assert sqlstate_of(lambda: conn.execute(f"select pgque.{verb}('q', 'g', 'a')")) == "PQ028"
    assert blocked(conn) == [("a", 1, 1)]


def test_skip_head_while_a_log_piece_is_out_hands_held_events_once(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """guarantees.md: each event handed once to a transactional handler. Key a is
    blocked; a log piece is out (a2 set aside by its receive); the operator
    skips a1; the piece is received again and acked: a2 must come once, after."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1),), retry_after="1 hour")
    send(conn, ("a", 2), ("b", 1), ("a", 3))
    batch, events = w.receive()
    assert events == [("b", 1, 0)]
    assert conn.execute("select pgque.skip_head('q', 'g', 'a')").fetchone()[0] == w.ids.get(
        ("a", 1), scalar(conn, "select ev_id from pgque.dead_letters('q')"))
    batch2, events2 = w.receive()
    assert batch2 == batch
    handled = list(events2)
    w.ack(batch2)
    handled += drain(w)
    got = [(k, n) for k, n, _r in handled]
    assert [x for x in got if x[0] == "a"] == [("a", 2), ("a", 3)], handled
    assert got.count(("b", 1)) == 1


def test_resume_key_while_a_log_piece_is_out(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """resume_key lets the key go on with its held events and sends the head to
    the retry queue: each event comes once, held ones in order."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1),), retry_after="1 hour")
    send(conn, ("a", 2), ("b", 1), ("a", 3))
    batch, _ = w.receive()
    conn.execute("select pgque.resume_key('q', 'g', 'a')")
    batch2, events2 = w.receive()
    handled = list(events2)
    w.ack(batch2)
    handled += drain(w)
    conn.execute("select pgque.maint()")
    conn.execute("select pgque.tick('q')")
    handled += drain(w)
    got = [(k, n) for k, n, _r in handled]
    a_events = [x for x in got if x[0] == "a"]
    assert a_events[:2] == [("a", 2), ("a", 3)], handled
    assert len(a_events) == len(set(a_events)), handled


@pytest.mark.parametrize("key", [None, "", "nope"])
@pytest.mark.parametrize("verb", ["retry_head", "skip_head", "resume_key"])
def test_ledger_verbs_on_a_key_not_blocked(
        conn: psycopg.Connection[Any], verb: str, key: str | None) -> None:
    """api.md: KeyNotBlocked (PQ027) unless the key is blocked in the group."""
    setup_group(conn)
    state = sqlstate_of(lambda: conn.execute(f"select pgque.{verb}('q', 'g', %s)", (key,)))
    assert state in ("PQ027", "22023", "22004"), state


def test_ledger_verb_on_a_key_of_a_plain_consumer_or_other_queue(
        conn: psycopg.Connection[Any]) -> None:
    """Ledger verbs on a plain consumer and an unknown queue are refused with a
    pgque error."""
    setup_group(conn)
    conn.execute("select pgque.subscribe('q', 'plain')")
    assert sqlstate_of(lambda: conn.execute("select pgque.retry_head('q', 'plain', 'a')")) \
        is not None
    assert sqlstate_of(lambda: conn.execute("select pgque.retry_head('nope', 'g', 'a')")) \
        is not None


def test_empty_string_key_under_pause(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """An event with partition key '' is either keyless (retried as under skip)
    or blocks key '': either way its later events of key '' may not come before it
    is handled, and the ledger must name it."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("", 1), ("", 2))
    batch, _ = w.receive()
    w.ack(batch, (("", 1), ("", 2)), retry_after="1 hour")
    send(conn, ("", 3))
    _b, events = w.receive()
    rows = blocked(conn)
    if rows:
        assert events == [], events
    else:
        # keyless: retried as under skip: then '' would be a key for routing but
        # not for order. The docs say events *without* a partition key.
        pytest.fail(f"key '' not blocked; events handed out {events}")


def test_keyless_events_are_retried_as_under_skip(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: events without a partition key are retried as under skip."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, (None, 1), (None, 2))
    batch, _ = w.receive()
    w.ack(batch, ((None, 1),))
    assert blocked(conn) == []
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 1


# -- bounds and policy changes ------------------------------------------------------------


@pytest.mark.parametrize(("max_attempts", "timeout"), [
    (-1, "1 hour"), (0, "1 hour"), (10, "-1 hour"), (10, "0"), (10, "-1 second")])
def test_bad_bounds_are_refused(conn: psycopg.Connection[Any], max_attempts: int,
                                timeout: str) -> None:
    """api.md: 22023 for max_attempts below 1 or pause_timeout not above zero."""
    setup_group(conn, policy="skip")
    assert sqlstate_of(lambda: conn.execute(
        "select pgque.set_failure_policy('q', 'g', 'pause', %s, %s::interval)",
        (max_attempts, timeout))) == "22023"


def test_null_policy_is_refused(conn: psycopg.Connection[Any]) -> None:
    """api.md: 22023 for another policy; null is not 'skip' or 'pause'."""
    setup_group(conn, policy="skip")
    assert sqlstate_of(lambda: conn.execute(
        "select pgque.set_failure_policy('q', 'g', null)")) == "22023"
    assert scalar(conn, "select cg_policy from pgque.consumer_group") == "skip"


def test_max_attempts_not_the_queue_max_retries_bounds_a_pause(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: a pause is bounded per group by max_attempts (failures of the
    head). With the queue's max_retries below it, the head is still attempted
    max_attempts times before it is dead-lettered."""
    setup_group(conn, max_attempts=4)
    conn.execute("update pgque.queue set queue_max_retries = 1 where queue_name = 'q'")
    w = Sess(dsn)
    send(conn, ("a", 1))
    attempts = 0
    for _ in range(10):
        make_due(conn)
        batch, _events = w.receive()
        if batch is None:
            break
        attempts += 1
        w.ack(batch, (("a", 1),))
    assert attempts == 4
    assert dead(conn) == [("a", 1)]


def test_unbounded_pause_never_dead_letters(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: either bound may be None: a pause with no bound waits."""
    setup_group(conn, max_attempts=None, pause_timeout=None)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    for _ in range(15):
        make_due(conn)
        batch, events = w.receive()
        w.ack(batch, tuple((k, n) for k, n, _r in events))
    assert dead(conn) == []
    assert blocked(conn) == [("a", 15, 1)]


def test_pause_timeout_dead_letters_head_and_key_goes_on_in_order(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: once the head has blocked its key for pause_timeout, it goes
    to the dead letters and the key moves on, its held events in order."""
    setup_group(conn, pause_timeout="1 second")
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2), ("a", 3))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2), ("a", 3)), retry_after="1 hour")
    # The second passes: the head blocked its key since longer ago.
    conn.execute("update pgque.blocked_key set bk_since = bk_since - interval '2 seconds'")
    make_due(conn)
    out = drain(w)
    assert dead(conn) == [("a", 1)]
    assert [(k, n) for k, n, _r in out] == [("a", 2), ("a", 3)], out


def test_pause_skip_pause_with_blocked_keys(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: going back to skip releases every blocked key (held events
    next, in order). Flipping to skip and back to pause before the slot receives
    must not lose held events nor hand a later event before them."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2)), retry_after="1 hour")
    conn.execute("select pgque.set_failure_policy('q', 'g', 'skip')")
    conn.execute("select pgque.set_failure_policy('q', 'g', 'pause')")
    send(conn, ("a", 3))
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 1), ("a", 2), ("a", 3)], out


def test_skip_while_held_piece_is_out_then_failure(dsn: str,
                                                  conn: psycopg.Connection[Any]) -> None:
    """A change to skip while a held piece is out: the piece's ack with a failure
    goes by skip (to the retry queue), nothing lost, no key stays blocked."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2)))
    held, _ = w.receive()
    conn.execute("select pgque.set_failure_policy('q', 'g', 'skip')")
    w.ack(held, (("a", 1),))
    assert blocked(conn) == []
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 1
    # held rows are never deleted (rotation empties them); nothing more is handed
    send(conn, ("a", 3))
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 3)], out


# -- security -----------------------------------------------------------------------------


def test_every_security_definer_function_pins_search_path(conn: psycopg.Connection[Any]) -> None:
    """operations.md Security: every public function is SECURITY DEFINER; each
    must pin search_path or a caller's schema could hijack it."""
    rows = conn.execute(
        "select p.oid::regprocedure::text from pg_proc p"
        " where p.pronamespace = 'pgque'::regnamespace and p.prosecdef"
        " and not exists (select 1 from unnest(coalesce(p.proconfig, '{}')) c"
        "                 where c like 'search_path=%')").fetchall()
    assert rows == []


def test_new_functions_are_not_callable_by_public(conn: psycopg.Connection[Any]) -> None:
    """operations.md: a role with none of pgque's roles may call nothing."""
    rows = conn.execute(
        "select p.oid::regprocedure::text from pg_proc p"
        " where p.pronamespace = 'pgque'::regnamespace"
        " and has_function_privilege('public', p.oid, 'execute')").fetchall()
    assert rows == []


def _block_for_reader(role_clients: dict[str, pgque.Client]) -> tuple[pgque.Client, str]:
    reader = role_clients["reader"]
    reader.set_failure_policy("q", "g", "pause")
    key = "secret-key"
    role_clients["admin"].send("q", "e", {"card": "4111"}, partition_key=key)
    role_clients["admin"].tick("q")
    for s in range(4):
        assert reader.claim_slot("q", "g", s)
    for s in range(4):
        b = reader.receive_partitioned("q", "g", slot=s, slots=4)
        if b is not None:
            reader.ack(b, nack=b.messages, retry_after=3600)
    assert len(reader.blocked_keys("q", "g")) == 1
    return reader, key


def test_other_team_cannot_read_or_act_on_blocked_keys(
        role_clients: dict[str, pgque.Client]) -> None:
    """operations.md: retry, skip and resume are for roles that may use the
    group; reading its status and keys is refused to every other role."""
    _reader, key = _block_for_reader(role_clients)
    for kind in ("other", "writer", "nobody"):
        c = role_clients[kind]
        for call in (lambda c=c: c.blocked_keys("q", "g"),
                     lambda c=c: c.retry_head("q", "g", key),
                     lambda c=c: c.skip_head("q", "g", key),
                     lambda c=c: c.resume_key("q", "g", key),
                     lambda c=c: c.failure_policy("q", "g"),
                     lambda c=c: c.set_failure_policy("q", "g", "skip")):
            with pytest.raises((pgque.AccessDenied, pgque.PgqueError, psycopg.Error)):
                call()
    assert len(role_clients["reader"].blocked_keys("q", "g")) == 1
    assert role_clients["reader"].failure_policy("q", "g").policy == "pause"


def test_other_team_cannot_read_held_or_blocked_tables_or_views(
        role_clients: dict[str, pgque.Client]) -> None:
    """operations.md: other roles cannot read events; the held events' payloads
    and the markers' heads and errors are events too."""
    _block_for_reader(role_clients)
    role_clients["admin"].send("q", "e", {"card": "5500"}, partition_key="secret-key")
    role_clients["admin"].tick("q")
    reader = role_clients["reader"]
    for s in range(4):
        b = reader.receive_partitioned("q", "g", slot=s, slots=4)
        if b is not None:
            reader.ack(b)
    for kind in ("other", "writer", "nobody", "reader"):
        c = role_clients[kind]
        for table in ("pgque.held_event", "pgque.blocked_key"):
            if not c.conn.autocommit:
                c.conn.rollback()
            assert sqlstate_of(lambda c=c, table=table: c.conn.execute(
                f"select * from {table}").fetchall()) \
                == "42501", (kind, table)
    for kind in ("other", "writer", "nobody"):
        c = role_clients[kind]
        for view in ("pgque.group_info", "pgque.partition_slot_status"):
            try:
                rows = c.conn.execute(f"select * from {view}").fetchall()
            except psycopg.Error:
                continue  # refused outright: fine
            assert rows == [], (kind, view, rows)


def test_other_team_cannot_replay_or_purge_blocked_group_dead_letters(
        role_clients: dict[str, pgque.Client]) -> None:
    """operations.md: dead letters follow the subscription; bulk verbs of a role
    that is not an admin act only on the consumers it may use (the dry-run count
    included)."""
    reader, key = _block_for_reader(role_clients)
    reader.skip_head("q", "g", key, reason="nope")
    other = role_clients["other"]
    assert other.replay_dead_letters("q", dry_run=True) == 0
    assert other.purge_dead_letters_where("q", dry_run=True) == 0
    assert other.purge_dead_letters_where("q", key=key) == 0
    dl = reader.dead_letters("q")[0].id
    with pytest.raises(pgque.AccessDenied):
        other.replay_dead_letter("q", dl, as_next=True)
    with pytest.raises((pgque.AccessDenied, pgque.PgqueError)):
        other.replay_dead_letters("q", "g", as_next=True)
    assert len(reader.dead_letters("q")) == 1


# -- rotation and bloat -------------------------------------------------------------------


def test_rotating_held_events_with_zero_period_loses_nothing(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """operations.md: held rows "stay until the block ends and a rotation empties
    them": a rotation must never take a held event that still waits."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2), ("a", 3))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1), ("a", 2), ("a", 3)), retry_after="1 hour")
    conn.execute("update pgque.rotation set rt_period = '0' where rt_name = 'held'")
    for _ in range(4):
        conn.execute("select pgque.maint()")
        send(conn, ("a", 10 + _))
        batch, _events = w.receive()
        if batch is not None:
            w.ack(batch)
    make_due(conn)
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 1), ("a", 2), ("a", 3), ("a", 10),
                                            ("a", 11), ("a", 12), ("a", 13)], out


def test_a_key_never_blocked_writes_nothing(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """concepts.md: "Nothing of this is written for a key that is not blocked"."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("b", 1))
    drain(w)
    assert scalar(conn, "select count(*) from pgque.held_event") == 0
    assert scalar(conn, "select count(*) from pgque.blocked_key") == 0


def test_a_second_nack_of_a_later_event_of_a_blocked_key_is_not_lost(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """api.md nack_partitioned: "under pause each key of them is blocked from its
    first one (the events nacked set aside, in order, behind it)"; concepts.md:
    a consumer calling the SQL nacks "every event of the key from the failed one
    on that it did not handle". A consumer that nacks a1 as it fails
    (nack_partitioned) and a2 later (in the ack, or a second nack_partitioned)
    has not handled a2: a2 must come after a1, not vanish."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2), ("b", 1))
    batch, _ = w.receive()
    w.nack(batch, (("a", 1),))          # a1 fails
    w.ack(batch, (("a", 2),))           # a2 not run, nacked with the ack
    make_due(conn)
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 1), ("a", 2)], (out, blocked(conn))


def test_a_repeated_nack_partitioned_with_a_later_event_is_not_lost(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Same promise through two nack_partitioned calls: nack [a1], then nack
    [a1, a2] (a repeated nack that adds a2), then the ack."""
    setup_group(conn)
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w.receive()
    w.nack(batch, (("a", 1),))
    w.nack(batch, (("a", 1), ("a", 2)))
    w.ack(batch)
    make_due(conn)
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 1), ("a", 2)], (out, blocked(conn))


def test_as_next_replay_while_log_piece_is_out_stalls_the_slot(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """guarantees.md promises the key's events "handed out in send order ... at
    least once", and operations.md that a stuck key is for the operator to act
    on. After an as_next replay while a log piece with a later event of the key
    is out, the worker's ack of that piece with the event failed is refused
    every time (PQ010): the slot can never move on unless the consumer lies
    that the event was handled."""
    setup_group(conn, max_attempts=1)
    w = Sess(dsn)
    send(conn, ("a", 0))
    batch, _ = w.receive()
    w.ack(batch, (("a", 0),))
    conn.execute("select pgque.set_failure_policy('q', 'g', 'pause', 10, '1 hour')")
    send(conn, ("a", 5), ("b", 1))
    batch, _ = w.receive()
    dl = scalar(conn, "select dl_id from pgque.dead_letters('q')")
    conn.execute("select pgque.replay_dead_letter('q', %s, true)", (dl,))
    refusals = 0
    for _ in range(3):
        batch, events = w.receive()
        assert ("a", 5, 0) in events
        if sqlstate_of(lambda batch=batch: w.ack(batch, (("a", 5),))) is None:
            break
        refusals += 1
    assert refusals == 0, "the piece can never be acked with its failure"


def test_upgrade_from_0_5_with_live_state_then_pause(empty_dsn: str) -> None:
    """A 0.5.0 database with a group mid-batch, a retry and a dead letter,
    upgraded by pgque.install, then switched to pause: the open batch's ack
    with a failure blocks the key, later events wait, the dead letter can be
    replayed as_next, and everything comes in key order."""
    from helpers import install_0_5
    install_0_5(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("select pgque.create_queue('q')")
        c.execute("select pgque.subscribe_slots('q', 'g', 1)")
        assert scalar(c, "select pgque.claim_slot('q', 'g', 0)")
        send(c, ("a", 0))
        rows = c.execute("select batch_id, ev_id from pgque.receive_partitioned('q','g',0,1)"
                         ).fetchall()
        c.execute("update pgque.queue set queue_max_retries = 0")
        c.execute("select pgque.ack_partitioned('q','g',0,1,%s,%s,'{x}','0')",
                  (rows[0][0], [rows[0][1]]))
        assert len(dead(c)) == 1
        c.execute("update pgque.queue set queue_max_retries = 5")
        send(c, ("a", 1), ("a", 2), ("b", 1))
        rows = c.execute("select batch_id, ev_id, ev_extra1 from"
                         " pgque.receive_partitioned('q','g',0,1)").fetchall()
        open_batch = rows[0][0]
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        pgque.install(c)
        c.execute("select pgque.set_failure_policy('q', 'g', 'pause')")
    w = Sess(empty_dsn)
    batch, _events = w.receive()
    assert batch == open_batch
    w.ack(batch, (("a", 1), ("a", 2)))
    assert [r[0] for r in blocked(w.conn)] == ["a"]
    send(w.conn, ("a", 3))
    dl = scalar(w.conn, "select dl_id from pgque.dead_letters('q')")
    w.conn.execute("select pgque.replay_dead_letter('q', %s, true)", (dl,))
    out = drain(w)
    assert [(k, n) for k, n, _r in out if k == "a"] == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]


@pytest.mark.parametrize("verb", ["skip_head", "resume_key", "retry_head"])
def test_ledger_verbs_work_once_the_worker_holding_the_head_is_gone(
        dsn: str, conn: psycopg.Connection[Any], verb: str) -> None:
    """operations.md: "A verb on a key whose head a worker has in hand right now
    is refused (HeadInFlight)". A poison head that kills its worker before the
    ack is the case the ledger is for: once that worker is gone (its session
    ended, nobody owns the slot), no worker has the head in hand, so the
    operator's skip/resume/retry must be accepted. Observed: HeadInFlight
    forever (and, as nothing is acked, max_attempts and pause_timeout never
    end the pause either)."""
    setup_group(conn, max_attempts=2, pause_timeout="1 second")
    w = Sess(dsn)
    send(conn, ("a", 1), ("b", 1))
    batch, _ = w.receive()
    w.ack(batch, (("a", 1),))
    _held, events = w.receive()
    assert events == [("a", 1, 1)]
    pid = w.conn.info.backend_pid
    w.close()  # the handler of a1 crashed the worker: no ack
    # Its backend ends (and lets go of the slot's lock) a moment after the close.
    wait_for(lambda: not scalar(conn, "select count(*) from pg_stat_activity where pid = %s",
                                (pid,)), what="the worker's backend to end", dsn=dsn)
    conn.execute("update pgque.blocked_key set bk_since = bk_since - interval '2 seconds'")
    assert sqlstate_of(lambda: conn.execute(f"select pgque.{verb}('q', 'g', 'a')")) is None


def test_bulk_as_next_replay_restores_key_order_not_dead_letter_order(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """api.md replay_dead_letters: "with as_next newest first, so that each key's
    come back in their order". Two events of key a dead-lettered in one ack
    (under skip, max_retries 0), the later one first: the bulk as_next replay
    must still bring a1 before a2 (send order of the key, guarantees.md)."""
    setup_group(conn, policy="skip")
    conn.execute("update pgque.queue set queue_max_retries = 0")
    w = Sess(dsn)
    send(conn, ("a", 1), ("a", 2))
    batch, _ = w.receive()
    w.conn.execute("select pgque.ack_partitioned('q','g',0,1,%s,%s,'{boom}','0')",
                   (batch, [w.ids[("a", 2)], w.ids[("a", 1)]]))
    assert sorted(dead(conn)) == [("a", 1), ("a", 2)]
    conn.execute("select pgque.set_failure_policy('q', 'g', 'pause')")
    assert scalar(conn, "select pgque.replay_dead_letters('q', 'g', p_as_next => true)") == 2
    out = drain(w)
    assert [(k, n) for k, n, _r in out] == [("a", 1), ("a", 2)], out
