"""Batch readers (pgque/sql/code/generated/batch_reader.sql): every queue has a generated
function holding its batch queries as static SQL, so a receive plans nothing.
It has a branch for each slot count its groups use, is rewritten by
maintenance when they change (and by an install, which never deadlocks with a
maintenance), goes with its queue, and never changes which events a batch
holds: the dynamic statement it replaces gives the same, for every parameter,
while readers are rewritten under running consumers. No role may call it, nor
keep its queue from being dropped by depending on it."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import install_0_1, refused, scalar, slot_keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque


def reader_source(conn: psycopg.Connection[Any], queue_id: int) -> str | None:
    row = conn.execute("select p.prosrc from pg_proc p"
                       " where p.pronamespace = 'pgque'::regnamespace"
                       "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,)).fetchone()
    return None if row is None else str(row[0])


def branches(conn: psycopg.Connection[Any], queue_id: int) -> list[str]:
    source = reader_source(conn, queue_id)
    assert source is not None, "the queue has no batch reader"
    return [line.strip() for line in source.splitlines() if line.strip().startswith("if p_slots")]


def steps(client: pgque.Client) -> list[str]:
    return [str(step) for _, step, _ in
            client.conn.execute("select * from pgque.maint()").fetchall()]


def slot_batches(conn: psycopg.Connection[Any], queue_id: int, sub_id: int, slots: int,
                 limit: int | None) -> list[list[int]]:
    """Each slot's events between the queue's first and newest ticks, read by
    pgque._batch_events (the reader when it has the branch, else dynamic SQL)."""
    return [list(scalar(conn,
        "select coalesce(array_agg(e.ev_id order by n), '{}')"
        "  from unnest(pgque._batch_events(%s, %s,"
        "    (select tick_snapshot from pgque.tick where tick_queue = %s order by tick_id limit 1),"
        "    (select tick_snapshot from pgque.tick where tick_queue = %s"
        "      order by tick_id desc limit 1), 0, null, %s, null, %s, %s))"
        "       with ordinality as e(ev_id, ev_time, ev_txid, ev_owner, ev_retry, ev_type,"
        "                             ev_data, ev_extra1, n)",
        (queue_id, sub_id, queue_id, queue_id, limit, slot, slots)))
        for slot in range(slots)]


@pytest.mark.superuser_install  # it installs again as the superuser
def test_a_queue_has_a_reader_with_a_branch_per_slot_count_in_use(client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    assert branches(client.conn, queue_id) == ["if p_slots is null or p_slots = 1 then"]
    assert steps(client) == []  # nothing due: an idle queue's maintenance writes nothing
    client.subscribe_slots("q", "a", slots=4)
    client.subscribe_slots("q", "b", slots=16)
    assert steps(client) == ["slot_indexes", "batch_reader"]
    assert branches(client.conn, queue_id) == [
        "if p_slots is null or p_slots = 1 then", "if p_slots = 4 then", "if p_slots = 16 then"]
    assert steps(client) == []
    client.unsubscribe_slots("q", "a")
    assert steps(client) == ["slot_indexes", "batch_reader"]
    assert branches(client.conn, queue_id) == [
        "if p_slots is null or p_slots = 1 then", "if p_slots = 16 then"]
    # Installing again writes the same reader (and nothing is due after it).
    before = reader_source(client.conn, queue_id)
    client.install()
    assert reader_source(client.conn, queue_id) == before
    assert steps(client) == []
    client.unsubscribe_slots("q", "b")
    client.drop_queue("q")
    assert reader_source(client.conn, queue_id) is None


def test_the_reader_is_internal(client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    acl = scalar(client.conn, "select p.proacl::text from pg_proc p"
                              " where p.pronamespace = 'pgque'::regnamespace"
                              "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,))
    owner = scalar(client.conn, "select nspowner::regrole::text from pg_namespace"
                                " where nspname = 'pgque'")  # the installer
    assert acl == f"{{{owner}=X/{owner}}}"  # no PUBLIC, no pgque role
    # The point of the reader: its statements run on a plan made once per
    # session, not planned per call.
    config = scalar(client.conn, "select p.proconfig::text from pg_proc p"
                                 " where p.pronamespace = 'pgque'::regnamespace"
                                 "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,))
    assert "plan_cache_mode=force_generic_plan" in config


@given(keys=st.lists(st.one_of(st.none(), st.text(st.characters(blacklist_categories=["Cs"],
                                                                   blacklist_characters="\x00"),
                                                    max_size=8)), min_size=1, max_size=60),
       slots=st.sampled_from([2, 3, 8]), limit=st.sampled_from([None, 1, 7]))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_reader_reads_what_the_dynamic_statement_reads(
        client: pgque.Client, keys: list[str | None], slots: int, limit: int | None) -> None:
    client.conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    queue_id = client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    client.send_batch("q", [("e", {"n": n}, key) for n, key in enumerate(keys)])
    client.tick("q")
    sub_id = scalar(client.conn, "select sub_id from pgque.subscription"
                                 " where sub_consumer = pgque._slot_name('g', 0, %s)", (slots,))
    assert branches(client.conn, queue_id)[-1] == "if p_slots is null or p_slots = 1 then"
    dynamic = slot_batches(client.conn, queue_id, sub_id, slots, limit)
    client.maintenance()
    assert branches(client.conn, queue_id)[-1] == f"if p_slots = {slots} then"
    static = slot_batches(client.conn, queue_id, sub_id, slots, limit)
    assert static == dynamic
    # And both are what routing says: each slot's keys, in send order.
    ids = client.conn.execute(
        "select ev_id, pgque.slot_of(ev_extra1, %s) from pgque.event_" + str(queue_id)
        + " order by ev_id", (slots,)).fetchall()
    wanted = [[ev for ev, slot in ids if slot == s][:limit] for s in range(slots)]
    assert static == wanted


def test_a_session_keeps_reading_right_across_rewrites_truncates_and_new_groups(
        client: pgque.Client, dsn: str) -> None:
    """A session's cached plans of the reader must follow what changed under
    them: the reader rewritten for a new group, a slot index built, an event
    table truncated by rotation."""
    client.create_queue("q", rotation_period=0)
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    with pgque.connect(dsn) as worker:
        sent: list[int] = []
        got: list[int] = []
        done: list[str] = []

        def drain_all(group: str, slots: int) -> None:
            for slot in range(slots):
                assert worker.claim_slot("q", group, slot)
                while (batch := worker.receive_partitioned("q", group, slot=slot, slots=slots)):
                    assert all(scalar(worker.conn, "select pgque.slot_of(%s, %s)",
                                      (m.partition_key, slots)) == slot for m in batch)
                    got.extend(m.id for m in batch if group == "g")
                    worker.ack(batch)

        for round_ in range(8):
            sent += client.send_batch("q", [("e", n, f"k{round_}-{n}") for n in range(30)])
            client.tick("q")
            drain_all("g", 4)
            if round_ == 2:
                client.subscribe_slots("q", "h", slots=8)  # a new branch, written below
            if round_ >= 2:
                drain_all("h", 8)
            done += steps(client)  # rotates and truncates (rotation_period 0)
        assert sorted(got) == sorted(sent)
    assert done.count("rotate") >= 3 and "batch_reader" in done


def test_a_reader_behind_the_groups_reads_dynamically(client: pgque.Client) -> None:
    """Between a subscribe and the next maintenance the reader has no branch
    for the new count: the slot still gets its events, by dynamic SQL."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=5)
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(50)])
    client.tick("q")
    got: list[int] = []
    for slot in range(5):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=5)):
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)


def scanned(conn: psycopg.Connection[Any], queue_id: int) -> int:
    """Rows read from the queue's event tables so far (sequential and by index)."""
    conn.execute("select pg_stat_force_next_flush()")
    return int(scalar(conn, "select coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0)"
                            "  from pg_stat_user_tables where schemaname = 'pgque'"
                            "   and relname ~ %s", (f"^event_{queue_id}_[0-9]+$",)))


def test_transactions_in_progress_at_a_tick_do_not_make_a_slot_read_the_table(
        client: pgque.Client, dsn: str) -> None:
    """The batch after a tick that saw transactions in progress reads them by
    their ids (prev's xip list) besides the txid range. Written as one "range
    or in list" condition, the readers' generic plan on PostgreSQL 15 used
    the slot index for the slot alone and read every row of the slot in the
    table at each receive; a hash join over the list did the same."""
    queue_id = client.create_queue("q", ticker_max_count=10_000)
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    for _ in range(4):  # a table with history: 4 batches already consumed
        client.send_batch("q", [("e", n, f"old-{n}") for n in range(500)])
        client.tick("q")
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            client.ack(batch)
    sent: list[int] = []
    with pgque.connect(dsn) as held:
        held.conn.execute("begin")
        sent += held.send_batch("q", [("e", n, f"held-{n}") for n in range(40)])
        client.tick("q")  # the held transaction is in progress: in this tick's xip
        sent += client.send_batch("q", [("e", n, f"new-{n}") for n in range(40)])
        held.conn.execute("commit")
    client.tick("q")
    before = scanned(client.conn, queue_id)
    got: list[int] = []
    for slot in range(4):
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)
    # The table holds 2,080 rows; the slots' reads of these 80 events may not
    # come near them (each slot reading its whole hash class would be 2,080).
    assert (scanned(client.conn, queue_id) - before) / len(sent) <= 2.5


def test_a_reader_dropped_by_hand_reads_dynamically_until_maintenance_writes_it(
        client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(30)])
    client.tick("q")
    client.conn.execute(f"drop function pgque._batch_reader_{queue_id}")
    got: list[int] = []
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)
    assert "batch_reader" in steps(client)  # among the ticks and cursors it cleans
    assert branches(client.conn, queue_id)[-1] == "if p_slots = 4 then"


# -- an install and maintenance, both rewriting readers ----------------------------------


def _install_while(dsn: str, during: Any) -> dict[str, str]:
    """Runs pgque.install in a thread; once it waits for a lock, calls during()
    (which may raise psycopg.Error: recorded as "during"); then waits for the
    install. Returns {"install": "ok" or its error, "during": ...}."""
    result: dict[str, str] = {}
    with psycopg.connect(dsn, autocommit=True) as installer, \
            psycopg.connect(dsn, autocommit=True) as watcher:
        pid = installer.info.backend_pid

        def install() -> None:
            try:
                pgque.install(installer)
                result["install"] = "ok"
            except psycopg.Error as exc:
                result["install"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

        t = threading.Thread(target=install)
        t.start()
        deadline = time.monotonic() + 30
        while not scalar(watcher, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (pid,)):
            assert time.monotonic() < deadline, "the install never waited"
            time.sleep(0.02)
        try:
            during()
        except psycopg.Error as exc:
            result["during"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        t.join(120)
        assert not t.is_alive()
    return result


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_install_does_not_deadlock_with_a_maintenance_pass_over_several_queues(
        dsn: str) -> None:
    """A maintenance pass holds each queue's maintenance lock and, once it wrote
    a reader, the generators' lock to its commit. One that has rotated q1 and
    written its reader, then rewrites q2's reader (a group of a new count
    subscribed) while an install waits to replace every reader makes no lock
    cycle with it: the install succeeds (operations.md "Upgrading": the install
    itself waits for no worker)."""
    with pgque.connect(dsn) as client:
        client.create_queue("q1", rotation_period=0)  # always something to rotate
        client.create_queue("q2")
        client.subscribe_slots("q1", "g", slots=2)  # q1's reader is due
        client.subscribe_slots("q2", "g", slots=4)  # q2's reader is due
    with psycopg.connect(dsn) as maint:  # one transaction, as one maint() of all queues
        # q1 rotated, its reader written: the pass holds the generators' lock.
        assert [r[1] for r in maint.execute("select * from pgque.maint('q1')")] == [
            "rotate", "slot_indexes", "batch_reader"]

        def rest_of_the_pass() -> None:
            maint.execute("select * from pgque.maint('q2')").fetchall()
            maint.commit()

        result = _install_while(dsn, rest_of_the_pass)
        maint.rollback()
    assert result.get("install") == "ok", result


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_install_waits_for_a_maintenance_that_rewrote_a_reader(dsn: str) -> None:
    """A reader rewritten by a maintenance not yet committed when the install
    comes to it: the install waits for that maintenance, then succeeds."""
    with pgque.connect(dsn) as client:
        client.create_queue("q")
        client.subscribe_slots("q", "g", slots=4)
    with psycopg.connect(dsn) as maint:
        assert "batch_reader" in [r[1] for r in maint.execute("select * from pgque.maint()")]
        result = _install_while(dsn, maint.commit)
    assert result == {"install": "ok"}, result


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_upgraded_0_1_install_gets_readers_for_its_groups(empty_dsn: str) -> None:
    """An install over 0.1.0 writes each queue a reader with a branch for each of
    its groups' slot counts (installing again writes the same one, nothing due
    after it), and every group reads all its events through it."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.subscribe_slots("q", "g", slots=2)
        client.subscribe_slots("q", "h", slots=3)
        sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(30)])
        client.tick("q")
        queue_id = scalar(client.conn, "select queue_id from pgque.queue")
        assert pgque.install(client.conn) == "0.1.0"
        source = str(scalar(client.conn, "select prosrc from pg_proc where proname ="
                                         " pgque._batch_reader_name(%s)", (queue_id,)))
        assert [line.strip() for line in source.splitlines() if "if p_slots" in line] == [
            "if p_slots is null or p_slots = 1 then", "if p_slots = 2 then",
            "if p_slots = 3 then"]
        assert "batch_reader" not in [s for _, s, _ in client.maintenance()]
        pgque.install(client.conn)  # again: the same reader, nothing due
        assert scalar(client.conn, "select prosrc from pg_proc where proname ="
                                   " pgque._batch_reader_name(%s)", (queue_id,)) == source
        assert client.maintenance() == []
        for group, slots in (("g", 2), ("h", 3)):
            for slot in range(slots):
                assert client.claim_slot("q", group, slot)
            got: list[int] = []
            while batches := client.receive_slots("q", group, slots=slots,
                                                  owned=range(slots), max_events=4):
                got += [m.id for b in batches for m in b]
                client.ack_slots(batches)
            assert sorted(got) == sorted(sent)


# -- who may call a reader, and depend on one ----------------------------------------------


INTERNALS = [
    "select pgque._batch_reader_{id}(null::pgque.read_request)",
    "select pgque._run_reader({id}, null::pgque.read_request)",
    "select pgque._batch_events({id}, 1, null, null, 0, null, null, null)",
    "select pgque._probe_slots({id}, null, null, array[0], array[1], array[null::pg_snapshot])",
    "select pgque._sync_batch_reader({id}, false)",
    "select pgque._drop_generated('_batch_reader_{id}')",
    "select pgque._batch_reader_source({id}, '{{}}')",
]


@pytest.mark.parametrize("kind", ["reader", "writer", "admin", "nobody"])
def test_no_role_calls_a_reader_or_its_helpers(role_clients: dict[str, pgque.Client], dsn: str,
                                               kind: str) -> None:
    """No pgque role (nor a role in none) may call a queue's reader or the
    functions that run, probe, write or drop it, by name or through a
    search_path of its own; the reader stays as it was."""
    with psycopg.connect(dsn, autocommit=True) as su:
        queue_id = scalar(su, "select queue_id from pgque.queue where queue_name = 'q'")
        su.execute("select pgque.maint()")
        before = su.execute("select p.prosrc from pg_proc p where p.proname = "
                            "pgque._batch_reader_name(%s)", (queue_id,)).fetchone()
    client = role_clients[kind]
    for statement in INTERNALS:
        assert refused(lambda s=statement: client.conn.execute(s.format(id=queue_id))), statement
    # Not through a search_path of its own either.
    client.conn.execute("set search_path = pgque, public")
    with pytest.raises((psycopg.errors.InsufficientPrivilege,
                        psycopg.errors.UndefinedFunction)):  # nobody: no usage on the schema
        client.conn.execute(
            f"select _batch_reader_{queue_id}(null, null, null, null, null, 0, null, null, 0,"
            " null, null, null, null, null, false)")
    with psycopg.connect(dsn, autocommit=True) as su:
        after = su.execute("select p.prosrc from pg_proc p where p.proname = "
                           "pgque._batch_reader_name(%s)", (queue_id,)).fetchone()
    assert after == before is not None


def test_a_reader_role_cannot_pin_a_batch_reader_and_block_drop_queue(dsn: str) -> None:
    """A SQL-standard function body may name the reader without the right to call
    it (a pgque_reader has USAGE on the schema): drop_queue with force drops the
    queue anyway, the reader with what depends on it."""
    role = f"rv_pin_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_reader to {role}")
        su.execute(f"create schema {role} authorization {role}")
        queue_id = scalar(su, "select pgque.create_queue('q')")
        # Whatever the reader returns (rows since 0.11, an array before).
        returns = scalar(su, "select pg_get_function_result(p.oid) from pg_proc p"
                             " where p.pronamespace = 'pgque'::regnamespace"
                             "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,))
        try:
            with psycopg.connect(make_conninfo(**{**params, "user": role}),
                                 autocommit=True) as r:
                r.execute(
                    f"create function {role}.pin() returns {returns}"
                    f" language sql begin atomic select * from pgque._batch_reader_{queue_id}("
                    "null::pgque.read_request); end")
            su.execute("select pgque.drop_queue('q', true)")
        finally:
            su.execute(f"drop schema if exists {role} cascade")
            su.execute(f"drop owned by {role} cascade")
            su.execute(f"drop role {role}")


# -- the reader reads what the dynamic statement reads -------------------------------------


DYNAMIC = """
create or replace function public.rv_dynamic(p_queue_id integer, p_req pgque.read_request)
returns pgque.event_template[] language plpgsql as $$
declare v pgque.event_template[];
begin
    execute pgque._as_array(
                case when p_req.probe
                     then pgque._probe_rows('($1)', p_queue_id, coalesce(p_req.slots, 1))
                     else pgque._read_rows('($1)', p_queue_id, coalesce(p_req.slots, 1)) end)
       into v using p_req;
    return v;
end $$;
-- The read request, from the parameters in the order the tests give them.
create or replace function public.rv_request(
    p_slots integer, p_probe boolean, a xid8, b xid8, c xid8[], d pg_snapshot, e integer,
    f bigint, g bigint, h bigint[], i integer, j integer, k integer[], l integer[],
    m pg_snapshot[])
returns pgque.read_request language sql as $$
    select row(a, c, b, d, e, f, g, h, i, p_slots, j, k, l, m, p_probe)::pgque.read_request
$$"""


@given(keys=st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d", "e", "f"])),
                     min_size=1, max_size=40),
       slots=st.sampled_from([1, 2, 3, 8]), after=st.integers(0, 30),
       upto=st.one_of(st.none(), st.integers(0, 40)), limit=st.sampled_from([None, 1, 5]),
       ids=st.one_of(st.none(), st.lists(st.integers(0, 45), max_size=6)),
       owner=st.booleans())
@settings(max_examples=int(os.environ.get("RV_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reader_and_dynamic_sql_agree_on_every_parameter(
        conn: psycopg.Connection[Any], keys: list[str | None], slots: int, after: int,
        upto: int | None, limit: int | None, ids: list[int] | None, owner: bool) -> None:
    """The reader's branch against the dynamic statement, for reads with after, upto,
    ids and limit and for the probe, with retries owned by one slot's subscription
    among the events (ev_owner)."""
    conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    conn.execute(DYNAMIC)
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', %s)", (slots,))
    conn.execute("select pgque.maint()")
    subs = [r[0] for r in conn.execute(
        "select sub_id from pgque.subscription order by sub_id").fetchall()]
    base = int(scalar(conn, f"select coalesce(max(ev_id), 0) from pgque.event_{queue_id}"))
    first = conn.execute(
        "select t.tick_snapshot from pgque.tick t where t.tick_queue = %s"
        " order by tick_id desc limit 1", (queue_id,)).fetchone()
    assert first is not None
    for n, key in enumerate(keys):
        conn.execute(
            f"insert into pgque.event_{queue_id}_0 (ev_owner, ev_type, ev_data, ev_extra1)"
            " values (%s, 'e', %s, %s)",
            (subs[n % len(subs)] if owner and n % 3 == 0 else None, str(n), key))
    conn.execute("select pgque.tick('q')")
    prev = first[0]
    shifted = None if ids is None else [base + i for i in ids]
    for slot in range(slots):
        sub = subs[slot]
        params = (queue_id, slots, False, prev, prev, sub, base + after,
                  None if upto is None else base + upto, shifted, slot, limit)
        sql = ("select {fn}(%s, public.rv_request(%s, %s, pg_snapshot_xmax(%s::pg_snapshot),"
               " pg_snapshot_xmax(n.s), array(select pg_snapshot_xip(%s::pg_snapshot)), n.s,"
               " %s, %s, %s, %s::bigint[], %s, %s, null, null, null))::text from"
               " (select tick_snapshot s from pgque.tick order by tick_id desc limit 1) n")
        static = scalar(conn, sql.format(fn="pgque._run_reader"), params)
        dynamic = scalar(conn, sql.format(fn="public.rv_dynamic"), params)
        assert static == dynamic
    probe = ("select coalesce(array_agg(distinct pgque.slot_of(e.ev_extra1, %s)), '{{}}')"
             " from (select tick_snapshot s from pgque.tick order by tick_id desc limit 1) n,"
             " unnest({fn}(%s, public.rv_request(%s, true, null, pg_snapshot_xmax(n.s), null, n.s,"
             " null, null, null, null, null, null, %s::integer[], %s::integer[],"
             " %s::pg_snapshot[]))) e")
    args = (slots, queue_id, slots, list(range(slots)), subs[:slots], [prev] * slots)
    assert scalar(conn, probe.format(fn="pgque._run_reader"), args) == scalar(
        conn, probe.format(fn="public.rv_dynamic"), args)


# -- reading through readers that change ---------------------------------------------------


def test_a_session_reads_a_queue_dropped_and_made_again_under_its_name(
        client: pgque.Client, dsn: str) -> None:
    """A session that read a queue reads the queue made again under its name (a
    new id, a new reader, or none yet: dynamically) as the new queue: every
    event once, nothing pending after."""
    with pgque.connect(dsn) as worker:
        for round_ in range(3):
            client.create_queue("q")
            client.subscribe_slots("q", "g", slots=4)
            if round_ != 1:
                client.maintenance()  # round 1 reads dynamically
            sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
            client.tick("q")
            for slot in range(4):
                assert worker.claim_slot("q", "g", slot)
            got: list[int] = []
            while batches := worker.receive_slots("q", "g", slots=4, owned=range(4)):
                got += [m.id for b in batches for m in b]
                worker.ack_slots(batches)
            assert sorted(got) == sorted(sent)
            assert worker.pending_slots("q", "g") == frozenset()
            client.drop_queue("q", force=True)


def _receive_slot_with(client: pgque.Client, slot: int, slots: int,
                       cursor: str, max_events: int | None = None) -> list[Any]:
    """pgque._receive_slot of group g's slot with the cursor given (as text): a
    read ahead made from a cursor that has moved since."""
    return client.conn.execute(
        "select r.batch_id, r.ev_id from pgque._receive_slot("
        "  (select q from pgque.queue q where q.queue_name = 'q'),"
        "  (select g from pgque.consumer_group g where g.cg_consumer = 'g'), %s,"
        "  (select s from pgque.subscription s"
        "    where s.sub_consumer = pgque._slot_name('g', %s, %s)),"
        "  %s::pgque.cursor, %s) r", (slot, slot, slots, cursor, max_events)).fetchall()


def _cursor_text(client: pgque.Client, consumer: str) -> str:
    return str(scalar(client.conn, "select c::text from pgque.subscription s"
                                   " cross join lateral pgque._current_cursor(s.sub_id) c"
                                   " where s.sub_consumer = %s", (consumer,)))


def test_a_read_ahead_from_a_cursor_that_moved_is_not_used(client: pgque.Client) -> None:
    """The read-ahead is made without a lock: when the cursor moved before the
    lock (here: a cursor read before a receive and an ack, or before a receive
    that opened the batch), the events read ahead are not handed out."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    [key] = slot_keys(client.conn, 0, 4)
    first = client.send_batch("q", [("e", n, key) for n in range(3)])
    client.tick("q")
    assert client.claim_slot("q", "g", 0)
    stale = _cursor_text(client, "g#0/4")
    batch = client.receive_partitioned("q", "g", slot=0, slots=4)
    assert batch is not None and [m.id for m in batch] == first
    client.ack(batch)
    second = client.send_batch("q", [("e", n, key) for n in range(2)])
    client.tick("q")
    rows = _receive_slot_with(client, 0, 4, stale)
    assert [ev for _, ev in rows] == second
    # The same, the cursor now in an open batch handed out in part.
    client.ack(client.receive_partitioned("q", "g", slot=0, slots=4) or batch)
    third = client.send_batch("q", [("e", n, key) for n in range(4)])
    client.tick("q")
    stale = _cursor_text(client, "g#0/4")
    piece = client.receive_partitioned("q", "g", slot=0, slots=4, max_events=1)
    assert piece is not None and [m.id for m in piece] == third[:1]
    client.ack(piece)
    rows = _receive_slot_with(client, 0, 4, stale, 2)
    assert rows and {b for b, _ in rows} == {piece.batch_id}
    assert [ev for _, ev in rows] == third[1:3]


OPS = st.lists(st.one_of(
    st.tuples(st.just("send"), st.lists(st.one_of(st.none(), st.sampled_from(
        [f"k{n}" for n in range(12)])), min_size=1, max_size=15)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("maint")),
    st.tuples(st.just("regroup")),
    st.tuples(st.just("recv"), st.sets(st.integers(0, 7), min_size=1),
              st.sampled_from([None, 1, 3]), st.booleans()),
), min_size=1, max_size=25)


@given(ops=OPS, slots=st.sampled_from([1, 2, 3, 8]), max_count=st.sampled_from([1, 3, 500]))
@settings(max_examples=int(os.environ.get("RV_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_slot_sets_deliver_each_event_once_in_order_across_reader_changes(
        client: pgque.Client, ops: list[Any], slots: int, max_count: int) -> None:
    """Sends, ticks, maintenance (rotating: rotation_period 0, and writing the
    reader again as a second group comes and goes), receive_slots with pieces and
    nacks, in any order: every slot gets exactly its events, first deliveries in
    send order, nacked ones again as retries; pending_slots names exactly the
    slots that then receive something."""
    client.conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    client.create_queue("q", rotation_period=0, max_retries=100, ticker_max_count=max_count)
    client.subscribe_slots("q", "g", slots=slots)
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    expected: dict[int, list[int]] = {k: [] for k in range(slots)}
    first: dict[int, list[int]] = {k: [] for k in range(slots)}
    retried: list[int] = []
    owed: set[int] = set()  # nacked, not yet seen again
    grouped = False

    def slot_of(key: str | None) -> int:
        return int(scalar(client.conn, "select pgque.slot_of(%s, %s)", (key, slots)))

    def receive(wanted: set[int], max_events: int | None, nack: bool) -> None:
        pending = client.pending_slots("q", "g")
        batches = client.receive_slots("q", "g", slots=slots, owned=sorted(wanted),
                                       max_events=max_events)
        assert {b.slot for b in batches} == pending & wanted
        failed = []
        for batch in batches:
            assert batch.slot is not None
            assert max_events is None or len(batch) <= max_events
            for m in batch:
                assert slot_of(m.partition_key) == batch.slot
                if m.retry_count:
                    assert m.id in owed, m
                    owed.discard(m.id)
                    retried.append(m.id)
                else:
                    first[batch.slot].append(m.id)
            if nack and batch.messages and batch.messages[0].retry_count == 0:
                failed.append(batch.messages[0])
        client.ack_slots(batches, nack=failed)
        owed.update(m.id for m in failed)

    for op in ops:
        if op[0] == "send":
            ids = client.send_batch("q", [("e", n, key) for n, key in enumerate(op[1])])
            for ev, key in zip(ids, op[1], strict=True):
                expected[slot_of(key)].append(ev)
        elif op[0] == "tick":
            client.tick("q")
        elif op[0] == "maint":
            client.maintenance()
        elif op[0] == "regroup":
            if grouped:
                client.unsubscribe_slots("q", "h")
            else:
                client.subscribe_slots("q", "h", slots=slots + 1)
            grouped = not grouped
        else:
            receive({k for k in op[1] if k < slots}, op[2], op[3])
    for _ in range(200):
        client.maintenance()
        client.tick("q")
        before = (sum(map(len, first.values())), len(retried))
        receive(set(range(slots)), None, False)
        if not owed and before == (sum(map(len, first.values())), len(retried)) \
                and not client.pending_slots("q", "g"):
            break
    assert first == expected
    assert not owed


@pytest.mark.superuser_install  # it installs again as the superuser
def test_concurrent_churn_loses_and_duplicates_nothing(dsn: str) -> None:
    """A consumer draining with receive_slots / ack_slots (and pending_slots)
    while another session sends, ticks, runs maintenance that rotates and
    rewrites the reader (a second group coming and going), and installs: every
    event once, each slot's in order. An install may fail a call once."""
    slots = 4
    with pgque.connect(dsn) as admin:
        admin.create_queue("q", rotation_period=0, event_tables=3)
        admin.subscribe_slots("q", "g", slots=slots)
    sent: list[tuple[int, str]] = []
    stop = threading.Event()
    errors: list[str] = []

    def churn() -> None:
        with pgque.connect(dsn) as c:
            n = 0
            while not stop.is_set():
                n += 1
                keys = [f"k{(n * 7 + i) % 23}" for i in range(9)]
                ids = c.send_batch("q", [("e", i, k) for i, k in enumerate(keys)])
                sent.extend(zip(ids, keys, strict=True))
                c.tick("q")
                if n % 3 == 0:
                    try:
                        if n % 6 == 0:
                            c.subscribe_slots("q", "h", slots=n % 5 + 2)
                        else:
                            c.unsubscribe_slots("q", "h")
                    except pgque.PgqueError:
                        pass
                try:
                    c.maintenance()
                except psycopg.Error as exc:
                    errors.append(f"maint: {exc}")
                if n % 10 == 0:
                    try:
                        c.install()
                    except (psycopg.Error, pgque.PgqueError) as exc:
                        errors.append(f"install: {type(exc).__name__}: {exc}")

    got: dict[int, list[int]] = {k: [] for k in range(slots)}
    t = threading.Thread(target=churn)
    with pgque.connect(dsn) as worker:
        for slot in range(slots):
            assert worker.claim_slot("q", "g", slot)
        t.start()
        deadline = time.monotonic() + 6
        failures = 0

        def step() -> bool:
            worker.pending_slots("q", "g")
            batches = worker.receive_slots("q", "g", slots=slots, owned=range(slots),
                                           max_events=5)
            for b in batches:
                assert b.slot is not None
                got[b.slot].extend(m.id for m in b)
            worker.ack_slots(batches)
            return bool(batches)

        try:
            while time.monotonic() < deadline:
                try:
                    step()
                except (psycopg.Error, pgque.PgqueError) as exc:
                    failures += 1
                    errors.append(f"worker: {type(exc).__name__}: {exc}")
        finally:
            stop.set()
            t.join(60)
        with pgque.connect(dsn) as admin:
            for _ in range(3):
                admin.tick("q")
                admin.maintenance()
        # The first call after the last install may still fail, once (the code it
        # had prepared was replaced: "cache lookup failed"), as the docs allow.
        try:
            while step():
                pass
        except (psycopg.Error, pgque.PgqueError) as exc:
            errors.append(f"worker: {type(exc).__name__}: {exc}")
            while step():
                pass
    by_slot: dict[int, list[int]] = {k: [] for k in range(slots)}
    with psycopg.connect(dsn) as c:
        for ev, key in sent:
            by_slot[int(scalar(c, "select pgque.slot_of(%s, %s)", (key, slots)))].append(ev)
    assert got == by_slot
    assert not [e for e in errors if not e.startswith("worker")], errors


# -- receive: the whole batch straight from the reader's rows ------------------------------


def cursor_of(conn: psycopg.Connection[Any], consumer: str) -> tuple[Any, ...]:
    """(cur_batch, cur_pos, cur_handed, cur_end) of consumer's current cursor."""
    row = conn.execute(
        "select c.cur_batch, c.cur_pos, c.cur_handed, c.cur_end from pgque.subscription s"
        " cross join lateral (select * from pgque.cursor c where c.cur_sub = s.sub_id"
        "                      order by c.cur_seq desc limit 1) c"
        " where s.sub_consumer = %s", (consumer,)).fetchone()
    assert row is not None
    return tuple(row)


def test_a_whole_batch_comes_from_the_reader_and_its_ack_finishes_it(
        client: pgque.Client) -> None:
    """receive without max_events hands out the reader's rows as they come and
    records the batch as handed out whole: received again it is the same, a nack
    among it retries that event, a piece taken after it starts from the last
    ack, and every event is acked once."""
    client.create_queue("q")
    client.subscribe("q", "c")
    sent = client.send_batch("q", [("e", n, f"k{n % 4}") for n in range(20)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and [m.id for m in batch] == sent
    whole = scalar(client.conn, "select pgque._handed_whole()")
    assert cursor_of(client.conn, "c") == (batch.batch_id, 0, whole, whole)
    again = client.receive("q", "c")
    assert again is not None and again.batch_id == batch.batch_id
    assert [m.id for m in again] == sent
    assert client.ack(again, nack=[sent[5]], retry_after=0) is True
    assert client.receive("q", "c") is None

    more = client.send_batch("q", [("e", n, None) for n in range(10)])
    client.tick("q")
    first = client.receive("q", "c")
    assert first is not None and [m.id for m in first] == more
    piece = client.receive("q", "c", max_events=3)
    assert piece is not None and piece.batch_id == first.batch_id
    assert [m.id for m in piece] == more[:3]
    assert client.ack(piece) is False
    rest = client.receive("q", "c")
    assert rest is not None and [m.id for m in rest] == more[3:]
    assert client.ack(rest) is True

    client.maintenance("q")  # the nacked event back into the log
    client.tick("q")
    retried = client.receive("q", "c")
    assert retried is not None
    assert [(m.id, m.retry_count) for m in retried] == [(sent[5], 1)]
    assert client.ack(retried) is True
    assert client.receive("q", "c") is None


@pytest.mark.superuser_install  # it installs again as the superuser
def test_a_whole_receive_without_its_reader_reads_the_batch_into_an_array(
        client: pgque.Client) -> None:
    """With the queue's reader dropped by hand, a whole receive goes the way of
    pieces (_receive, dynamic SQL): the same events, its cursor at the batch's
    real last id; once maintenance wrote the reader again, the rows come from
    it and the cursor says handed out whole."""
    queue_id = client.create_queue("q")
    client.subscribe("q", "c")
    whole = scalar(client.conn, "select pgque._handed_whole()")
    client.conn.execute(f"drop function pgque._batch_reader_{queue_id}")
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(5)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and [m.id for m in batch] == sent
    assert cursor_of(client.conn, "c") == (batch.batch_id, 0, sent[-1], sent[-1])
    assert client.ack(batch) is True
    assert "batch_reader" in steps(client)
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(5)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and [m.id for m in batch] == sent
    assert cursor_of(client.conn, "c") == (batch.batch_id, 0, whole, whole)
    assert client.ack(batch) is True
    assert client.receive("q", "c") is None


def test_a_receive_moves_past_batches_that_hold_only_other_consumers_retries(
        client: pgque.Client) -> None:
    """A batch whose only events are another consumer's retries is consumed on the
    spot: the receive returns nothing, and the next batch with events comes with
    a new batch id."""
    client.create_queue("q")
    client.subscribe("q", "c")
    client.subscribe("q", "d")
    first = client.send("q", "e", 1)
    client.tick("q")
    for consumer in ("c", "d"):
        batch = client.receive("q", consumer)
        assert batch is not None and [m.id for m in batch] == [first]
        client.ack(batch, nack=[first] if consumer == "d" else (), retry_after=0)
    client.maintenance("q")  # d's retry into the log, owned by d
    client.tick("q")
    assert client.receive("q", "c") is None
    assert cursor_of(client.conn, "c")[0] is None  # no batch left open
    second = client.send("q", "e", 2)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None and [m.id for m in batch] == [second]
    client.ack(batch)
    retry = client.receive("q", "d")  # its retry and the later event, in one batch
    assert retry is not None
    assert [(m.id, m.retry_count) for m in retry] == [(first, 1), (second, 0)]


@given(ops=st.lists(st.one_of(st.tuples(st.just("send"), st.integers(1, 6)),
                              st.just(("tick",)), st.just(("whole",)),
                              st.tuples(st.just("piece"), st.integers(1, 4)),
                              st.just(("ack",))),
                    max_size=30))
@settings(max_examples=int(os.environ.get("RV_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_whole_receives_and_pieces_hand_out_every_event_once_in_order(
        client: pgque.Client, ops: list[tuple[Any, ...]]) -> None:
    """Any interleaving of sends, ticks, whole receives, pieces and acks: what the
    acks acknowledged (each the latest receive's events) is every event sent, in
    order, once, after a final drain."""
    client.conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    client.create_queue("q")
    client.subscribe("q", "c")
    sent: list[int] = []
    acked: list[int] = []
    latest: pgque.Batch[Any] | None = None
    for op in ops:
        if op[0] == "send":
            sent += client.send_batch("q", [("e", n, f"k{n}") for n in range(op[1])])
        elif op[0] == "tick":
            client.tick("q")
        elif op[0] in ("whole", "piece"):
            got = client.receive("q", "c", max_events=op[1] if op[0] == "piece" else None)
            latest = got if got is not None else latest
        elif latest is not None:
            client.ack(latest)
            acked += [m.id for m in latest]
            latest = None
    if latest is not None:
        client.ack(latest)
        acked += [m.id for m in latest]
    client.tick("q")
    while (batch := client.receive("q", "c")) is not None:
        acked += [m.id for m in batch]
        client.ack(batch)
    assert acked == sent
