"""Attacks on the rotation of the cursor log and the ticks (migration 7,
code/ticker/rotation.sql): concurrent consumers while maintenance rotates at
every pass, sessions killed at awkward moments, subscriptions and drops racing
rotations, REPEATABLE READ handlers, sessions holding locks, upgrades with
live state. Workers run on their own roles (pgque_reader / pgque_writer),
maintenance on a pgque_admin role, pgque installed by a non-superuser owner
(the ``dsn`` fixture).

Each asserts a promise of docs/guarantees.md and docs/operations.md about
the rotation: no event lost, repeated or reordered, no error to a worker, no
wait beyond the bounds stated, no growth without bound."""

from __future__ import annotations

import random
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import LONG, long_variant, scalar, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

# How long the runs under back-to-back rotations last: a few seconds in every
# `make test`, 20 s in `make test-long` (PGQUE_TEST_LONG=1).
RUN_SECONDS = 20.0 if LONG else 3.0

# What the documents promise: a rotation makes a receive or an ack wait at
# most 50 ms (lock_timeout) "and the copy". Leave room for a loaded machine.
BLOCK_BOUND = 0.150


def rotate_always(conn: psycopg.Connection[Any]) -> None:
    conn.execute("update pgque.rotation set rt_period = '0'")


@pytest.fixture
def roles(dsn: str) -> Iterator[dict[str, str]]:
    """Login roles of the recommended deployment, by kind, as DSNs: "team" (a
    worker's role: pgque_reader and pgque_writer), "team2" (another team) and
    "ops" (pgque_admin: the ticker and maintenance)."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    grants = {"team": "pgque_reader, pgque_writer", "team2": "pgque_reader, pgque_writer",
              "ops": "pgque_admin"}
    names = {kind: f"atk_{kind}_{suffix}" for kind in grants}
    with psycopg.connect(dsn, autocommit=True) as su:
        for kind, name in names.items():
            su.execute(f"create role {name} login")
            su.execute(f"grant {grants[kind]} to {name}")
    try:
        yield {kind: make_conninfo(**{**params, "user": name}) for kind, name in names.items()}
    finally:
        with psycopg.connect(dsn, autocommit=True) as su:
            su.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                       " where usename = any(%s) and pid <> pg_backend_pid()",
                       (list(names.values()),))
            for name in names.values():
                su.execute(f"drop owned by {name} cascade")
                su.execute(f"drop role if exists {name}")


class Timed:
    """Latencies of the calls a thread makes in a loop, with the moment each began."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, str]] = []  # (start, seconds, what)

    def run(self, what: str, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            return call()
        finally:
            self.calls.append((start, time.monotonic() - start, what))

    def worst(self, since: float = 0.0) -> tuple[float, str]:
        return max(((s, w) for t, s, w in self.calls if t >= since), default=(0.0, ""))


def background(target: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test
            traceback.print_exc()
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- how long a rotation blocks the hot path --------------------------------------------------


def fast_consumer(team_dsn: str, queue: str, consumer: str, timed: Timed,
                  stop: threading.Event) -> None:
    """Receive and ack one event at a time until stop, timing every call."""
    with pgque.connect(team_dsn) as team:
        while not stop.is_set():
            batch = timed.run("receive", lambda: team.receive(queue, consumer, max_events=1))
            if batch is None:
                time.sleep(0.002)
                continue
            timed.run("ack", lambda b=batch: team.ack(b))


@pytest.mark.parametrize("rotation", ["due", "not_due"])
def test_a_switch_holds_every_receive_lock_until_the_whole_maintenance_pass_ends(
        roles: dict[str, str], conn: psycopg.Connection[Any], rotation: str) -> None:
    """The cursor switch takes every subscription's receive lock (and the tick
    truncate its partition's ACCESS EXCLUSIVE lock) inside pgque.maint()'s one
    transaction, which then goes on with every queue's steps: the locks are held
    until the whole pass commits. A burst of failures on another queue (30,000
    retries due) makes that pass long, and a consumer of an unrelated queue
    waits for all of it, not for 50 ms. (With no rotation due, the same pass
    does not make it wait: the "not_due" control.)"""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("fast")
        ops.create_queue("slow")
        team.subscribe("fast", "c")
        team.subscribe("slow", "s")
        if rotation == "due":
            rotate_always(conn)
        else:
            conn.execute("update pgque.rotation set rt_period = '1 day'")
        for n in range(300):  # a backlog the fast consumer works through
            team.send("fast", "e", n)
            ops.tick("fast")
        team.send_batch("slow", [("e", {"n": n}, None) for n in range(20000)])
        ops.tick("slow")
        ops.maintenance()
        while (batch := team.receive("slow", "s", max_events=1000)) is not None:
            team.ack(batch, nack=batch.messages, retry_after=0)  # 20,000 retries due now
        timed, stop, errors = Timed(), threading.Event(), []
        thread = background(lambda: fast_consumer(roles["team"], "fast", "c", timed, stop), errors)
        time.sleep(0.3)  # cursor rows written: a switch is due
        began = time.monotonic()
        steps = ops.maintenance()
        took = time.monotonic() - began
        time.sleep(0.2)
        stop.set()
        thread.join(10)
        assert errors == []
        names = [s[1] for s in steps]
        assert "retry" in names, steps
        assert ("rotate_cursors" in names) == (rotation == "due"), steps
        worst, what = timed.worst(since=began - 0.05)
        print(f"maintenance pass {took * 1000:.0f} ms; worst {what} of the fast consumer "
              f"{worst * 1000:.0f} ms")
        assert worst < BLOCK_BOUND, (
            f"a {what} of an unrelated consumer waited {worst * 1000:.0f} ms behind a rotation "
            f"(the maintenance pass took {took * 1000:.0f} ms)")


def transactional_handler(team_dsn: str, queue: str, consumer: str, hold: float,
                          stop: threading.Event, handled: list[int]) -> None:
    """A hand-written transactional handler: receive, work for ``hold`` seconds
    and ack in one transaction (the receive lock held meanwhile), in a loop."""
    with pgque.connect(team_dsn) as team:
        while not stop.is_set():
            with team.conn.transaction():
                batch = team.receive(queue, consumer, max_events=5)
                if batch is not None:
                    time.sleep(hold)
                    handled.extend(m.id for m in batch)
                    team.ack(batch)
            if batch is None:
                time.sleep(0.005)


@pytest.mark.parametrize("rotation", ["due", "not_due"])
def test_the_switch_waits_50ms_per_receive_lock_and_holds_the_ones_it_has(
        roles: dict[str, str], conn: psycopg.Connection[Any], rotation: str) -> None:
    """The switch locks the subscriptions one by one, each lock waited for at
    most 50 ms (lock_timeout is per lock, not per switch), holding those it has
    meanwhile. Sixteen transactional handlers that each hold their receive lock
    for 40 ms make it wait up to 40 ms sixteen times over, while the consumer
    whose subscription it locked first waits for all of it."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("fast")
        ops.create_queue("busy")
        team.subscribe("fast", "c0")  # the lowest sub_id: locked first
        for i in range(1, 17):
            team.subscribe("busy", f"h{i}")
        if rotation == "due":
            rotate_always(conn)
        else:
            conn.execute("update pgque.rotation set rt_period = '1 day'")
        for n in range(300):
            team.send("fast", "e", n)
            ops.tick("fast")
        for n in range(100):
            team.send_batch("busy", [("e", n, None)] * 5)
            ops.tick("busy")
        ops.maintenance()
        timed, stop, errors = Timed(), threading.Event(), []
        handled: list[int] = []
        threads = [background(lambda: fast_consumer(roles["team"], "fast", "c0", timed, stop),
                              errors)]
        threads += [background(lambda i=i: transactional_handler(roles["team"], "busy", f"h{i}",
                                                                 0.04, stop, handled), errors)
                    for i in range(1, 17)]
        time.sleep(0.5)
        passes = []
        began = time.monotonic()
        for _ in range(5):
            start = time.monotonic()
            steps = ops.maintenance()
            passes.append((time.monotonic() - start, [s[1] for s in steps]))
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(10)
        assert errors == []
        worst, what = timed.worst(since=began - 0.05)
        print("passes:", [(round(t * 1000), s) for t, s in passes],
              f"worst {what} {worst * 1000:.0f} ms")
        assert worst < BLOCK_BOUND, (
            f"a {what} waited {worst * 1000:.0f} ms behind a rotation; passes (ms, steps): "
            f"{[(round(t * 1000), s) for t, s in passes]}")


# -- what stays bounded -----------------------------------------------------------------------


def drain_all(client: pgque.Client, queue: str, consumer: str) -> list[int]:
    got: list[int] = []
    while (batch := client.receive(queue, consumer)) is not None:
        got += [m.id for m in batch]
        client.ack(batch)
    return got


@pytest.mark.parametrize("idle_queue", [True, False])
def test_an_idle_queue_pins_the_ticks_of_every_queue(
        roles: dict[str, str], conn: psycopg.Connection[Any], idle_queue: bool) -> None:
    """Every subscription keeps up, so the ticks should stay at "about a
    minute" of ticks (guarantees.md). But a tick partition is emptied only
    once no queue needs a tick in it, and every queue needs its newest tick:
    a queue that does not tick (no events, and a ticker_idle_period of an
    hour) holds the partition with its last tick, and the ticks of every other
    queue pile up in the partition written until it ticks again."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("busy", ticker_max_lag=0)
        team.subscribe("busy", "c")
        if idle_queue:
            ops.create_queue("idle", ticker_idle_period=3600)
            team.subscribe("idle", "c")
            ops.tick("idle")
            assert drain_all(team, "idle", "c") == []
        rotate_always(conn)
        sent: list[int] = []
        got: list[int] = []
        ticks_rotations = 0
        for n in range(60):
            sent.append(team.send("busy", "e", n))
            assert ops.ticker() >= 1
            got += drain_all(team, "busy", "c")
            if idle_queue:
                assert drain_all(team, "idle", "c") == []
            ticks_rotations += sum(1 for s in ops.maintenance() if s[1] == "rotate_ticks")
        assert got == sent
        busy_ticks = scalar(conn, "select count(*) from pgque.tick t join pgque.queue q"
                                  " on q.queue_id = t.tick_queue where q.queue_name = 'busy'")
        print(f"busy's ticks kept: {busy_ticks} after 60 ticks and 60 passes"
              f" ({ticks_rotations} tick rotations)")
        assert busy_ticks <= 5, (
            f"{busy_ticks} of busy's 60 ticks kept though its consumer kept up "
            f"({ticks_rotations} tick rotations in 60 passes that could all rotate)")


def rr_handler(team_dsn: str, queue: str, consumer: str, isolation: str, hold: float,
               stop: threading.Event, handled: list[int], failures: list[str]) -> None:
    """A transactional handler under ``isolation``: receive, work, ack, commit;
    a serialization failure (40001) is retried, as the documents say."""
    with pgque.connect(team_dsn) as team:
        team.conn.execute(f"set session characteristics as transaction isolation level {isolation}")
        while not stop.is_set():
            try:
                with team.conn.transaction():
                    batch = team.receive(queue, consumer, max_events=5)
                    if batch is not None:
                        time.sleep(hold)
                        team.ack(batch)
                if batch is not None:
                    handled.extend(m.id for m in batch)
                else:
                    time.sleep(0.002)
            except psycopg.errors.SerializationFailure as exc:
                failures.append(str(exc))


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_handlers_holding_receive_locks_do_not_starve_the_cursor_rotation(
        roles: dict[str, str], conn: psycopg.Connection[Any], isolation: str) -> None:
    """Handlers that hold their receive lock for their whole transaction
    (receive, 20 ms of work, ack, commit), three of them overlapping all the
    time, under READ COMMITTED and REPEATABLE READ: the cursor log still
    switches at most passes (a switch waits for no receive lock), so it does
    not grow without bound."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q")
        consumers = ["c1", "c2", "c3"]
        for c in consumers:
            team.subscribe("q", c)
        rotate_always(conn)
        for n in range(400):
            team.send_batch("q", [("e", n, None)] * 5)
            ops.tick("q")
        ops.maintenance()
        stop, errors = threading.Event(), []
        handled: list[int] = []
        failures: list[str] = []
        threads = [background(lambda c=c: rr_handler(roles["team"], "q", c, isolation, 0.02,
                                                     stop, handled, failures), errors)
                   for c in consumers]
        time.sleep(0.3)
        switches = 0
        part = scalar(conn, "select rt_part from pgque.rotation where rt_name = 'cursor'")
        for _ in range(30):
            ops.maintenance()
            now = scalar(conn, "select rt_part from pgque.rotation where rt_name = 'cursor'")
            switches += now != part
            part = now
            time.sleep(0.05)
        rows = scalar(conn, "select count(*) from pgque.cursor")
        stop.set()
        for t in threads:
            t.join(10)
        assert errors == []
        print(f"{isolation}: {switches} cursor switches in 30 passes, {rows} cursor rows,"
              f" {len(handled)} events handled, {len(failures)} serialization failures")
        assert switches >= 10, (
            f"{switches} cursor switches in 30 passes under {isolation}: the cursor log holds "
            f"{rows} rows for 3 subscriptions")


# -- Workers under rotations ------------------------------------------------------------------


def ops_loop(ops_dsn: str, stop: threading.Event, passes: list[list[tuple[str, str, int]]],
             pause: float = 0.01) -> None:
    """The ticker and maintenance of the deployment: tick what is due, run
    maintenance (rotating at every pass here), again and again."""
    with pgque.connect(ops_dsn) as ops:
        while not stop.is_set():
            ops.ticker()
            passes.append(ops.maintenance())
            time.sleep(pause)


@pytest.fixture
def handled_table(dsn: str, roles: dict[str, str]) -> str:
    team = conninfo_to_dict(roles["team"])["user"]
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("create table public.atk_handled (seq bigserial primary key, ev_id bigint,"
                   " key text, slot integer)")
        su.execute(f"grant insert, select on public.atk_handled to {team}")
        su.execute(f"grant usage on sequence public.atk_handled_seq_seq to {team}")
    return "public.atk_handled"


def check_once_in_order(conn: psycopg.Connection[Any], sent: dict[int, str]) -> None:
    rows = conn.execute("select ev_id, key from public.atk_handled order by seq").fetchall()
    ids = [ev for ev, _k in rows]
    dups = sorted({ev for ev in ids if ids.count(ev) > 1})
    assert dups == [], f"{len(dups)} events handled twice: {dups[:10]}"
    assert sorted(ids) == sorted(sent), f"{len(set(sent) - set(ids))} events lost"
    by_key: dict[str, list[int]] = {}
    for ev, key in rows:
        by_key.setdefault(key, []).append(ev)
    for key, evs in by_key.items():
        assert evs == sorted(evs), f"key {key} out of order"


@pytest.mark.parametrize("isolation", [
    "read committed", "repeatable read",
    long_variant("serializable", id="serializable")])  # as repeatable read, here
def test_transactional_workers_under_rotations_handle_every_event_once(
        roles: dict[str, str], conn: psycopg.Connection[Any], handled_table: str,
        isolation: str, caplog: pytest.LogCaptureFixture) -> None:
    """Transactional Workers (their writes and the ack in one transaction,
    under the isolation their DSN sets) on a 4-slot group, while the ticker
    and maintenance rotate at every pass: every event once, each key in
    order, no error for the worker."""
    level = isolation.replace(" ", "\\ ")
    worker_dsn = make_conninfo(**{**conninfo_to_dict(roles["team"]),
                                  "options": f"-c default_transaction_isolation={level}"})
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q", ticker_max_lag=0)
        team.subscribe_slots("q", "g", slots=4)
        rotate_always(conn)
        ops.maintenance()

        def handler(message: pgque.Message[Any], hconn: Any) -> None:
            hconn.execute("insert into public.atk_handled (ev_id, key) values (%s, %s)",
                          (message.id, message.partition_key))

        stop, errors, passes = threading.Event(), [], []
        opsthread = background(lambda: ops_loop(roles["ops"], stop, passes), errors)
        worker = pgque.Worker(worker_dsn, queue="q", consumer="g", slots=4, handler=handler,
                              transactional=True, ticker=False, max_events=20,
                              rebalance_interval=0.2, poll_interval=0.05)
        sent: dict[int, str] = {}
        with worker:
            rng = random.Random(5)
            for _ in range(40):
                rows = [("e", {}, f"k{rng.randrange(20)}") for _ in range(25)]
                for (_t, _p, key), ev in zip(rows, team.send_batch("q", rows), strict=True):
                    sent[ev] = key
                time.sleep(0.02)
            wait_for(lambda: scalar(conn, "select count(distinct ev_id) from public.atk_handled")
                     >= len(sent) or worker.error is not None, timeout=90,
                     what="every event handled")
            time.sleep(0.5)
            error = worker.error
        stop.set()
        opsthread.join(10)
        assert errors == []
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_cursors")
        lost_lanes = [r.getMessage() for r in caplog.records
                      if "lane" in r.getMessage() and r.levelname in ("WARNING", "ERROR")]
        print(f"{isolation}: {rotations} cursor rotations; {len(lost_lanes)} lane errors;"
              f" first: {lost_lanes[:2]}")
        assert error is None, repr(error)
        check_once_in_order(conn, sent)


# -- sessions killed at awkward moments ------------------------------------------------------


def test_maintenance_killed_at_random_moments_under_load_loses_and_repeats_nothing(
        roles: dict[str, str], conn: psycopg.Connection[Any], dsn: str) -> None:
    """Two sessions drain a 16-slot group (receive_slots / ack_slots), a plain
    consumer nacks every seventh event once (retry_after 0), a producer sends
    and ticks, and maintenance rotates at every pass while a killer ends its
    session (pg_terminate_backend) at random moments, mid-rotation among them:
    every event once per consumer (the nacked ones once more, as a retry),
    each key in order, no error anywhere but the killed maintenance's. (It
    fails now and then with ConsumerNotFound from receive_slots: the race of
    test_receive_slots_under_back_to_back_rotations_never_says_not_subscribed,
    not the kills.)"""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q")
        team.subscribe_slots("q", "g", slots=16)
        team.subscribe("q", "plain")
        rotate_always(conn)
        ops.maintenance()
        total = 2000
        done = threading.Event()
        errors: list[BaseException] = []
        group_got: list[list[tuple[str, int]]] = [[], []]
        plain_got: list[tuple[int, int]] = []  # (id, retry)
        maint_pid = [0]
        kills = [0]
        maint_passes = [0]
        expected_retries = [total]

        def drain(n: int) -> None:
            with pgque.connect(roles["team"]) as w:
                owned = range(8 * n, 8 * n + 8)
                for slot in owned:
                    assert w.claim_slot("q", "g", slot)
                while not (done.is_set() and sum(map(len, group_got)) >= total):
                    batches = w.receive_slots("q", "g", slots=16, owned=owned, max_events=7)
                    for b in batches:
                        group_got[n].extend((m.partition_key or "", m.id) for m in b)
                    if batches:
                        w.ack_slots(batches)
                    else:
                        time.sleep(0.002)
                    if errors:
                        return

        def plain() -> None:
            with pgque.connect(roles["team"]) as w:
                while not (done.is_set() and len({i for i, _ in plain_got}) >= total
                           and sum(1 for _, r in plain_got if r) >= expected_retries[0]):
                    batch = w.receive("q", "plain", max_events=9)
                    if batch is None:
                        time.sleep(0.002)
                        if errors:
                            return
                        continue
                    plain_got.extend((m.id, m.retry_count) for m in batch)
                    fails = [m for m in batch if m.retry_count == 0 and m.id % 7 == 0]
                    w.ack(batch, nack=fails, retry_after=0)

        finish = threading.Event()

        def maintain() -> None:
            while not finish.is_set():
                try:
                    with psycopg.connect(roles["ops"], autocommit=True) as m:
                        maint_pid[0] = m.info.backend_pid
                        while True:
                            m.execute("select * from pgque.maint()").fetchall()
                            m.execute("select pgque.ticker()")
                            maint_passes[0] += 1
                            if finish.is_set():
                                return
                except psycopg.OperationalError:
                    continue  # killed: connect again

        def killer() -> None:
            rng = random.Random(11)
            with psycopg.connect(dsn, autocommit=True) as k:
                while not finish.is_set():
                    time.sleep(rng.uniform(0.002, 0.03))
                    if rng.random() < 0.6:
                        continue
                    row = k.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                                    " where pid = %s and state = 'active'",
                                    (maint_pid[0],)).fetchone()
                    if row and row[0]:
                        kills[0] += 1

        threads = [background(lambda n=n: drain(n), errors) for n in range(2)]
        threads += [background(plain, errors), background(maintain, errors),
                    background(killer, errors)]
        rng = random.Random(3)
        sent: list[tuple[str, int]] = []
        while len(sent) < total:
            rows = [("e", {}, f"k{rng.randrange(40)}") for _ in range(40)]
            sent += [(key, ev) for (_t, _p, key), ev in
                     zip(rows, team.send_batch("q", rows), strict=True)]
            time.sleep(0.01)
        expected_retries[0] = sum(1 for _k, ev in sent if ev % 7 == 0)
        done.set()
        try:
            wait_for(lambda: (sum(map(len, group_got)) >= total
                              and len({i for i, _ in plain_got}) >= total
                              and sum(1 for _, r in plain_got if r) >= expected_retries[0])
                     or errors, timeout=60, what="every event handled")
        finally:
            print(f"group {sum(map(len, group_got))}/{total}, plain"
                  f" {len({i for i, _ in plain_got})}/{total}, retried"
                  f" {sum(1 for _, r in plain_got if r)}/{expected_retries[0]}, errors {errors}")
            finish.set()
        for t in threads:
            t.join(30)
        print(f"{kills[0]} maintenance sessions killed, {maint_passes[0]} passes")
        assert errors == []
        assert kills[0] >= 5
        got = [pair for part in group_got for pair in part]
        assert sorted(ev for _k, ev in got) == sorted(ev for _k, ev in sent)
        for key in {k for k, _ in sent}:
            evs = [ev for k, ev in got if k == key]
            assert evs == sorted(evs), f"key {key} out of order"
        first = [i for i, r in plain_got if r == 0]
        retried = sorted(i for i, r in plain_got if r == 1)
        assert sorted(first) == sorted(ev for _k, ev in sent)
        assert retried == sorted(ev for _k, ev in sent if ev % 7 == 0)


# -- readers that look at the cursor log without a receive lock ------------------------------


@pytest.mark.parametrize("maintainers", [1, 2])
def test_receive_slots_under_back_to_back_rotations_never_says_not_subscribed(
        roles: dict[str, str], conn: psycopg.Connection[Any], maintainers: int) -> None:
    """receive_slots reads its slots' cursors first without a lock
    (_owned_slot_subs -> _slot_subs), in the partition its snapshot says is
    written. With rotations back to back (rt_period 0, as the suite's own
    tests run them), the partition it names may have been switched away from
    and truncated (and refilled by the next switch) before its query locks
    it: no cursor, and under READ COMMITTED _cursor_missing lets it through,
    so _slot_subs raises PQ002 "consumer NULL is not subscribed" (a Worker
    takes ConsumerNotFound for fatal)."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q")
        team.subscribe_slots("q", "g", slots=16)
        rotate_always(conn)
        ops.maintenance()
        stop, errors = threading.Event(), []
        received = [0]
        passes: list[list[tuple[str, str, int]]] = []

        def drain(n: int) -> None:
            with pgque.connect(roles["team"]) as w:
                owned = range(8 * n, 8 * n + 8)
                for slot in owned:
                    assert w.claim_slot("q", "g", slot)
                while not stop.is_set():
                    batches = w.receive_slots("q", "g", slots=16, owned=owned, max_events=7)
                    received[0] += sum(len(b) for b in batches)
                    if batches:
                        w.ack_slots(batches)

        def produce() -> None:
            with pgque.connect(roles["team"]) as p:
                n = 0
                while not stop.is_set():
                    p.send_batch("q", [("e", {}, f"k{(n + i) % 40}") for i in range(20)])
                    n += 20
                    time.sleep(0.005)

        threads = [background(lambda n=n: drain(n), errors) for n in range(2)]
        threads.append(background(produce, errors))
        threads += [background(lambda: ops_loop(roles["ops"], stop, passes, pause=0), errors)
                    for _ in range(maintainers)]
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline and not errors:
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(10)
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_cursors")
        print(f"{rotations} cursor rotations, {received[0]} events received, errors: {errors!r}")
        assert errors == []



# -- sessions holding locks on pgque's tables -------------------------------------------------


def test_the_hot_path_locks_both_partitions_of_each_rotated_table(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """What the next attacks rest on: once their plans are generic, receive and
    receive_slots lock both partitions of the cursor log (and of the ticks),
    the one not written included, so a truncate of it queues every receive
    and ack behind its ACCESS EXCLUSIVE lock."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.subscribe("q", "c")
    for s in range(4):
        assert client.claim_slot("q", "g", s)
    for _ in range(12):
        client.send_batch("q", [("e", {}, f"k{i}") for i in range(8)])
        client.tick("q")
        client.ack_slots(client.receive_slots("q", "g", slots=4, owned=range(4)))
        batch = client.receive("q", "c")
        assert batch is not None
        client.ack(batch)
    client.send_batch("q", [("e", {}, f"k{i}") for i in range(8)])
    client.tick("q")
    written = scalar(conn, "select rt_part from pgque.rotation where rt_name = 'cursor'")
    other = f"cursor_{1 - written}"
    for call in (lambda: client.receive_slots("q", "g", slots=4, owned=range(4)),
                 lambda: client.receive("q", "c")):
        with client.conn.transaction():
            call()
            locked = {r[0] for r in conn.execute(
                "select c.relname from pg_locks l join pg_class c on c.oid = l.relation"
                " where l.pid = %s", (client.conn.info.backend_pid,))}
        assert other in locked, locked


def test_a_report_left_idle_in_transaction_stalls_every_consumer_at_every_pass(
        roles: dict[str, str], conn: psycopg.Connection[Any]) -> None:
    """operations.md: a transaction that read pgque's tables and stays open
    (consumer_info, idle in transaction) makes a rotation wait 50 ms and try
    again at the next pass; "Nothing else waits: receives and acks go on".
    But the truncate's ACCESS EXCLUSIVE request queues every receive and ack
    (which lock both partitions) behind it for those 50 ms, twice a pass (the
    cursor log, then the ticks), at every pass for as long as the report stays
    open."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q")
        team.subscribe("q", "c")
        rotate_always(conn)
        for n in range(600):
            team.send("q", "e", n)
            ops.tick("q")
        for _ in range(3):  # both partitions of both tables hold rows now
            b = team.receive("q", "c", max_events=1)
            assert b is not None
            team.ack(b)
            ops.maintenance()
        with psycopg.connect(roles["team"]) as report:
            report.execute("select * from pgque.consumer_info").fetchall()  # left open
            timed, stop, errors = Timed(), threading.Event(), []
            thread = background(lambda: fast_consumer(roles["team"], "q", "c", timed, stop),
                                errors)
            time.sleep(0.3)
            began = time.monotonic()
            steps = []
            for _ in range(10):
                steps += ops.maintenance()
                time.sleep(0.2)
            stop.set()
            thread.join(10)
            report.rollback()
        assert errors == []
        # The truncate queues 25 ms at most (_lock_partition); load adds to it.
        stalls = [s for t, s, _w in timed.calls if t >= began and s >= BLOCK_BOUND]
        print(f"{len(stalls)} receive/ack calls waited {BLOCK_BOUND * 1000:.0f} ms or more"
              " during 10 passes:"
              f" {[round(s * 1000) for s in stalls]}; steps {steps}")
        assert stalls == [], (
            f"{len(stalls)} receives/acks waited behind the rotations' truncate attempts "
            f"during 10 passes (ms: {[round(s * 1000) for s in stalls]})")


@pytest.mark.parametrize("transactional", [False, True])
def test_a_worker_survives_back_to_back_rotations(
        roles: dict[str, str], conn: psycopg.Connection[Any], handled_table: str,
        transactional: bool) -> None:
    """A Worker (4 slots, its control asking pending_slots at every tick, its
    lanes receive_partitioned / ack_and_receive) while the ticker and two
    maintainers rotate back to back: every event handled, each key in order,
    and no error: ConsumerNotFound (PQ002) would stop the worker for good."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q", ticker_max_lag=0)
        team.subscribe_slots("q", "g", slots=4)
        rotate_always(conn)
        ops.maintenance()
        seen: list[tuple[str, int]] = []

        def plain_handler(message: pgque.Message[Any]) -> None:
            seen.append((message.partition_key or "", message.id))

        def tx_handler(message: pgque.Message[Any], hconn: Any) -> None:
            hconn.execute("insert into public.atk_handled (ev_id, key) values (%s, %s)",
                          (message.id, message.partition_key))

        stop, errors, passes = threading.Event(), [], []
        ops_threads = [background(lambda: ops_loop(roles["ops"], stop, passes, pause=0), errors)
                       for _ in range(2)]
        worker = pgque.Worker(roles["team"], queue="q", consumer="g", slots=4,
                              handler=tx_handler if transactional else plain_handler,
                              transactional=transactional, ticker=False, max_events=10,
                              rebalance_interval=0.2, poll_interval=0.05)
        sent: dict[int, str] = {}
        try:
            worker.start()
            wait_for(lambda: len(worker.owned_slots) == 4, what="the worker owns its slots")
            rng = random.Random(9)
            for _ in range(200):
                rows = [("e", {}, f"k{rng.randrange(20)}") for _ in range(10)]
                for (_t, _p, key), ev in zip(rows, team.send_batch("q", rows), strict=True):
                    sent[ev] = key
                time.sleep(0.02)
                if worker.error is not None:
                    break

            def count() -> int:
                if transactional:
                    return int(scalar(conn, "select count(distinct ev_id) from public.atk_handled"))
                return len({ev for _k, ev in seen})
            wait_for(lambda: count() >= len(sent) or worker.error is not None, timeout=60,
                     what="every event handled")
            error = worker.error
        finally:
            worker.stop()
            stop.set()
            for t in ops_threads:
                t.join(10)
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_cursors")
        print(f"{rotations} cursor rotations; worker error: {error!r}")
        assert errors == []
        assert error is None, repr(error)
        if transactional:
            check_once_in_order(conn, sent)
        else:
            assert {ev for _k, ev in seen} == set(sent)
            for key in set(sent.values()):
                evs = [ev for k, ev in seen if k == key]
                assert evs == sorted(evs), f"key {key} out of order"


# -- the hot path writes no dead rows ---------------------------------------------------------


def table_writes(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int]]:
    conn.execute("select pg_stat_force_next_flush()")
    conn.execute("select pg_stat_clear_snapshot()")
    return {name: (upd, dele) for name, upd, dele in conn.execute(
        "select relname, n_tup_upd, n_tup_del from pg_stat_user_tables"
        " where schemaname = 'pgque'")}


def test_the_workers_hot_path_updates_and_deletes_no_row(
        roles: dict[str, str], conn: psycopg.Connection[Any]) -> None:
    """The calls a Worker makes (pending_slots on the control session;
    receive_partitioned, then ack_and_receive on a lane), 400 cycles with a
    rotating maintenance pass every 40: no row updated or deleted but the
    rotation row's, once per switch."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team, \
            pgque.connect(roles["team"]) as control:
        ops.create_queue("q")
        team.subscribe_slots("q", "g", slots=2)
        for slot in range(2):
            assert team.claim_slot("q", "g", slot)
        rotate_always(conn)
        ops.send_batch("q", [("e", n, f"k{n}") for n in range(4)])
        ops.tick("q")
        for slot in range(2):  # the first receive of a claim writes its epoch
            b = team.receive_partitioned("q", "g", slot=slot, slots=2)
            if b is not None:
                team.ack(b)
        ops.maintenance()
        before = table_writes(conn)
        switches = 0
        for cycle in range(400):
            team.send_batch("q", [("e", cycle, f"k{i}") for i in range(6)])
            ops.tick("q")
            pending = control.pending_slots("q", "g")
            for slot in sorted(pending):
                batch = team.receive_partitioned("q", "g", slot=slot, slots=2, max_events=2)
                while batch is not None:
                    batch = team.ack_and_receive(batch, max_events=2)
            if cycle % 40 == 39:
                switches += sum(1 for _q, step, n in ops.maintenance()
                                if step.startswith("rotate_") and n in (1, 2))
        after = table_writes(conn)
        writes = {t: (after[t][0] - before.get(t, (0, 0))[0],
                      after[t][1] - before.get(t, (0, 0))[1]) for t in after}
        rotation = writes.pop("rotation")
        assert rotation[1] == 0
        # pgque.queue: maintenance's switch of the event tables (not the hot path).
        assert writes.pop("queue")[1] == 0
        assert {t: w for t, w in writes.items() if w != (0, 0)} == {}


# -- subscriptions and drops racing rotations -------------------------------------------------


def test_subscribe_unsubscribe_and_drop_queue_racing_rotations(
        roles: dict[str, str], conn: psycopg.Connection[Any]) -> None:
    """While two maintainers rotate back to back and a steady consumer reads
    every event of q: another team subscribes consumers and groups to q and
    drops them, each new consumer receiving its own marker sent after it
    subscribed; an admin makes queues, uses them and drops them (force). No
    error anywhere, the steady consumer gets every event once in order, and
    every new consumer its marker."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q", ticker_max_lag=0)
        team.subscribe("q", "steady")
        rotate_always(conn)
        stop, errors, passes = threading.Event(), [], []
        steady: list[int] = []
        markers = [0]

        def steady_consumer() -> None:
            with pgque.connect(roles["team"]) as w:
                while not stop.is_set():
                    batch = w.receive("q", "steady", max_events=13)
                    if batch is None:
                        time.sleep(0.002)
                        continue
                    steady.extend(m.id for m in batch)
                    w.ack(batch)

        def churn() -> None:
            with pgque.connect(roles["team2"]) as w:
                n = 0
                while not stop.is_set():
                    name = f"late{n}"
                    assert w.subscribe("q", name)
                    marker = w.send("q", "marker", n)
                    got: list[int] = []
                    deadline = time.monotonic() + 20
                    while marker not in got:
                        if stop.is_set():
                            return  # the ticks end with the run: its marker may never come
                        assert time.monotonic() < deadline, f"{name} never got its marker"
                        batch = w.receive("q", name)
                        if batch is None:
                            time.sleep(0.005)
                            continue
                        got += [m.id for m in batch]
                        w.ack(batch)
                    assert w.unsubscribe("q", name)
                    w.subscribe_slots("q", f"grp{n}", slots=8)
                    assert w.claim_slot("q", f"grp{n}", 0)
                    b = w.receive_partitioned("q", f"grp{n}", slot=0, slots=8)
                    if b is not None:
                        w.ack(b)
                    w.unsubscribe_slots("q", f"grp{n}")
                    markers[0] += 1
                    n += 1

        def queues() -> None:
            with pgque.connect(roles["ops"]) as a:
                n = 0
                while not stop.is_set():
                    a.create_queue(f"tmp{n}")
                    a.subscribe(f"tmp{n}", "c")
                    a.send(f"tmp{n}", "e", n)
                    a.tick(f"tmp{n}")
                    b = a.receive(f"tmp{n}", "c")
                    for _ in range(50):  # a first look that missed the cursor: poll again
                        if b is not None:
                            break
                        time.sleep(0.01)
                        b = a.receive(f"tmp{n}", "c")
                    assert b is not None and len(b) == 1
                    a.ack(b)
                    a.drop_queue(f"tmp{n}", force=True)
                    n += 1

        sent: list[int] = []

        def produce() -> None:
            with pgque.connect(roles["team"]) as p:
                n = 0
                while not stop.is_set():
                    sent.extend(p.send_batch("q", [("e", n + i, None) for i in range(10)]))
                    n += 10
                    time.sleep(0.01)

        threads = [background(f, errors) for f in (steady_consumer, churn, queues, produce)]
        threads += [background(lambda: ops_loop(roles["ops"], stop, passes, pause=0), errors)
                    for _ in range(2)]
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline and not errors:
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
        assert errors == []
        ops.tick("q")
        rest = drain_all(team, "q", "steady")
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_cursors")
        print(f"{rotations} cursor rotations, {markers[0]} subscribe cycles,"
              f" {len(steady) + len(rest)} events for the steady consumer")
        got = steady + rest
        # In order per producer: the markers of the churn commit between the
        # producer's batches, each in its own transaction.
        produced = set(sent)
        from_producer = [e for e in got if e in produced]
        assert len(got) == len(set(got)) and from_producer == sorted(from_producer)
        assert set(sent) <= set(got), f"{len(set(sent) - set(got))} events lost"


@pytest.mark.parametrize("maintainers", [1, 2])
def test_lagging_and_new_consumers_lose_no_event_under_back_to_back_rotations(
        roles: dict[str, str], conn: psycopg.Connection[Any], dsn: str,
        maintainers: int) -> None:
    """A consumer that keeps up, one that reads in bursts (lagging across
    rotations), and fresh queues each subscribed, sent to, ticked and read
    once, while maintainers rotate back to back: every event reaches every
    consumer. The tick rotation judges which ticks are needed from the
    subscriptions' current cursors (_ticks_kept_from); a cursor it cannot see
    (the race of the previous tests, inside maintenance) counts as no
    subscription, its queue's newest tick as all that is needed, and the
    partition with the tick a cursor names is truncated: a batch with no
    lower snapshot reads nothing, the cursor moves past it, events are
    lost. (Observed instead: receive's first look, without a lock, misses the
    cursor the same way and says no batch is ready though one is; the next
    poll gets it.)"""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q", ticker_max_lag=0)
        team.subscribe("q", "fast")
        team.subscribe("q", "lagging")
        rotate_always(conn)
        stop, errors, passes = threading.Event(), [], []
        got: dict[str, list[int]] = {"fast": [], "lagging": []}
        sent: list[int] = []
        lost_fresh: list[str] = []
        spurious = [0]

        def reader(consumer: str, pause: float) -> None:
            with pgque.connect(roles["team"]) as w:
                while not stop.is_set():
                    while (batch := w.receive("q", consumer, max_events=50)) is not None:
                        got[consumer].extend(m.id for m in batch)
                        w.ack(batch)
                    time.sleep(pause)

        def fresh_queues() -> None:
            with pgque.connect(roles["ops"]) as a:
                n = 0
                while not stop.is_set():
                    a.create_queue(f"tmp{n}")
                    a.subscribe(f"tmp{n}", "c")
                    ev = a.send(f"tmp{n}", "e", n)
                    a.tick(f"tmp{n}")
                    b = a.receive(f"tmp{n}", "c")
                    tries = 1
                    while b is None and tries < 50:  # a poll that saw nothing: poll again
                        spurious[0] += 1
                        time.sleep(0.01)
                        b = a.receive(f"tmp{n}", "c")
                        tries += 1
                    if b is None or [m.id for m in b] != [ev]:
                        with psycopg.connect(dsn) as look:
                            ticks = look.execute(
                                "select tick_id, tick_part from pgque.tick t join pgque.queue q"
                                " on q.queue_id = t.tick_queue where q.queue_name = %s"
                                " order by tick_id", (f"tmp{n}",)).fetchall()
                            curs = look.execute(
                                "select c.cur_seq, c.cur_last_tick, c.cur_part from pgque.cursor c"
                                " join pgque.subscription s on s.sub_id = c.cur_sub"
                                " join pgque.queue q on q.queue_id = s.sub_queue"
                                " where q.queue_name = %s order by 1", (f"tmp{n}",)).fetchall()
                        lost_fresh.append(f"tmp{n}: sent {ev}, received "
                                          f"{None if b is None else [m.id for m in b]};"
                                          f" its ticks now (id, part): {ticks};"
                                          f" its cursor rows (seq, last tick, part): {curs}")
                    else:
                        a.ack(b)
                    a.drop_queue(f"tmp{n}", force=True)
                    n += 1

        def produce() -> None:
            with pgque.connect(roles["team"]) as p:
                n = 0
                while not stop.is_set():
                    sent.extend(p.send_batch("q", [("e", n + i, None) for i in range(10)]))
                    n += 10
                    time.sleep(0.01)

        threads = [background(lambda: reader("fast", 0.005), errors),
                   background(lambda: reader("lagging", 0.5), errors),
                   background(fresh_queues, errors), background(produce, errors)]
        threads += [background(lambda: ops_loop(roles["ops"], stop, passes, pause=0), errors)
                    for _ in range(maintainers)]
        time.sleep(RUN_SECONDS)
        stop.set()
        for t in threads:
            t.join(30)
        ops.tick("q")
        for consumer in got:
            got[consumer] += drain_all(team, "q", consumer)
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_ticks")
        missing = {c: len(set(sent) - set(ids)) for c, ids in got.items()}
        print(f"{rotations} tick rotations; missing {missing} of {len(sent)};"
              f" fresh queues that lost their event: {len(lost_fresh)} {lost_fresh[:3]};"
              f" receives that said nothing was ready though a batch was: {spurious[0]};"
              f" errors {errors!r}")
        assert errors == []
        assert lost_fresh == []
        for consumer, ids in got.items():
            assert ids == sent, f"{consumer}: {len(set(sent) - set(ids))} events lost"


def test_transactional_lanes_killed_mid_handler_under_rotations_handle_every_event_once(
        roles: dict[str, str], conn: psycopg.Connection[Any], dsn: str,
        handled_table: str) -> None:
    """A transactional Worker whose lane sessions are terminated at random
    moments (mid-handler, mid-ack), while maintenance rotates every 100 ms:
    every event's writes committed once, each key in order, no worker error."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q", ticker_max_lag=0)
        team.subscribe_slots("q", "g", slots=4)
        conn.execute("update pgque.rotation set rt_period = '100 ms'")
        ops.maintenance()

        def handler(message: pgque.Message[Any], hconn: Any) -> None:
            hconn.execute("insert into public.atk_handled (ev_id, key) values (%s, %s)",
                          (message.id, message.partition_key))
            time.sleep(0.001)

        stop, errors, passes = threading.Event(), [], []
        kills = [0]
        opsthread = background(lambda: ops_loop(roles["ops"], stop, passes, pause=0.05), errors)

        def killer() -> None:
            rng = random.Random(17)
            with psycopg.connect(dsn, autocommit=True) as k:
                while not stop.is_set():
                    time.sleep(rng.uniform(0.1, 0.3))
                    row = k.execute(
                        "select pg_terminate_backend(pid) from pg_stat_activity"
                        " where application_name like 'pgque-worker-q-g-lane%%'"
                        " order by random() limit 1").fetchone()
                    if row and row[0]:
                        kills[0] += 1

        worker = pgque.Worker(roles["team"], queue="q", consumer="g", slots=4, handler=handler,
                              transactional=True, ticker=False, max_events=10,
                              rebalance_interval=0.2, poll_interval=0.05)
        sent: dict[int, str] = {}
        try:
            worker.start()
            wait_for(lambda: len(worker.owned_slots) == 4, what="the worker owns its slots")
            killthread = background(killer, errors)
            rng = random.Random(21)
            for _ in range(150):
                rows = [("e", {}, f"k{rng.randrange(20)}") for _ in range(10)]
                for (_t, _p, key), ev in zip(rows, team.send_batch("q", rows), strict=True):
                    sent[ev] = key
                time.sleep(0.02)
            wait_for(lambda: scalar(conn, "select count(distinct ev_id) from public.atk_handled")
                     >= len(sent) or worker.error is not None, timeout=90,
                     what="every event handled")
            error = worker.error
        finally:
            stop.set()
            worker.stop()
            opsthread.join(10)
        killthread.join(10)
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_cursors")
        print(f"{kills[0]} lane sessions killed, {rotations} cursor rotations, error {error!r}")
        assert errors == []
        assert error is None, repr(error)
        check_once_in_order(conn, sent)


# -- upgrades with live state -----------------------------------------------------------------


@pytest.mark.parametrize("baseline", ["0.1.0", "0.2.0", "0.4.0"])
def test_an_upgraded_state_survives_many_rotations_before_it_is_read(
        empty_dsn: str, pg_server: Any, baseline: str) -> None:
    """The state test_upgrade leaves in a 0.1/0.2/0.4 database (a batch half
    handed out, a retry waiting, a dead letter, slots never read, epochs),
    upgraded, then rotated at every pass many times over before anyone reads
    it: nothing lost or delivered twice (test_upgrade's check_upgraded)."""
    from helpers import install_0_1, install_0_2, install_0_4
    from test_upgrade import check_upgraded, fill_0_1, fill_0_2

    if baseline == "0.1.0":
        install_0_1(empty_dsn)
        seen = fill_0_1(empty_dsn)
    elif baseline == "0.2.0":
        install_0_2(empty_dsn)
        seen = fill_0_2(empty_dsn)
    else:
        install_0_2(empty_dsn)
        seen = fill_0_2(empty_dsn)
        install_0_4(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == baseline  # the version it upgraded from
        rotate_always(conn)
        with pgque.connect(empty_dsn) as client:
            for _ in range(6):
                client.tick("q")
                client.maintenance()
        counts = conn.execute("select (select count(*) from pgque.cursor),"
                              " (select count(*) from pgque.tick)").fetchone()
        print(f"{baseline}: after the upgrade and 6 rotating passes, cursor rows and ticks:"
              f" {counts}")
        conn.execute("update pgque.rotation set rt_period = '1 minute'")
    check_upgraded(empty_dsn, pg_server, seen)


def test_a_worker_rides_through_the_upgrade_from_0_4_0_and_the_rotations_after(
        empty_dsn: str) -> None:
    """A transactional Worker and a ticker running against a 0.4.0 database
    that is upgraded under them (migration 7 turns the cursor log and the
    ticks into partitioned tables), then rotates at every pass: every event's
    writes once, each key in order, no worker error."""
    from helpers import install_0_4

    install_0_4(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as su:
        su.execute("create table public.atk_handled (seq bigserial primary key, ev_id bigint,"
                   " key text, slot integer)")
    with pgque.connect(empty_dsn) as admin, psycopg.connect(empty_dsn, autocommit=True) as conn:
        admin.create_queue("q", ticker_max_lag=0)
        admin.subscribe_slots("q", "g", slots=4)

        def handler(message: pgque.Message[Any], hconn: Any) -> None:
            hconn.execute("insert into public.atk_handled (ev_id, key) values (%s, %s)",
                          (message.id, message.partition_key))

        stop, errors, passes = threading.Event(), [], []
        opsthread = background(lambda: ops_loop(empty_dsn, stop, passes, pause=0.05), errors)
        worker = pgque.Worker(empty_dsn, queue="q", consumer="g", slots=4, handler=handler,
                              transactional=True, ticker=False, max_events=10,
                              rebalance_interval=0.2, poll_interval=0.05)
        sent: dict[int, str] = {}
        try:
            worker.start()
            wait_for(lambda: len(worker.owned_slots) == 4, what="the worker owns its slots")
            rng = random.Random(23)
            for n in range(120):
                rows = [("e", {}, f"k{rng.randrange(20)}") for _ in range(10)]
                for (_t, _p, key), ev in zip(rows, admin.send_batch("q", rows), strict=True):
                    sent[ev] = key
                time.sleep(0.02)
                if n == 40:
                    with psycopg.connect(empty_dsn, autocommit=True) as up:
                        assert pgque.install(up) == "0.4.0"
                    conn.execute("update pgque.rotation set rt_period = '0'")
            wait_for(lambda: scalar(conn, "select count(distinct ev_id) from public.atk_handled")
                     >= len(sent) or worker.error is not None, timeout=90,
                     what="every event handled")
            error = worker.error
        finally:
            stop.set()
            worker.stop()
            opsthread.join(10)
        rotations = sum(1 for p in passes for s in p if s[1] == "rotate_cursors")
        print(f"{rotations} cursor rotations after the upgrade; error {error!r}; "
              f"ops errors {errors!r}")
        assert error is None, repr(error)
        assert errors == []
        assert rotations > 0
        check_once_in_order(conn, sent)


# -- an idle database -------------------------------------------------------------------------


def test_an_idle_database_settles_and_rotates_nothing(
        roles: dict[str, str], conn: psycopg.Connection[Any]) -> None:
    """After activity stops (a consumer that kept up, one that lags with a batch
    open, a group, a queue without subscriptions), a few passes settle the
    rotated tables and then maintenance writes nothing: no step, no update of
    pgque.rotation, no transaction id."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q")
        ops.create_queue("nobody")
        team.subscribe("q", "fast")
        team.subscribe("q", "lagging")
        team.subscribe_slots("q", "g", slots=4)
        rotate_always(conn)
        for n in range(10):
            team.send_batch("q", [("e", n, f"k{i}") for i in range(5)])
            team.send("nobody", "e", n)
            ops.tick("q")
            ops.tick("nobody")
            drain_all(team, "q", "fast")
            if n == 3:
                assert team.receive("q", "lagging", max_events=2) is not None
            ops.maintenance()
        for _ in range(4):
            ops.maintenance()
        before = table_writes(conn)
        xid_before = scalar(conn, "select pg_current_xact_id_if_assigned() is null")
        next_xid = scalar(conn, "select txid_current()")
        steps = []
        for _ in range(10):
            steps += ops.maintenance()
        after = table_writes(conn)
        assert xid_before
        assert steps == []
        assert after["rotation"] == before["rotation"]
        assert scalar(conn, "select txid_current()") == next_xid + 1  # none used meanwhile


@pytest.mark.parametrize("how", ["receive_slots", "receive_partitioned"])
def test_slots_without_events_do_not_pin_the_ticks(
        roles: dict[str, str], conn: psycopg.Connection[Any], how: str) -> None:
    """A group whose events all route to one slot, drained by one session
    owning all 4 slots: the idle slots' cursors move only once their last
    tick is a second old (_slot_cursor_lag), so they hold the ticks back for
    that second, and no longer."""
    with pgque.connect(roles["ops"]) as ops, pgque.connect(roles["team"]) as team:
        ops.create_queue("q")
        team.subscribe_slots("q", "g", slots=4)
        for slot in range(4):
            assert team.claim_slot("q", "g", slot)
        rotate_always(conn)
        got: list[int] = []
        sent: list[int] = []

        def cycle() -> None:
            nonlocal got, sent
            sent += team.send_batch("q", [("e", 0, "the-one-key")] * 3)
            ops.tick("q")
            if how == "receive_slots":
                while batches := team.receive_slots("q", "g", slots=4, owned=range(4)):
                    got += [m.id for b in batches for m in b]
                    team.ack_slots(batches)
            else:
                for slot in range(4):
                    while (b := team.receive_partitioned("q", "g", slot=slot, slots=4)):
                        got += [m.id for m in b]
                        team.ack(b)
            ops.maintenance()

        for _ in range(40):
            cycle()
        for _ in range(2):  # the idle slots' lag passes: they move, twice
            time.sleep(1.1)
            cycle()
            ops.maintenance()
        assert sorted(got) == sorted(sent)
        ticks = scalar(conn, "select count(*) from pgque.tick")
        cursors = conn.execute(
            "select s.sub_consumer, (c).cur_last_tick, (c).cur_batch from pgque.subscription s,"
            " lateral (select pgque._current_cursor(s.sub_id) c) x order by 1").fetchall()
        newest = scalar(conn, "select max(tick_id) from pgque.tick")
        assert ticks <= 10, (f"{ticks} ticks kept after 42 ticks with every slot drained;"
                            f" newest tick {newest}; cursors (slot, last tick, open batch):"
                            f" {cursors}")
