"""`pgque verify`: the record of handler calls (Worker(record=True)) and its
check, in the recommended deployment (a non-superuser owner installed pgque, a
team's login runs the workers, the ticker is a login of its own).

One recorded run of a team's group is shared by the module: it verifies clean,
and then each kind of violation is put into a copy of its record (in a
transaction rolled back, or reverted) and must be found: a reorder, an overlap
(and a zombie window, which is not one), a loss, a misrouted call, a call
while its key was paused. Bad input to the record and a role that may not use
the group are refused and write nothing."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

import psycopg
import pytest
from helpers import run_cli, scalar, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque
from pgque.errors import translated
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"
SLOTS = 4
KEYS = [f"customer-{n}" for n in range(8)]
EVENTS = 160
CRAFTED = "crafted"  # a group whose record the property test writes itself


@dataclass
class Recorded:
    """The module's recorded run."""

    deployment: Deployment
    team: str
    sent: list[int]
    poison: int  # failed once, then handled

    def team_dsn(self) -> str:
        return self.deployment.dsn(self.deployment.login(self.team))

    def superuser(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.deployment.superuser_dsn())


def _findings(conn: psycopg.Connection[Any], since: Any = None) -> list[tuple[Any, ...]]:
    """verify_handling's rows as (kind, violation, ev_id, other_ev_id), in order."""
    return [tuple(row) for row in conn.execute(
        "select kind, violation, ev_id, other_ev_id"
        " from pgque.verify_handling(%s, %s, %s)", (QUEUE, GROUP, since)).fetchall()]


@pytest.fixture(scope="module")
def recorded(pgque_deployment_template: Deployment) -> Iterator[Recorded]:
    with pgque_deployment_template.database() as deployment:
        team = deployment.teams[0]
        with pgque.connect(deployment.dsn(deployment.owner)) as owner:
            owner.create_queue(QUEUE, ticker_max_lag=0)
        with pgque.connect(deployment.dsn(deployment.login(team))) as client:
            client.conn.execute(f"set role {team}")
            client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
            client.subscribe_slots(QUEUE, CRAFTED, slots=SLOTS)  # never consumed: records only
        with pgque.connect(deployment.dsn(deployment.producer)) as producer:
            sent = [int(i) for i in producer.send_batch(
                QUEUE, [("Order", {"n": n}, KEYS[n % len(KEYS)]) for n in range(EVENTS)])]
        poison = sent[37]
        calls: Counter[int] = Counter()
        lock = threading.Lock()

        def handle(message: pgque.Message[Any]) -> None:
            with lock:
                calls[message.id] += 1
                first = calls[message.id] == 1
            if message.id == poison and first:
                raise RuntimeError("fails once")

        dsn = deployment.dsn(deployment.login(team))
        with pgque.Ticker(deployment.dsn(deployment.ticker), maintenance_interval=0.1), \
                pgque.Worker(dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS, handler=handle,
                             key_concurrency=2, retry_after=0, poll_interval=0.05,
                             ticker=False, record=True) as worker:
            worker.wait(lambda: len(calls) == EVENTS and calls[poison] == 2, timeout=60)
            # Until the retry's ack is in: the cursors have passed everything.
            with pgque.connect(dsn) as client:
                wait_for(lambda: all(s.pending_events == 0 and s.open_batch_id is None
                                     for s in client.partition_slot_status(QUEUE)
                                     if s.consumer_name == GROUP),
                         timeout=30, what="every slot acked")
        yield Recorded(deployment, team, sent, poison)


def test_a_recorded_run_verifies_clean(recorded: Recorded) -> None:
    with pgque.connect(recorded.team_dsn()) as client:
        result = client.verify(QUEUE, GROUP)
    assert result.findings == [] and result.ok
    summary = result.summary
    # Every event once, the poison twice, by the one worker, over the keys sent.
    assert (summary.calls, summary.events, summary.keys, summary.workers) == (
        EVENTS + 1, EVENTS, len(KEYS), 1)
    with recorded.superuser() as conn:
        assert scalar(conn, "select array_agg(distinct hd_outcome::text order by"
                            " hd_outcome::text) from pgque.handling") == ["f", "o"]
        assert scalar(conn, "select count(*) from pgque.handling"
                            " where hd_ev_id = %s and hd_retry = 1", (recorded.poison,)) == 1
    out = run_cli("verify", "--queue", QUEUE, "--group", GROUP, "--dsn", recorded.team_dsn())
    assert out.returncode == 0, out.stderr
    assert f"{EVENTS + 1} handler calls of {EVENTS} events" in out.stdout
    assert "0 violations" in out.stdout


def _two_firsts_of_a_key(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Two events of one key, first handled one after the other (ids ascending)."""
    row = conn.execute(
        "select a.hd_ev_id, b.hd_ev_id from pgque.handling a join pgque.handling b"
        "  on b.hd_key = a.hd_key and b.hd_ev_id > a.hd_ev_id"
        " where a.hd_retry = 0 and b.hd_retry = 0 and a.hd_key = %s"
        " order by a.hd_ev_id, b.hd_ev_id limit 1", (KEYS[3],)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_reorder_is_found(recorded: Recorded) -> None:
    """The first calls of two events of a key swapped in time: the later event
    ran first."""
    with recorded.superuser() as conn:
        first, second = _two_firsts_of_a_key(conn)
        conn.execute(
            "update pgque.handling h set hd_started = o.hd_started, hd_ended = o.hd_ended"
            "  from pgque.handling o"
            " where (h.hd_ev_id, o.hd_ev_id) in ((%s, %s), (%s, %s))",
            (first, second, second, first))
        found = _findings(conn)
        assert ("reorder", True, first, second) in found
        assert {kind for kind, *_ in found} == {"reorder"}
        conn.rollback()
        assert _findings(conn) == []


def test_an_overlap_is_found_and_a_zombie_window_is_told_apart(recorded: Recorded) -> None:
    with recorded.superuser() as conn:
        first, second = _two_firsts_of_a_key(conn)
        saved = conn.execute("select hd_ev_id, hd_started, hd_ended, hd_epoch from pgque.handling"
                             " where hd_ev_id in (%s, %s)", (first, second)).fetchall()
        # The second call started while the first one ran, under the same epoch.
        conn.execute(
            "update pgque.handling h set hd_started = o.hd_started, hd_ended = o.hd_ended"
            "  from pgque.handling o where h.hd_ev_id = %s and o.hd_ev_id = %s",
            (second, first))
        assert ("overlap", True, second, first) in _findings(conn)
        # The first one ran under the slot's previous epoch: its owner's call in
        # flight when the slot moved, a documented window, not a violation.
        conn.execute("update pgque.handling set hd_epoch = hd_epoch - 1 where hd_ev_id = %s",
                     (first,))
        found = _findings(conn)
        assert ("zombie_window", False, second, first) in found
        assert not [f for f in found if f[1]]
        conn.commit()
        try:
            args = ("verify", "--queue", QUEUE, "--group", GROUP, "--dsn", recorded.team_dsn())
            assert run_cli(*args).returncode == 0
            strict = run_cli(*args, "--strict")
            assert strict.returncode == 1
            assert "VIOLATION zombie_window" in strict.stdout
        finally:
            for ev_id, started, ended, epoch in saved:
                conn.execute("update pgque.handling set hd_started = %s, hd_ended = %s,"
                             " hd_epoch = %s where hd_ev_id = %s", (started, ended, epoch, ev_id))
            conn.commit()
        assert _findings(conn) == []


def test_a_loss_is_found(recorded: Recorded) -> None:
    """Events acked without a handler call (a consumer that acks what it did not
    handle) are lost as far as the record can tell."""
    deployment = recorded.deployment
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        skipped = [int(i) for i in producer.send_batch(
            QUEUE, [("Order", {"n": n}, KEYS[5]) for n in range(3)])]
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.tick(QUEUE)
    with pgque.connect(recorded.team_dsn()) as client:
        slot = int(scalar(client.conn, "select pgque.slot_of(%s, %s)", (KEYS[5], SLOTS)))
        assert client.claim_slot(QUEUE, GROUP, slot)
        got: list[int] = []
        while (batch := client.receive_partitioned(QUEUE, GROUP, slot=slot,
                                                   slots=SLOTS)) is not None:
            got += [m.id for m in batch]
            client.ack(batch)
        assert got == skipped
        result = client.verify(QUEUE, GROUP)
        client.release_slot(QUEUE, GROUP, slot)
    assert [(f.kind, f.ev_id, f.slot, f.partition_key) for f in result.findings] == [
        ("lost", i, slot, KEYS[5]) for i in skipped]
    out = run_cli("verify", "--queue", QUEUE, "--group", GROUP, "--dsn", recorded.team_dsn())
    assert out.returncode == 1
    assert f"VIOLATION lost: event {skipped[0]}" in out.stdout
    # Recorded now, as a worker would have: nothing is lost any more.
    with recorded.superuser() as conn:
        conn.execute("insert into pgque.handling (hd_sub, hd_ev_id, hd_batch, hd_retry,"
                     " hd_key, hd_epoch, hd_worker, hd_started, hd_ended, hd_outcome)"
                     " select hd_sub, e.id, hd_batch, 0, hd_key, hd_epoch, 'test',"
                     "        clock_timestamp(), clock_timestamp(), 'o'"
                     "   from (select * from pgque.handling where hd_key = %s"
                     "          order by hd_started desc limit 1) h, unnest(%s::bigint[]) e(id)",
                     (KEYS[5], skipped))
        conn.commit()
        assert [f for f in _findings(conn) if f[0] == "lost"] == []


def _record(client: pgque.Client, *calls: tuple[int, int, str | None, str, str]) -> None:
    """Calls (slot, ev_id, key, outcome, start offset in ms) by record_handling."""
    with translated():
        _record_sql(client, *calls)


# Crafted calls happen a day from now: after the recording start, which
# bounds what verify reads.
LATER = time.time() + 86_400


def _record_sql(client: pgque.Client, *calls: tuple[int, int, str | None, str, str],
                group: str = GROUP, base: float = LATER) -> None:
    """record_handling's JSON: each call of batch 1, retry 0, no epoch, 1 ms long."""
    client.conn.execute(
        "select pgque.record_handling(%s, %s, %s, 'crafted', %s)",
        (QUEUE, group, SLOTS, json.dumps([
            [c[0], c[1], 1, 0, c[2], None, base + int(c[4]) / 1000,
             base + (int(c[4]) + 1) / 1000, c[3]] for c in calls])))


def test_a_misrouted_call_and_a_call_while_its_key_was_paused_are_found(
        recorded: Recorded) -> None:
    with pgque.connect(recorded.team_dsn()) as client, client.conn.transaction():
        key = KEYS[0]
        slot = int(scalar(client.conn, "select pgque.slot_of(%s, %s)", (key, SLOTS)))
        since = None
        _record(client, ((slot + 1) % SLOTS, 900_001, key, "ok", "100"))
        found = [f for f in _findings(client.conn, since) if f[2] == 900_001]
        assert found == [("misrouted", True, 900_001, None)]
        # Pause: event 900_002 failed, and 900_003 of its key ran before its retry.
        # 900_000, delivered before it, ran again meanwhile: its piece handed
        # out again after its worker died, which is no violation.
        _record(client, (slot, 900_000, key, "ok", "50"), (slot, 900_002, key, "failed", "200"),
                (slot, 900_003, key, "ok", "300"), (slot, 900_000, key, "ok", "350"),
                (slot, 900_002, key, "ok", "400"))
        client.conn.execute("select pgque.set_failure_policy(%s, %s, 'pause')", (QUEUE, GROUP))
        # (The recorded run's own failure counts too, now that the policy says pause.)
        # Reported, not as a violation: an operator's resume_key (or a dead letter
        # replayed or purged) releases a key, and the record does not hold that.
        assert [f for f in _findings(client.conn, since)
                if f[0] == "paused" and f[2] >= 900_000] == [("paused", False, 900_003, 900_002)]
        client.conn.execute("select pgque.set_failure_policy(%s, %s, 'skip')", (QUEUE, GROUP))
        assert "paused" not in {f[0] for f in _findings(client.conn, since)}
        raise_rollback(client.conn)


def raise_rollback(conn: psycopg.Connection[Any]) -> None:
    raise psycopg.Rollback()


def test_bad_records_and_roles_without_the_group_are_refused_and_write_nothing(
        recorded: Recorded) -> None:
    deployment = recorded.deployment
    with recorded.superuser() as conn:
        before = scalar(conn, "select count(*) from pgque.handling")
    with pgque.connect(recorded.team_dsn()) as client:
        for calls, error in [
                ([(SLOTS, 1, "k", "ok", "1")], pgque.InvalidSlot),
                ([(0, 1, "k", "fine", "1")], pgque.InvalidArgument),
                ([(0, 1, "x" * 513, "ok", "1")], pgque.PartitionKeyTooLong)]:
            with pytest.raises(error):
                _record(client, *calls)
        for calls_json in ['{"slot": 0}', '[[0, 1, 1, 0, "k", null, 1, 2]]',
                           '[[0, 1, 1, 0, "k", null, 2, 1, "ok"]]',  # ends before it starts
                           '[[0, null, 1, 0, "k", null, 1, 2, "ok"]]',
                           '[[0, 1, 1, 0, "k", null, 1, "Infinity", "ok"]]',
                           '[[0, 1, 1, 0, "k", null, "NaN", 2, "ok"]]',
                           '[[null, 1, 1, 0, "k", null, 1, 2, "ok"]]',
                           '[[0, 1, 1, 0, "k", null, 1, 2, "ok", 10]]']:
            with pytest.raises(pgque.InvalidArgument), translated():
                client.conn.execute("select pgque.record_handling(%s, %s, %s, 'w', %s)",
                                    (QUEUE, GROUP, SLOTS, calls_json))
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):  # 22P02: not a number
            client.conn.execute("select pgque.record_handling(%s, %s, %s, 'w', %s)",
                                (QUEUE, GROUP, SLOTS, '[["x", 1, 1, 0, "k", null, 1, 2, "ok"]]'))
        with pytest.raises(pgque.SlotCountMismatch):
            client.start_recording(QUEUE, GROUP, SLOTS + 1)
        with pytest.raises(pgque.ConsumerNotFound):
            client.verify(QUEUE, "nobody")
    other = deployment.teams[1]
    with pgque.connect(deployment.dsn(deployment.login(other))) as client:
        with pytest.raises(pgque.ConsumerAccessDenied):
            client.verify(QUEUE, GROUP)
        with pytest.raises(pgque.ConsumerAccessDenied):
            _record(client, (0, 1, "k", "ok", "1"))
        client.conn.execute(f"set role {other}")
        client.subscribe_slots(QUEUE, "unrecorded", slots=2)
        with pytest.raises(pgque.NotRecorded):
            client.verify(QUEUE, "unrecorded")
        with pytest.raises(pgque.NotRecorded):  # a time given does not make a record
            client.verify(QUEUE, "unrecorded", since=datetime(2000, 1, 1, tzinfo=timezone.utc))
        out = run_cli("verify", "--queue", QUEUE, "--group", "unrecorded",
                      "--dsn", deployment.dsn(deployment.login(other)))
        assert out.returncode != 0 and "no record of handler calls" in out.stderr
    with psycopg.connect(deployment.dsn(deployment.outsider)) as outsider, \
            pytest.raises(psycopg.errors.InsufficientPrivilege):
        outsider.execute("select * from pgque.verify_handling(%s, %s)", (QUEUE, GROUP))
    with recorded.superuser() as conn:
        assert scalar(conn, "select count(*) from pgque.handling") == before


def test_forgetting_the_record_starts_it_anew(recorded: Recorded) -> None:
    with pgque.connect(recorded.team_dsn()) as client, client.conn.transaction():
        calls = scalar(client.conn, "select count(*) from pgque.handling_summary(%s, %s)"
                       " where calls > 0", (QUEUE, GROUP))
        assert calls == 1
        assert client.forget_handling(QUEUE, GROUP, SLOTS) >= EVENTS
        with pytest.raises(pgque.NotRecorded), client.conn.transaction():  # (a savepoint)
            client.verify(QUEUE, GROUP)
        start = client.start_recording(QUEUE, GROUP, SLOTS)
        assert client.start_recording(QUEUE, GROUP, SLOTS) == start  # the earlier start stays
        assert client.verify(QUEUE, GROUP).summary.calls == 0
        raise_rollback(client.conn)


def test_a_worker_still_recording_after_a_forget_starts_the_record_anew(
        recorded: Recorded) -> None:
    """forget_handling while the group's workers run: their next record starts a
    new one, as start_recording at their start did, so it can be verified."""
    with pgque.connect(recorded.team_dsn()) as client, client.conn.transaction():
        client.forget_handling(QUEUE, GROUP, SLOTS)
        slot = int(scalar(client.conn, "select pgque.slot_of(%s, %s)", (KEYS[2], SLOTS)))
        _record(client, (slot, 900_100, KEYS[2], "ok", "100"))  # a worker's next ack
        summary = client.verify(QUEUE, GROUP).summary
        assert (summary.calls, summary.events) == (1, 1)
        raise_rollback(client.conn)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_verifier_finds_exactly_the_reorder_or_overlap_put_into_a_history(
        recorded: Recorded, data: st.DataObject) -> None:
    """A history as a worker makes it (each key's events handled one after
    another in delivery order, keys interleaved) verifies clean; two calls of
    a key swapped in time are found as the reorders they make, no more; a call
    moved into its predecessor's run is found as that one overlap."""
    keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    per_key = {k: data.draw(st.integers(2, 6), label=f"events of {k}") for k in keys}
    # Delivery order: the key's events by (batch, id); the interleaving of keys is free.
    turns = data.draw(st.permutations([k for k in keys for _ in range(per_key[k])]))
    ids = iter(range(10_000_000, 20_000_000))
    batch_of_turn = sorted(data.draw(st.lists(st.integers(1, 5), min_size=len(turns),
                                              max_size=len(turns))))
    calls: dict[str, list[list[Any]]] = {k: [] for k in keys}  # [ev_id, batch, start ms]
    for n, key in enumerate(turns):
        calls[key].append([next(ids), batch_of_turn[n], 10 * n])
    mutated = data.draw(st.sampled_from(keys))
    history = calls[mutated]
    kind = data.draw(st.sampled_from(["none", "reorder", "overlap"]))
    expected: set[tuple[str, int, int]] = set()
    if kind == "reorder":
        i, j = sorted(data.draw(st.lists(st.integers(0, len(history) - 1), min_size=2,
                                         max_size=2, unique=True)))
        if (history[i][1], history[i][0]) == (history[j][1], history[j][0]):
            kind = "none"
        else:
            ordered = [c[0] for c in history]
            history[i][2], history[j][2] = history[j][2], history[i][2]
            swapped = sorted(history, key=lambda c: c[2])
            # The verifier's rule: after an event of a larger id from the same
            # batch or a later one.
            expected = {("reorder", b[0], a[0]) for a, b in itertools.pairwise(swapped)
                        if b[0] < a[0] and b[1] <= a[1]}
            assert expected and all(e[1] in ordered for e in expected)
    elif kind == "overlap":
        i = data.draw(st.integers(1, len(history) - 1))
        # Starts while its predecessor runs (it ends 5 ms after its start).
        history[i][2] = history[i - 1][2] + 2
        expected = {("overlap", history[i][0], history[i - 1][0])}
    with pgque.connect(recorded.team_dsn()) as client, client.conn.transaction():
        slot_of = dict(client.conn.execute(
            "select k, pgque.slot_of(k, %s) from unnest(%s::text[]) k", (SLOTS, keys)).fetchall())
        rows = [(slot_of[k], c[0], c[1], k, c[2]) for k in keys for c in calls[k]]
        # Calls 5 ms long, from a day from now on.
        client.start_recording(QUEUE, CRAFTED, SLOTS)
        client.conn.execute(
            "select pgque.record_handling(%s, %s, %s, 'crafted', %s)",
            (QUEUE, CRAFTED, SLOTS, json.dumps([
                [slot, ev_id, batch, 0, key, 1, LATER + ms / 1000, LATER + (ms + 5) / 1000, "ok"]
                for slot, ev_id, batch, key, ms in rows])))
        found = {(f[0], f[2], f[3]) for f in client.conn.execute(
            "select kind, violation, ev_id, other_ev_id from pgque.verify_handling(%s, %s, %s)",
            (QUEUE, CRAFTED, None)).fetchall()}
        raise_rollback(client.conn)
    assert found == expected


def test_unsubscribing_the_group_or_dropping_its_queue_deletes_its_record(
        recorded: Recorded) -> None:
    with recorded.superuser() as conn:
        for drop in ("select pgque.unsubscribe_slots(%s, %s)",
                     "select pgque.drop_queue(%s, true) where %s::text is not null"):
            assert scalar(conn, "select count(*) from pgque.handling") > EVENTS
            conn.execute(drop, (QUEUE, GROUP))
            assert scalar(conn, "select count(*) from pgque.handling") == 0
            conn.rollback()


def test_clock_skew_spares_first_calls_closer_than_it(recorded: Recorded) -> None:
    """Two workers whose clocks differ take turns on a key: first calls less than
    clock_skew apart are not judged for order; further apart they are."""
    with pgque.connect(recorded.team_dsn()) as client, client.conn.transaction():
        slot = int(scalar(client.conn, "select pgque.slot_of(%s, %s)", (KEYS[1], SLOTS)))
        # 900_011 ran 500 ms before 900_010 by the clocks on record.
        _record(client, (slot, 900_011, KEYS[1], "ok", "100"),
                (slot, 900_010, KEYS[1], "ok", "600"))
        since = None
        reorders = {skew: [tuple(f) for f in client.conn.execute(
            "select kind, ev_id from pgque.verify_handling(%s, %s, %s, %s)"
            " where kind = 'reorder'", (QUEUE, GROUP, since, timedelta(seconds=skew)))]
            for skew in (0.0, 1.0)}
        assert reorders == {0.0: [("reorder", 900_010)], 1.0: []}
        raise_rollback(client.conn)


def test_held_events_acked_without_a_call_are_lost(recorded: Recorded) -> None:
    """Pause policy: a key's head fails, its next events are held behind it; the
    head is skipped to the dead letters and the held piece acked by a consumer
    that never handles it. The held events' rows stay behind (until a rotation)
    but are done: lost as far as the record can tell."""
    deployment = recorded.deployment
    with pgque.connect(recorded.team_dsn()) as client:
        client.conn.execute(f"set role {recorded.team}")
        client.subscribe_slots(QUEUE, "held", slots=1, policy="pause")
        client.conn.execute("reset role")
        client.start_recording(QUEUE, "held", 1)
        with pgque.connect(deployment.dsn(deployment.producer)) as producer:
            head, *held = [int(i) for i in producer.send_batch(
                QUEUE, [("Order", {"n": n}, "held-key") for n in range(3)])]
        with pgque.connect(deployment.dsn(deployment.owner)) as owner:
            owner.tick(QUEUE)
        assert client.claim_slot(QUEUE, "held", 0)
        batch = client.receive_partitioned(QUEUE, "held", slot=0, slots=1)
        assert batch is not None and [m.id for m in batch] == [head, *held]
        client.ack(batch, nack={head: "fails", **{i: f"held: event {head} failed" for i in held}},
                   retry_after=3600)
        assert client.skip_head(QUEUE, "held", "held-key") == head
        got: list[int] = []
        while (piece := client.receive_partitioned(QUEUE, "held", slot=0, slots=1)) is not None:
            got += [m.id for m in piece]
            client.ack(piece)  # handled by nobody
        assert got == held
        result = client.verify(QUEUE, "held")
        client.release_slot(QUEUE, "held", 0)
    assert [(f.kind, f.ev_id) for f in result.violations] == [("lost", i) for i in held]


def test_a_clock_step_during_a_call_does_not_stop_a_recording_worker(
        recorded: Recorded) -> None:
    """The machine's clock steps back 5 ms during a call (NTP would): the record's
    end of that call is its start plus its length, not a time before its start
    (which record_handling refuses, and which stopped the worker for good). The
    step is within the clock skew verify is told of."""
    deployment = recorded.deployment
    with pgque.connect(recorded.team_dsn()) as client:
        client.conn.execute(f"set role {recorded.team}")
        client.subscribe_slots(QUEUE, "stepped", slots=1)
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        sent = [int(i) for i in producer.send_batch(
            QUEUE, [("Order", {"n": n}, f"k{n}") for n in range(6)])]
    real_time = time.time
    step = [0.0]
    handled: list[int] = []

    def handle(message: pgque.Message[Any]) -> None:
        if message.id == sent[2]:
            step[0] = 0.005  # from here on, this machine's clock is 5 ms behind
        handled.append(message.id)

    with mock.patch("time.time", lambda: real_time() - step[0]), \
            pgque.Ticker(deployment.dsn(deployment.ticker), maintenance_interval=0.1), \
            pgque.Worker(recorded.team_dsn(), queue=QUEUE, consumer="stepped", slots=1,
                         handler=handle, poll_interval=0.05, ticker=False,
                         record=True) as worker:
        worker.wait(lambda: len(handled) >= len(sent), timeout=60)
    assert handled == sent
    with recorded.superuser() as conn:
        assert conn.execute(
            "select count(*), bool_and(hd_ended >= hd_started) from pgque.handling"
            " where hd_ev_id = any(%s)", (sent,)).fetchone() == (len(sent), True)
    with pgque.connect(recorded.team_dsn()) as client:
        assert client.verify(QUEUE, "stepped", clock_skew=1.0).ok
