"""Review: attacks on the 0.2.0 shape (records, pgque.testing, the upgrade from the
0.1.0 baseline, docs vs code). Tests marked "Found in review" fail now and pass
once fixed; "Held" tests are probes that found nothing wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pgtest
import psycopg
import pytest
from helpers import scalar
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from test_install import install_0_1

import pgque
from pgque.testing import run_worker

ROOT = Path(__file__).resolve().parent.parent


def _role_dsn(dsn: str, role: str) -> str:
    return make_conninfo(**{**conninfo_to_dict(dsn), "user": role})


@pytest.fixture
def reader(dsn: str) -> Iterator[str]:
    """A login role with pgque_reader only (not an admin); yields its name."""
    role = f"pgque_rv_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_reader to {role}")
    yield role
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"drop role if exists {role}")


# -- non-admins and the slot view ---------------------------------------------------------


def test_a_group_owner_sees_its_own_slots_in_partition_slot_status(dsn: str, reader: str) -> None:
    """Found in review (medium): pgque.get_partition_slot_status() filters its rows with
    _may_use_consumer_name(q, consumer_name, role), but consumer_name there is the
    group's name ('g', no '#'), which that function only matches against a plain
    subscription of that name. So a role that is not an admin never sees any slot of
    any group, not even of the group it subscribed and owns (consumer_info shows it
    the same group's slot subscriptions). `pgque status` as that role shows no slots,
    no STALLED flag, no per-slot dead letters. Expected: the owner (and its
    grantees) see the group's slots, as docs/api.md "Changes" promises ("the info
    views show a role that is not an admin only the queues and consumers it may use")."""
    with pgque.connect(dsn) as admin:
        admin.create_queue("q")
    with pgque.connect(_role_dsn(dsn, reader)) as owner:
        owner.subscribe_slots("q", "g", slots=2)
        assert [c.consumer_name for c in owner.consumer_info("q")] == ["g#0/2", "g#1/2"]
        assert owner.claim_slot("q", "g", 0)
        rows = owner.partition_slot_status("q")
        assert [(r.consumer_name, r.slot) for r in rows] == [("g", 0), ("g", 1)]
        assert rows[0].owner_pid == owner.pinned_pid


def test_an_upgraded_0_1_group_is_in_partition_slot_status_for_readers(
        empty_dsn: str) -> None:
    """Found in review (medium), the same cause seen through the upgrade: "Consumers made
    by 0.1.0 have no owner and stay open to every reader" (docs/api.md, Changes). After
    the upgrade a plain reader may claim and read a 0.1 group's slots and sees the
    group's slot subscriptions in consumer_info, but partition_slot_status shows it
    none of them. Expected: the slots a reader may use are listed."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as admin:
        admin.create_queue("q")
        admin.subscribe_slots("q", "g", slots=2)
    role = f"pgque_rv_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_dsn, autocommit=True) as su:
        assert pgque.install(su) == "0.1.0"
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_reader to {role}")
    try:
        with pgque.connect(_role_dsn(empty_dsn, role)) as r:
            assert r.claim_slot("q", "g", 1)
            assert len(r.consumer_info("q")) == 2
            assert [(s.slot, s.owner_pid) for s in r.partition_slot_status("q")] == [
                (0, None), (1, r.pinned_pid)]
    finally:
        with psycopg.connect(empty_dsn, autocommit=True) as su:
            su.execute(f"drop role if exists {role}")


def test_run_worker_drains_for_a_role_that_is_not_an_admin(dsn: str, reader: str) -> None:
    """Found in review (medium): pgque.testing.run_worker decides "drained" from
    pgque.partition_slot_status read as the DSN's role. For a role that is not an admin
    that view is empty (see above), so `count(*) = slots` never holds: run_worker
    handles every event and then raises TimeoutError. A user testing a handler under
    the application's own role (pgque_reader, something else ticking, as
    docs/testing.md allows with ticker=False) cannot use run_worker's draining.
    Expected: it returns once the group is drained."""
    with pgque.connect(dsn) as admin:
        admin.create_queue("q")
    reader_dsn = _role_dsn(dsn, reader)
    with pgque.connect(reader_dsn) as owner:
        owner.subscribe_slots("q", "g", slots=2)
    with pgque.connect(dsn) as admin:
        admin.send_batch("q", [("e", {"n": n}, f"k{n}") for n in range(5)])
    with pgque.Ticker(dsn):
        run = run_worker(reader_dsn, queue="q", consumer="g", slots=2,
                         handler=lambda message: None, ticker=False, timeout=10)
    assert len(run.handled) == 5


# -- counts in the info views ----------------------------------------------------------------


def test_a_slots_dead_letter_count_is_that_of_its_subscription(dsn: str, reader: str) -> None:
    """Found in review (low): operations.md says partition_slot_status.dead_letters are
    "those of the slot's subscription", and dead letters follow their subscription id
    (dl_sub), not its name. The views count by name (dl_consumer = sub_consumer): a
    group unsubscribed and subscribed again shows the old group's dead letters on its
    new slot subscriptions, while dead_letters() gives its owner none of them (they
    are the admins' now). Expected: the count of the subscription's own dead letters,
    i.e. what its owner can list."""
    with pgque.connect(dsn) as admin:
        admin.create_queue("q", max_retries=0)
    with pgque.connect(_role_dsn(dsn, reader)) as owner, pgque.connect(dsn) as admin:
        owner.subscribe_slots("q", "g", slots=1)
        admin.send("q", "e", {}, partition_key="k")
        admin.tick("q")
        assert owner.claim_slot("q", "g", 0)
        batch = owner.receive_partitioned("q", "g", slot=0, slots=1)
        assert batch is not None
        owner.ack(batch, nack=[batch.messages[0]])
        assert len(owner.dead_letters("q")) == 1
        owner.release_slot("q", "g", 0)
        owner.unsubscribe_slots("q", "g")
        owner.subscribe_slots("q", "g", slots=1)
        assert owner.dead_letters("q") == []
        assert [c.dead_letters for c in owner.consumer_info("q")] == [0]
        assert [s.dead_letters for s in admin.partition_slot_status("q")] == [0]


# -- typed records ---------------------------------------------------------------------------


def test_an_infinite_interval_setting_is_not_reported_as_zero(
        client: pgque.Client, pg_server: pgtest.PgServer) -> None:
    """Found in review (low, PostgreSQL 17 and later): 'infinity' is an interval there,
    and _interval() accepts it (it is not below zero), so create_queue takes
    rotation_period='infinity'. QueueInfo.rotation_period then reads timedelta(0)
    (psycopg's reading of an infinite interval), the opposite of the setting, and
    queue_config() gives the string 'Infinity' where docs/api.md promises seconds;
    PostgreSQL 15 refuses the same call with InvalidConfig. Expected: refused with
    InvalidConfig on every version (or a record that does not claim zero)."""
    if pg_server.major_version < 17:
        pytest.skip("infinite intervals exist from PostgreSQL 17")
    try:
        client.create_queue("q", rotation_period="infinity")
    except pgque.InvalidConfig:
        return
    [info] = client.queue_info("q")
    assert info.rotation_period != timedelta(0)
    assert isinstance(client.queue_config("q")["rotation_period"], (int, float))


def test_cli_json_status_and_queue_list_are_the_records(dsn: str) -> None:
    """Held: `pgque status --json` is {ticker, queues, consumers, groups, slots}
    (ticker and groups since 0.3) with one object per
    record, the records' fields as keys, intervals as seconds, times as ISO 8601 and
    unset values null; `pgque queue list --json` is the QueueInfo list; a queue that
    is not there fails with exit code 1."""
    with pgque.connect(dsn) as client:
        client.create_queue("q")
        client.subscribe("q", "p")
        client.subscribe_slots("q", "g", slots=2)
        client.send("q", "e", {"a": 1}, partition_key="k")
    env = {**os.environ, "PGQUE_DSN": dsn, "PYTHONPATH": str(ROOT)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pgque.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    done = cli("status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert set(status) == {"ticker", "queues", "consumers", "groups", "slots"}
    assert [set(g) for g in status["groups"]] == [set(pgque.GroupInfo.__struct_fields__)]
    assert [set(q) for q in status["queues"]] == [set(pgque.QueueInfo.__struct_fields__)]
    assert {frozenset(c) for c in status["consumers"]} == {
        frozenset(pgque.ConsumerInfo.__struct_fields__)}
    assert [s["slot"] for s in status["slots"]] == [0, 1]
    assert set(status["slots"][0]) == set(pgque.SlotStatus.__struct_fields__)
    assert status["slots"][0]["owner_pid"] is None
    assert status["queues"][0]["rotation_period"] == 7200.0
    assert status["queues"][0]["events_since_last_tick"] == 1
    listed = cli("queue", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [q["queue_name"] for q in json.loads(listed.stdout)] == ["q"]
    missing = cli("status", "--json", "nope")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


# -- the upgrade from 0.1.0 ----------------------------------------------------------------


def test_upgrade_while_a_0_1_session_owns_a_slot_mid_batch(empty_dsn: str) -> None:
    """Held: a session that claimed slot 0 under 0.1 (its key was derived then) and holds
    half of its batch when the upgrade runs no longer owns the slot afterwards: its ack
    is refused (SlotNotOwned, G2), another session claims the slot at once and gets
    every event of the slot, the two the old owner had in hand among them; the old
    owner cannot take it back."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as setup:
        setup.create_queue("q")
        setup.subscribe_slots("q", "g", slots=2)
        sent = setup.send_batch("q", [("e", {"n": n}, f"k{n}") for n in range(20)])
        setup.tick("q")
        slot0 = {ev for n, ev in enumerate(sent)
                 if scalar(setup.conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)) == 0}
    with pgque.connect(empty_dsn) as old, pgque.connect(empty_dsn) as new:
        assert old.claim_slot("q", "g", 0)
        in_hand = old.receive_partitioned("q", "g", slot=0, slots=2, max_events=2)
        assert in_hand is not None and len(in_hand) == 2
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            assert pgque.install(conn) == "0.1.0"
        with pytest.raises(pgque.SlotNotOwned):
            old.ack(in_hand)
        assert new.claim_slot("q", "g", 0)
        got: list[int] = []
        while (batch := new.receive_partitioned("q", "g", slot=0, slots=2)):
            got.extend(m.id for m in batch)
            new.ack(batch)
        assert sorted(got) == sorted(slot0)
        assert not old.claim_slot("q", "g", 0)


def test_upgrade_keeps_retries_keys_nacks_and_replays_of_slots(empty_dsn: str) -> None:
    """Held: across the upgrade (migration 0003 drops ev_extra2..4 from retries and dead
    letters), a slot's waiting retry comes back to the same slot with its partition key
    and retry count; a nack of 0.1 in a still-open batch repeated after the upgrade
    changes nothing (batch_nack kept); a 0.1 dead letter of a slot, replayed, goes
    back to its slot with its key and payload."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as c:
        c.create_queue("q", max_retries=3)
        c.subscribe("q", "plain")
        c.subscribe_slots("q", "g", slots=2)
        key = next(f"k{n}" for n in range(100)
                   if scalar(c.conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)) == 0)
        c.send("q", "e", {"n": 1}, partition_key=key)
        c.tick("q")
        assert c.claim_slot("q", "g", 0)
        batch = c.receive_partitioned("q", "g", slot=0, slots=2)
        assert batch is not None
        retried = batch.messages[0].id
        c.ack(batch, nack=[retried], retry_after=3600)
        plain = c.receive("q", "plain")
        assert plain is not None
        assert c.nack(plain, plain.messages, retry_after=0) == 0
        c.create_queue("d", max_retries=0)
        c.subscribe_slots("d", "g", slots=2)
        c.send("d", "e", {"z": 1}, partition_key=key)
        c.tick("d")
        assert c.claim_slot("d", "g", 0)
        doomed = c.receive_partitioned("d", "g", slot=0, slots=2)
        assert doomed is not None
        c.ack(doomed, nack={doomed.messages[0].id: "boom"})
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.1.0"
        conn.execute("update pgque.retry_queue set ev_retry_after = now() - interval '1 s'")
    with pgque.connect(empty_dsn) as c:
        assert c.nack(plain, plain.messages, retry_after=0) == 0
        c.ack(plain)
        assert scalar(c.conn, "select count(*) from pgque.retry_queue") == 2
        c.maintenance()
        c.tick("q")
        assert c.claim_slot("q", "g", 0)
        batch = c.receive_partitioned("q", "g", slot=0, slots=2)
        assert batch is not None
        assert [(m.id, m.partition_key, m.retry_count) for m in batch] == [(retried, key, 1)]
        c.ack(batch)
        [letter] = c.dead_letters("d")
        assert letter.partition_key == key and letter.reason == "boom"
        event = c.replay_dead_letter("d", letter.id)
        c.tick("d")
        assert c.claim_slot("d", "g", 0)
        batch = c.receive_partitioned("d", "g", slot=0, slots=2)
        assert batch is not None
        assert [(m.id, m.partition_key, m.retry_count, m.payload) for m in batch] == [
            (event, key, 0, {"z": 1})]


UPGRADE_CATALOG = {
    "types": """
        select t.typname, t.typtype, t.typacl::text,
               (select string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod),
                                  ', ' order by a.attnum)
                  from pg_attribute a
                 where a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped)
          from pg_type t where t.typnamespace = 'pgque'::regnamespace order by 1""",
    "attributes": """
        select c.relname, a.attnum, a.attname, a.attstattarget, a.attstorage,
               a.attidentity, a.attgenerated, a.attislocal, a.attinhcount, a.attcollation
          from pg_attribute a join pg_class c on c.oid = a.attrelid
         where c.relnamespace = 'pgque'::regnamespace and a.attnum > 0 and not a.attisdropped
         order by 1, 2""",
    "classes": """
        select relname, relkind, relpersistence, relreplident, relrowsecurity,
               relowner::regrole::text
          from pg_class where relnamespace = 'pgque'::regnamespace order by 1""",
    "sequences": """
        select c.relname, s.seqtypid::regtype::text, s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle
          from pg_sequence s join pg_class c on c.oid = s.seqrelid
         where c.relnamespace = 'pgque'::regnamespace order by 1""",
    "inherits": """
        select inhrelid::regclass::text, inhparent::regclass::text, inhseqno
          from pg_inherits i join pg_class c on c.oid = i.inhrelid
         where c.relnamespace = 'pgque'::regnamespace order by 1""",
    "routines": """
        select oid::regprocedure::text, proowner::regrole::text, provolatile, proparallel,
               prosecdef, proisstrict, procost, prorows, proconfig::text, proacl::text
          from pg_proc where pronamespace = 'pgque'::regnamespace order by 1""",
    "one-row tables": """
        select (select count(*) from pgque.installed), (select count(*) from pgque.install_lock),
               (select count(*) from pgque.ticker_election),
               (select count(*) from pgque.queue_lock)""",
}


def test_upgraded_catalog_equals_a_fresh_one_beyond_tests_install_catalog(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """Held: with two queues (one of 5 tables) and a group, the upgraded database and a
    fresh install agree on what tests/test_install.py's catalog() does not compare:
    composite and row types, column storage, identity and inheritance, sequence
    parameters, routine volatility, cost and parallel safety, one-row tables. (Only
    dropped columns differ: migration 0003 leaves ev_extra2..4 as dropped columns in
    the upgraded event tables, as PostgreSQL does; nothing reads them.)"""
    def setup(client: pgque.Client) -> None:
        client.create_queue("q", max_retries=1)
        client.create_queue("r", event_tables=5)
        client.subscribe("q", "p")
        client.subscribe_slots("q", "g", slots=2)

    def catalog(dsn: str) -> dict[str, list[Any]]:
        with psycopg.connect(dsn) as conn:
            return {k: conn.execute(q).fetchall() for k, q in UPGRADE_CATALOG.items()}

    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        setup(client)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        pgque.install(conn)
    upgraded = catalog(empty_dsn)
    with pg_server.scratch_database(prefix="pgque_test_empty") as fresh_dsn:
        with pgque.connect(fresh_dsn) as fresh:
            fresh.install()
            setup(fresh)
        installed = catalog(fresh_dsn)
    for name in UPGRADE_CATALOG:
        assert upgraded[name] == installed[name], f"{name} differs after the upgrade"


def test_an_older_package_does_not_silently_downgrade_a_newer_install(
        empty_dsn: str) -> None:
    """Found in review (low): the newer-schema guard looks at migration numbers only. A
    database installed by a newer pgque that added no migration (a patch release: code
    only, pgque.installed says e.g. 0.3.0) is overwritten by an older package's code
    without a word, and `pgque install` reports it as "pgque upgraded from 0.3.0 to
    0.2.0". Expected: refused like a newer migration (NewerSchema, PQ018: "never run an
    older pgque's install over a newer one's", operations.md), or at the least not
    called an upgrade."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.conn.execute("update pgque.installed set in_version = '0.3.0'")
    env = {**os.environ, "PGQUE_DSN": empty_dsn, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pgque.cli", "install"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "upgraded from 0.3.0" not in done.stdout
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert scalar(conn, "select in_version from pgque.installed") == "0.3.0"


# -- docs vs code ----------------------------------------------------------------------------


def test_documented_sql_argument_names_work_in_named_notation(client: pgque.Client) -> None:
    """Found in review (low): docs/api.md gives every SQL function's arguments by name
    (`create_queue(queue text, config jsonb default '{}', exist_ok boolean default
    false)`, `dead_letters(queue text, consumer text default null, limit integer default
    100, after_id bigint default 0)`, `nack(..., retry_after interval default '0',
    reason text default null)`), but the functions name them p_queue, p_exist_ok,
    p_after_id, ...: a SQL user who skips a default by name, e.g.
    `pgque.create_queue('q', exist_ok => true)`, gets "function does not exist".
    Expected: the documented names work (or the docs give the real ones).
    Fixed in the docs: they say the names carry a p_ prefix in named notation, and
    every documented argument name, so prefixed, is the function's."""
    conn = client.conn
    api = (ROOT / "docs" / "api.md").read_text("utf-8")
    assert "p_exist_ok => true" in api
    assert scalar(conn, "select pgque.create_queue('q', p_exist_ok => true)") > 0
    assert scalar(conn, "select count(*) from pgque.dead_letters('q', p_after_id => 0)") == 0
    sql = api[api.index("## SQL"):]
    checked = 0
    for name, args in re.findall(r"^\| `(\w+)\(([^)]*)\)", sql, re.M):
        documented = {f"p_{a.split()[0]}" for a in args.split(",")
                      if a.strip() and not a.strip().startswith("out ")}
        real = {n for (names,) in conn.execute(
                    "select proargnames from pg_proc where pronamespace = 'pgque'::regnamespace "
                    "and proname = %s", (name,)) for n in (names or [])}
        assert documented <= real, (name, documented - real)
        checked += 1
    assert checked > 40


def test_readme_does_not_deny_the_upgrade_path() -> None:
    """Found in review (low): README.md's costs still say "Young. This is 0.1: no migration
    path between versions yet", while the release is 0.2.0 and its point is an
    in-place upgrade path (operations.md "Upgrades"). Expected: the README states the
    version and that upgrades exist."""
    readme = (ROOT / "README.md").read_text("utf-8")
    assert "no migration path" not in readme
    assert "This is 0.1" not in readme
