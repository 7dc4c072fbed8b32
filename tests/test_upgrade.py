"""Upgrades: numbered migrations over every catalog a released version left (the
0.1.0s of 3bd2224 and 09e6af5, the 0.2.0 that landed as 2f0bb29, and a 0.1.0 that
0.2.0 upgraded, also by a database owner who is no superuser), code recreated,
and nothing lost on the way, with odd state, an upgrade killed mid-way, or the
migration record tampered with (pgque/schema.py, pgque/sql/)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pgtest
import psycopg
import pytest
from helpers import (
    BASELINE_0_2,
    BASELINE_0_3,
    BASELINE_0_4,
    BASELINE_0_5,
    BASELINE_0_6,
    BASELINE_0_7,
    BASELINE_0_8,
    BASELINE_0_9,
    BASELINE_0_10,
    BASELINE_0_11,
    BASELINES_0_1,
    catalog,
    drain,
    install_0_1,
    install_0_2,
    install_0_3,
    install_0_4,
    install_0_5,
    install_0_6,
    install_0_7,
    install_0_8,
    install_0_9,
    install_0_10,
    install_0_11,
    install_0_12,
    install_0_13,
    run_cli,
    scalar,
    scratch_database,
    wait_for,
)
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque
from pgque._script import Migration, _wrapped, migrations
from pgque.testing import Deployment

# The migrations the landed 0.2.0 had, and so recorded as applied by "0.2.0".
MIGRATIONS_0_2 = range(1, 6)
MIGRATIONS_0_3 = 6  # the last migration 0.3.0 had
MIGRATIONS_0_4 = 6  # and 0.4.0
MIGRATIONS_0_5 = 7  # and 0.5.0
MIGRATIONS_0_6 = 8  # and 0.6.0
MIGRATIONS_0_7 = 9  # and 0.7.0
MIGRATIONS_0_8 = 9  # and 0.8.0
MIGRATIONS_0_9 = 10  # and 0.9.0
MIGRATIONS_0_10 = 11  # and 0.10.0
MIGRATIONS_0_11 = 11  # and 0.11.0
MIGRATIONS_0_12 = 12  # and 0.12.0, 0.13.0


def migration_record(conn: psycopg.Connection[Any]) -> list[tuple[int, str]]:
    """pgque.migration as (number, the version that applied it), in order."""
    return [(n, package) for n, package in conn.execute(
        "select mig_number, mig_package from pgque.migration order by 1")]


def applied(by_0_2: range) -> list[tuple[int, str]]:
    """Every migration, recorded as applied by 0.2.0 when in by_0_2, else by this
    pgque."""
    return [(m.number, "0.2.0" if m.number in by_0_2 else pgque.__version__)
            for m in migrations()]


def pg_dump_schema(server: pgtest.PgServer, dsn: str) -> str | None:
    """pg_dump --schema-only of schema pgque, or None without a pg_dump of the
    server's binaries."""
    postgres = getattr(server, "postgres", None)
    binary = Path(postgres.bindir) / "pg_dump" if postgres is not None else None
    if binary is None or not binary.exists():
        return None
    out = subprocess.run([str(binary), "--schema-only", "--schema=pgque", "--no-owner",
                          "--dbname", dsn], check=True, capture_output=True, text=True)
    # Comments, and pg_dump 18's \restrict lines with their random key, differ
    # between any two dumps.
    return "\n".join(line for line in out.stdout.splitlines()
                     if not line.startswith(("--", "\\restrict", "\\unrestrict")))


def fill_0_1(dsn: str) -> dict[str, Any]:
    """Use a 0.1.0 install the way an application does, leaving state of every
    kind behind: an open batch half handed out, a retry waiting, a dead letter,
    a slot never read, events not ticked yet. Returns what was sent and seen.

    Through the SQL functions both 0.1.0s have, on one session (it holds the
    slot's lock): today's client calls functions the first 0.1.0 lacks."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        def ids(sql: str, *params: Any) -> list[int]:
            return [row[0] for row in conn.execute(sql, params)]

        def send(numbers: range) -> list[int]:
            return ids("select unnest(pgque.send_batch('q', %s, %s, %s))",
                       ["e"] * len(numbers), [f'{{"n": {n}}}' for n in numbers],
                       [f"k{n}" for n in numbers])

        def batch(rows: list[tuple[Any, ...]]) -> tuple[int, list[int]]:
            assert rows, "no batch"
            return rows[0][0], [row[1] for row in rows]

        conn.execute("""select pgque.create_queue('q', '{"max_retries": 1}'),
                               pgque.subscribe('q', 'plain'),
                               pgque.subscribe_slots('q', 'g', 2)""")
        first = send(range(10))
        conn.execute("select pgque.tick('q')")
        # plain: 4 of the 10 handed out and acked, one of them nacked: a retry.
        plain, handed = batch(conn.execute(
            "select batch_id, ev_id from pgque.receive('q', 'plain', 4)").fetchall())
        assert len(handed) == 4
        conn.execute("select pgque.nack('q', 'plain', %s, %s), pgque.ack('q', 'plain', %s)",
                     (plain, handed[:1], plain))
        # slot 0 of the group: one event fails twice and is dead-lettered.
        assert scalar(conn, "select pgque.claim_slot('q', 'g', 0)")
        receive_slot0 = "select batch_id, ev_id from pgque.receive_partitioned('q', 'g', 0, 2)"
        fail_slot0 = ("select pgque.nack_partitioned('q', 'g', 0, 2, %s, %s, '0', %s), "
                      "pgque.ack_partitioned('q', 'g', 0, 2, %s)")
        slot_batch, events = batch(conn.execute(receive_slot0).fetchall())
        doomed = events[0]
        conn.execute(fail_slot0, (slot_batch, [doomed], None, slot_batch))
        conn.execute("select pgque.maint()")
        conn.execute("select pgque.tick('q')")
        slot_batch, events = batch(conn.execute(receive_slot0).fetchall())
        assert events == [doomed]
        conn.execute(fail_slot0, (slot_batch, [doomed], "failed twice", slot_batch))
        slot0 = {ev for n, ev in enumerate(first)
                 if scalar(conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)) == 0}
        # Sent after the last tick: not in any batch yet.
        later = send(range(10, 15))
        dead = conn.execute("select dl_id, consumer, ev_id, reason "
                            "from pgque.dead_letters('q')").fetchall()
        assert [d[2:] for d in dead] == [(doomed, "failed twice")]
        return {"first": first, "later": later, "handed": handed, "retried": handed[0],
                "slot0": slot0, "doomed": doomed, "dead": dead, "queues": ["q"]}


def fill_0_2(dsn: str) -> dict[str, Any]:
    """fill_0_1's state, made by the landed 0.2.0, and what only 0.2 has: a
    second group's epochs in pgque.slot_claim (slot 0's left to a session that
    ended while it held the slot, slot 1's released), a second queue with a
    send grant and an event waiting. Returns what fill_0_1 does, the later
    events including those sent here, and the 0.2 state.

    Through 0.2.0's SQL functions, as fill_0_1: today's client may call
    functions, or signatures, that 0.2.0 lacks."""
    seen = fill_0_1(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("""select pgque.subscribe_slots('q', 'h', 2),
                               pgque.create_queue('q2', '{}'), pgque.subscribe('q2', 'c'),
                               pgque.grant_queue('q2', 'pgque_writer', 'send')""")
        more = [row[0] for row in conn.execute(
            "select unnest(pgque.send_batch('q', %s, %s, %s))",
            (["e"] * 5, [f'{{"n": {n}}}' for n in range(15, 20)],
             [f"k{n}" for n in range(15, 20)]))]
        conn.execute("select pgque.tick('q')")
        # Each slot of h takes an epoch with its first receive, and acks what it got:
        # fill_0_1's later events and these.
        epochs: dict[str, int] = {}
        for slot in (0, 1):
            assert scalar(conn, "select pgque.claim_slot('q', 'h', %s)", (slot,))
            rows = conn.execute("select batch_id, epoch from pgque.receive_partitioned("
                                "'q', 'h', %s, 2)", (slot,)).fetchall()
            assert rows, f"nothing for slot {slot} of h"
            conn.execute("select pgque.ack_partitioned('q', 'h', %s, 2, %s)",
                         (slot, rows[0][0]))
            epochs[f"h#{slot}/2"] = rows[0][1]
        assert scalar(conn, "select pgque.release_slot('q', 'h', 1)")
        waiting = scalar(conn, """select pgque.send('q2', 'e', '"waiting"'::jsonb)""")
        claims = conn.execute("""
            select s.sub_consumer, c.sc_epoch, c.sc_pid is not null
              from pgque.slot_claim c join pgque.subscription s on s.sub_id = c.sc_sub
             order by 1""").fetchall()
    # g's slot 0 took an epoch in fill_0_1; h's slot 1 is released, slot 0 not.
    assert [name for name, _, _ in claims] == ["g#0/2", "h#0/2", "h#1/2"]
    assert [(name, epoch) for name, epoch, _ in claims[1:]] == sorted(epochs.items())
    assert [held for _, _, held in claims] == [True, True, False]
    return {**seen, "later": seen["later"] + more, "queues": [*seen["queues"], "q2"],
            "epochs": {name: epoch for name, epoch, _ in claims}, "waiting": waiting}


def check_upgraded(dsn: str, pg_server: pgtest.PgServer, seen: dict[str, Any]) -> None:
    """After the upgrade of a database fill_0_1 (or fill_0_2) filled: nothing it
    left is lost or delivered twice, a send-receive-nack-ack cycle works, and the
    catalog and pg_dump are those of a fresh install with the same queues."""
    everything = set(seen["first"]) | set(seen["later"])
    with pgque.connect(dsn) as client:
        assert scalar(client.conn, "select pgque.version()") == pgque.__version__
        # Every dead letter is still there, as it was.
        assert [(d.id, d.consumer, d.event_id, d.reason)
                for d in client.dead_letters("q")] == seen["dead"]
        # The plain consumer gets the rest of its open batch, the retry and the
        # later events: with the 4 it had, every event, and the nacked one twice.
        client.maintenance()
        rest = [m.id for m in drain(client, "q", "plain")]
        assert set(rest) | set(seen["handed"]) == everything
        assert seen["retried"] in rest
        # The group: slot 1 was never read and gets all its events; slot 0 gets the
        # later ones of its keys. Nothing is lost, the dead letter is not redelivered.
        got: list[int] = []
        for slot in (0, 1):
            assert client.claim_slot("q", "g", slot)
            while (batch := client.receive_partitioned("q", "g", slot=slot, slots=2)):
                got.extend(m.id for m in batch)
                client.ack(batch)
        # Slot 0 had consumed its events of the first ten (the dead letter among
        # them); the rest is delivered exactly once.
        assert sorted(got) == sorted(everything - seen["slot0"])
        # A send-receive-nack-ack cycle, by the plain consumer (nack, then ack) and
        # by a slot (ack with the nack): each nack is one retry, delivered once more.
        sent = client.send("q", "e", {"n": "after"}, partition_key="k0")
        slot = scalar(client.conn, "select pgque.slot_of('k0', 2)")
        client.tick("q")
        plain = client.receive("q", "plain")
        assert plain is not None and [m.id for m in plain] == [sent]
        client.nack(plain, plain.messages)
        client.ack(plain)
        group = client.receive_partitioned("q", "g", slot=slot, slots=2)
        assert group is not None and [m.id for m in group] == [sent]
        client.ack(group, nack=group.messages)
        assert ("q", "retry", 2) in client.maintenance()
        assert [(m.id, m.retry_count) for m in drain(client, "q", "plain")] == [(sent, 1)]
        group = client.receive_partitioned("q", "g", slot=slot, slots=2)
        assert group is not None and [(m.id, m.retry_count) for m in group] == [(sent, 1)]
        client.ack(group)
        assert len(client.dead_letters("q")) == len(seen["dead"])
        # The ticker election and the new locks work on the old queue.
        assert client.claim_ticker()
        assert client.ticker() >= 0
        upgraded = catalog(client.conn)
    upgraded_dump = pg_dump_schema(pg_server, dsn)

    with scratch_database(pg_server) as fresh_dsn, pgque.connect(fresh_dsn) as fresh:
        fresh.install()
        fresh.create_queue("q", max_retries=1)
        for name in seen["queues"][1:]:
            fresh.create_queue(name)
        # The same group: its slot count gives the event tables an index.
        fresh.subscribe_slots("q", "g", slots=2)
        fresh.maintenance()
        installed = catalog(fresh.conn)
        fresh_dump = pg_dump_schema(pg_server, fresh_dsn)
    for name in upgraded:
        assert upgraded[name] == installed[name], f"{name} differs after the upgrade"
    # The same dump (a cluster of our own always has its pg_dump).
    assert upgraded_dump is not None or not isinstance(pg_server, pgtest.LocalServer)
    assert upgraded_dump == fresh_dump


@pytest.mark.parametrize("commit", BASELINES_0_1)
def test_upgrade_from_0_1_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer, commit: str) -> None:
    install_0_1(empty_dsn, commit)
    seen = fill_0_1(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.1.0"
        # Migration 1 ran too: it created what this 0.1.0 lacked.
        assert migration_record(conn) == applied(by_0_2=range(0))
    check_upgraded(empty_dsn, pg_server, seen)


@pytest.mark.parametrize("commit", BASELINES_0_1)
def test_upgrade_repairs_a_0_1_0_that_the_landed_0_2_0_upgraded(
        empty_dsn: str, pg_server: pgtest.PgServer, commit: str) -> None:
    """The landed 0.2.0 recorded a 0.1.0's tables as migration 1, applied by
    "0.1.0", without running it: over 3bd2224 pgque.batch_nack was never made,
    and that 0.2.0's nack and maint() fail. Today's install runs migration 1
    again there (see guard.sql), and the database is a fresh install's."""
    install_0_1(empty_dsn, commit)
    seen = fill_0_1(empty_dsn)
    install_0_2(empty_dsn)
    with psycopg.connect(empty_dsn) as conn:  # each check rolled back
        assert migration_record(conn) == [(1, "0.1.0"),
                                          *((n, "0.2.0") for n in MIGRATIONS_0_2[1:])]
        if commit == "3bd2224":
            assert scalar(conn, "select pg_catalog.to_regclass('pgque.batch_nack')") is None
            row = conn.execute("select batch_id, ev_id from pgque.receive('q', 'plain', 1)"
                               ).fetchone()
            assert row is not None
            with pytest.raises(psycopg.errors.UndefinedTable, match="batch_nack"):
                conn.execute("select pgque.nack('q', 'plain', %s, %s)", (row[0], [row[1]]))
            conn.rollback()
            with pytest.raises(psycopg.errors.UndefinedTable, match="batch_nack"):
                conn.execute("select pgque.maint()")
            conn.rollback()
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.2.0"
        # Migration 1 ran again, and is recorded as this pgque's.
        assert migration_record(conn) == applied(by_0_2=range(2, 6))
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_3_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.3.0 (its generated code written in place, its readers of
    fifteen arguments) filled as 0.2.0 was: the upgrade keeps every event,
    cursor, epoch and dead letter, and its code, generated code included, is a
    fresh install's."""
    install_0_3(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.3.0"
        assert migration_record(conn) == [
            (m.number, "0.3.0" if m.number <= MIGRATIONS_0_3 else pgque.__version__)
            for m in migrations()]
        assert conn.execute("select kind, current from pgque.generated_code"
                            " where not current").fetchall() == []
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_2_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    install_0_2(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.2.0"
        assert migration_record(conn) == applied(by_0_2=MIGRATIONS_0_2)
        # The epochs stay; nobody holds their keys (0.2 took none).
        assert conn.execute("""
            select s.sub_consumer, c.sc_epoch
              from pgque.slot_claim c join pgque.subscription s on s.sub_id = c.sc_sub
             order by 1""").fetchall() == list(seen["epochs"].items())
    check_upgraded(empty_dsn, pg_server, seen)
    with pgque.connect(empty_dsn) as client:
        # The second queue: its grant and its waiting event.
        assert client.queue_grants("q2") == [("send", "pgque_writer")]
        assert [m.id for m in drain(client, "q2", "c")] == [seen["waiting"]]
        # An old epoch fences nothing in; the slot's next owner takes a later one.
        old = pgque.Fence("q", "h", 0, seen["epochs"]["h#0/2"])
        with pytest.raises(pgque.StaleEpoch):
            client.check_fence(old)
        key = next(f"k{n}" for n in range(20)
                   if scalar(client.conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)) == 0)
        sent = client.send("q", "e", {"n": "fenced"}, partition_key=key)
        client.tick("q")
        assert client.claim_slot("q", "h", 0)
        batch = client.receive_partitioned("q", "h", slot=0, slots=2)
        assert batch is not None and batch.fence is not None
        assert sent in [m.id for m in batch]
        assert batch.fence.epoch > max(seen["epochs"].values())
        client.check_fence(batch.fence)
        client.ack(batch)


def test_install_refuses_a_database_a_newer_pgque_migrated(empty_dsn: str) -> None:
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.create_queue("q")
        client.conn.execute("insert into pgque.migration (mig_number, mig_name, mig_package) "
                            "values (999, 'from_the_future', '9.0.0')")
        before = catalog(client.conn)
        with pytest.raises(pgque.NewerSchema, match=r"9\.0\.0"):
            client.install()
        assert catalog(client.conn) == before
        assert client.send("q", "e", 1) > 0


def test_each_migration_is_applied_once_and_recorded(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) is None
        applied = conn.execute("select mig_number, mig_name, mig_applied from pgque.migration "
                               "order by 1").fetchall()
        assert [(n, name) for n, name, _ in applied] == [(m.number, m.name)
                                                          for m in migrations()]
        assert pgque.install(conn) == pgque.__version__
        assert conn.execute("select mig_number, mig_name, mig_applied from pgque.migration "
                            "order by 1").fetchall() == applied


def test_the_cli_says_from_which_version_to_which(empty_dsn: str) -> None:
    install_0_1(empty_dsn)
    out = run_cli("install", "--dsn", empty_dsn)
    assert (out.returncode, out.stdout) == (
        0, f"pgque upgraded from 0.1.0 to {pgque.__version__}\n")


@pytest.mark.superuser_install  # it installs again as the superuser
def test_workers_keep_going_while_the_install_replaces_the_code(dsn: str) -> None:
    """Every install drops and recreates the functions the workers call: a running
    Worker and Ticker ride through repeated installs and deliver every event."""
    handled: set[int] = set()
    with pgque.connect(dsn) as client:
        client.create_queue("q", ticker_max_lag=0)
        worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2,
                              handler=lambda m: handled.add(m.id), rebalance_interval=0.1)
        with worker:
            wait_for(lambda: len(worker.owned_slots) == 2, what="the worker to own its slots")
            sent: list[int] = []
            for _ in range(5):
                sent += client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
                with psycopg.connect(dsn, autocommit=True) as conn:
                    assert pgque.install(conn) == pgque.__version__
            wait_for(lambda: handled >= set(sent), timeout=30, what="every event handled")
            assert worker.alive and worker.error is None


# -- upgrades by the database owner, used by a team --------------------------------------------


@pytest.fixture
def deployment(pgque_deployment: Deployment) -> Deployment:
    return pgque_deployment


def owned_database(deployment: Deployment, tag: str) -> Deployment:
    """The deployment pointed at a new database of its owner, without pgque."""
    name = f"{deployment.prefix}_{tag}_{uuid.uuid4().hex[:6]}"
    with deployment.server.admin() as su:
        su.execute(sql.SQL("create database {} owner {} template template0").format(
            sql.Identifier(name), sql.Identifier(deployment.owner)))
    return replace(deployment, dbname=name)


def test_upgrade_from_0_4_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.4.0 (the cursor log and the ticks plain tables, old rows
    deleted by maintenance) filled as 0.2.0 was: migration 7 makes them the
    first partitions of the rotating tables, and every event, cursor, epoch and
    dead letter is kept; the result is a fresh install."""
    install_0_4(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.4.0"
        assert migration_record(conn) == [
            (m.number, "0.4.0" if m.number <= MIGRATIONS_0_4 else pgque.__version__)
            for m in migrations()]
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_5_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.5.0 filled as 0.2.0 was: migration 8 adds the failure
    policy's columns and tables, every event, cursor, epoch and dead letter is
    kept, the groups keep the skip policy, and the result is a fresh install."""
    install_0_5(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.5.0"
        assert migration_record(conn) == [
            (m.number, "0.5.0" if m.number <= MIGRATIONS_0_5 else pgque.__version__)
            for m in migrations()]
        assert {row[0] for row in conn.execute("select cg_policy from pgque.consumer_group")} \
            == {"skip"}
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_6_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.6.0 filled as 0.2.0 was: migration 9 adds the delayed events,
    the idempotency keys and the queues' idempotency window, every event, cursor,
    epoch and dead letter is kept, and the result is a fresh install."""
    install_0_6(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.6.0"
        assert migration_record(conn) == [
            (m.number, "0.6.0" if m.number <= MIGRATIONS_0_6 else pgque.__version__)
            for m in migrations()]
        assert {row[0] for row in conn.execute(
            "select pgque.queue_config(queue_name)->>'idempotency_window' from pgque.queue")} \
            == {"86400.000000"}
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_7_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.7.0 filled as 0.2.0 was: no migration since (0.8.0 changed
    code only: receive_slots' set-based path and its ahead column), every
    event, cursor, epoch and dead letter is kept, and the result is a fresh
    install."""
    install_0_7(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.7.0"
        assert migration_record(conn) == [
            (m.number, "0.7.0" if m.number <= MIGRATIONS_0_7 else pgque.__version__)
            for m in migrations()]
        assert "ahead" in {row[0] for row in conn.execute(
            "select unnest(proargnames) from pg_proc where proname = 'receive_slots'")}
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_8_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """0.8.0 filled as 0.2.0 was: migration 10 gives every queue its ticker
    flag, off (the ticker awake), every event, cursor, epoch and dead letter
    is kept, and the result is a fresh install."""
    install_0_8(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.8.0"
        assert migration_record(conn) == [
            (m.number, "0.8.0" if m.number <= MIGRATIONS_0_8 else pgque.__version__)
            for m in migrations()]
        assert {row[0] for row in conn.execute(
            "select queue_ticker_asleep from pgque.queue")} == {False}
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_9_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.9.0 filled as 0.2.0 was: migration 11 leaves every tick made
    before it unsettled and without a settle bound (probed, as before, until its
    queue's next tick), every event, cursor, epoch and dead letter is kept, and
    the result is a fresh install."""
    install_0_9(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.9.0"
        assert migration_record(conn) == [
            (m.number, "0.9.0" if m.number <= MIGRATIONS_0_9 else pgque.__version__)
            for m in migrations()]
        assert conn.execute("select distinct tick_settled, tick_settle_xid is null"
                            " from pgque.tick").fetchall() == [(False, True)]
    check_upgraded(empty_dsn, pg_server, seen)


def test_a_ticker_of_this_version_ticks_a_database_still_at_0_9_0(empty_dsn: str) -> None:
    """Before its database is upgraded, a Ticker of this version meets a pgque
    that cannot tick queues by id nor let them sleep one by one (0.9): it clears
    the marks a 0.9 ticker left, polls every queue, and every send is ticked."""
    install_0_9(empty_dsn)
    with pgque.connect(empty_dsn, pool_size=0) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        # A 0.9 ticker gone away asleep: its marks would make every send notify
        # nobody; the new ticker clears them first.
        with psycopg.connect(empty_dsn, autocommit=True) as gone:
            assert scalar(gone, "select pgque.claim_ticker()")
            assert scalar(gone, "select pgque.ticker_sleep()") == 1
        with pgque.Ticker(empty_dsn, idle_after=0.2) as ticker:
            assert ticker.wait_active(10)
            wait_for(lambda: not scalar(client.conn, "select bool_or(queue_ticker_asleep)"
                                                     " from pgque.queue"),
                     what="the marks cleared", timeout=10)
            for n in range(3):
                sent = client.send("q", "e", n)
                batch = wait_for(lambda: client.receive("q", "c"), what="the event", timeout=10)
                assert [m.id for m in batch] == [sent]
                client.ack(batch)
            assert ticker.error is None
        assert scalar(client.conn, "select pgque.version()") == "0.9.0"


def test_upgrade_from_0_10_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.10.0 filled as 0.2.0 was: no migration since, its batch
    readers (arrays then, rows now) written again, every event, cursor, epoch and
    dead letter kept, and the result is a fresh install."""
    install_0_10(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.10.0"
        assert migration_record(conn) == [
            (m.number, "0.10.0" if m.number <= MIGRATIONS_0_10 else pgque.__version__)
            for m in migrations()]
        assert scalar(conn, "select bool_and(pg_get_function_result(p.oid)"
                            "                = 'SETOF pgque.event_template')"
                            " from pg_proc p where p.pronamespace = 'pgque'::regnamespace"
                            "   and p.proname ~ '^_batch_reader_[0-9]+$'")
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_11_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.11.0 filled as 0.2.0 was: migration 12 (the record of handler
    calls) applied, every event, cursor, epoch and dead letter kept, and the
    result is a fresh install; its groups start without a record."""
    install_0_11(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.11.0"
        assert migration_record(conn) == [
            (m.number, "0.11.0" if m.number <= MIGRATIONS_0_11 else pgque.__version__)
            for m in migrations()]
        assert scalar(conn, "select count(*) from pgque.consumer_group"
                            " where cg_recorded_since is not null") == 0
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_12_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """The landed 0.12.0 filled as 0.2.0 was: no migration to apply, the code
    replaced (the exporter's pgque.metrics and slot_skew are new), every event,
    cursor, epoch and dead letter kept, and the result is a fresh install."""
    install_0_12(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert scalar(conn, "select count(*) from pg_proc where proname = 'metrics'"
                            " and pronamespace = 'pgque'::regnamespace") == 0
        assert pgque.install(conn) == "0.12.0"
        assert migration_record(conn) == [
            (m.number, "0.12.0" if m.number <= MIGRATIONS_0_12 else pgque.__version__)
            for m in migrations()]
        assert scalar(conn, "select pgque.version()") == pgque.__version__
    check_upgraded(empty_dsn, pg_server, seen)


def test_upgrade_from_0_13_0_adds_leases_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """0.13.0 (given its number, never landed) filled as 0.2.0 was: migration 13
    (leases) applied, every group still owning by advisory lock, and the result
    is a fresh install."""
    install_0_13(empty_dsn)
    seen = fill_0_2(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.13.0"
        assert migration_record(conn) == [
            (m.number, "0.13.0" if m.number <= MIGRATIONS_0_12 else pgque.__version__)
            for m in migrations()]
        assert scalar(conn, "select count(*) from pgque.consumer_group"
                            " where cg_lease is not null") == 0
    check_upgraded(empty_dsn, pg_server, seen)


def test_a_client_of_this_version_drains_a_database_still_at_0_10_0(empty_dsn: str) -> None:
    """Before its database is upgraded, a Client and Ticker of this version work
    a 0.10 pgque (batch readers that return arrays): every event once, in order."""
    install_0_10(empty_dsn)
    with pgque.connect(empty_dsn, pool_size=0) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        with pgque.Ticker(empty_dsn) as ticker:
            assert ticker.wait_active(10)
            sent = client.send_batch("q", [("e", n, f"k{n % 3}") for n in range(50)])
            got: list[int] = []
            while len(got) < len(sent):
                batch = wait_for(lambda: client.receive("q", "c"), what="a batch", timeout=10)
                got += [m.id for m in batch]
                client.ack(batch)
            assert got == sent
            assert ticker.error is None
        assert scalar(client.conn, "select pgque.version()") == "0.10.0"


def run_script(dsn: str, script: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(script.read_bytes())


RELEASES = {
    "0.11.0": [BASELINE_0_11],
    "0.10.0": [BASELINE_0_10],
    "0.9.0": [BASELINE_0_9],
    "0.8.0": [BASELINE_0_8],
    "0.7.0": [BASELINE_0_7],
    "0.6.0": [BASELINE_0_6],
    "0.5.0": [BASELINE_0_5],
    "0.4.0": [BASELINE_0_4],
    "0.3.0": [BASELINE_0_3],
    "0.2.0-then-0.3.0": [BASELINE_0_2, BASELINE_0_3],
    "0.2.0": [BASELINE_0_2],
    "0.1.0-09e6af5": [BASELINES_0_1["09e6af5"]],
    "0.1.0-3bd2224-then-0.2.0": [BASELINES_0_1["3bd2224"], BASELINE_0_2],
}


@pytest.mark.parametrize("release", list(RELEASES))
def test_the_owner_upgrades_every_release_and_the_team_fences_and_nacks_after(
        deployment: Deployment, release: str) -> None:
    """Each frozen release installed by the database owner (no superuser), used by a
    team's login (a group, a dead letter), then upgraded by the owner: the catalog
    equals the owner's fresh install, the team's fences pass, a nack comes back as a
    retry, and the team lists its dead letter."""
    old, fresh = owned_database(deployment, "old"), owned_database(deployment, "new")
    billing = deployment.teams[0]
    try:
        first, *later = RELEASES[release]
        run_script(old.dsn(deployment.owner), first)
        with psycopg.connect(old.dsn(deployment.owner), autocommit=True) as conn:
            conn.execute("select pgque.create_queue('q', '{\"max_retries\": 0}')")
        with psycopg.connect(old.dsn(old.login(billing)), autocommit=True) as conn:
            conn.execute(f"set role {billing}")
            conn.execute("select pgque.subscribe_slots('q', 'g', 2)")
            conn.execute("reset role")
            with psycopg.connect(old.dsn(deployment.producer), autocommit=True) as p:
                p.execute("select pgque.send('q', 'e', '1', 'k1')")
            with psycopg.connect(old.dsn(deployment.owner), autocommit=True) as o:
                o.execute("select pgque.tick('q')")
            slot = scalar(conn, "select pgque.slot_of('k1', 2)")
            assert scalar(conn, "select pgque.claim_slot('q', 'g', %s)", (slot,))
            rows = conn.execute("select batch_id, ev_id from pgque.receive_partitioned("
                                "'q', 'g', %s, 2)", (slot,)).fetchall()
            assert rows
            conn.execute("select pgque.nack_partitioned('q', 'g', %s, 2, %s, %s, '0', 'x'),"
                         "       pgque.ack_partitioned('q', 'g', %s, 2, %s)",
                         (slot, rows[0][0], [rows[0][1]], slot, rows[0][0]))
        for script in later:  # the old release's own upgrade, as it was run then
            run_script(old.dsn(deployment.owner), script)
        with psycopg.connect(old.dsn(deployment.owner), autocommit=True) as conn:
            pgque.install(conn)
        with psycopg.connect(fresh.dsn(deployment.owner), autocommit=True) as conn:
            pgque.install(conn)
            conn.execute("select pgque.create_queue('q', '{\"max_retries\": 0}')")
        with psycopg.connect(fresh.dsn(fresh.login(billing)), autocommit=True) as conn:
            conn.execute(f"set role {billing}")
            conn.execute("select pgque.subscribe_slots('q', 'g', 2)")
        for d in (old, fresh):
            with pgque.connect(d.dsn(deployment.owner)) as o:
                o.maintenance()
        with psycopg.connect(old.dsn(deployment.owner)) as a, \
                psycopg.connect(fresh.dsn(deployment.owner)) as b:
            upgraded, installed = catalog(a), catalog(b)
        for name in upgraded:
            assert upgraded[name] == installed[name], f"{name} differs after the upgrade"
        with pgque.connect(old.dsn(old.login(billing))) as t, \
                pgque.connect(old.dsn(old.login(billing))) as other, \
                pgque.connect(old.dsn(deployment.owner)) as o, \
                pgque.connect(old.dsn(deployment.producer)) as p:
            assert [d.consumer for d in t.dead_letters("q")] == [f"g#{slot}/2"]
            assert t.claim_slot("q", "g", slot)
            p.send("q", "e", 2, partition_key="k1")
            o.tick("q")
            batch = t.receive_partitioned("q", "g", slot=slot, slots=2)
            assert batch is not None and batch.fence is not None and len(batch) == 1
            t.check_fence(batch.fence)
            other.check_fence(batch.fence)
            t.ack(batch, nack=batch.messages)  # max_retries 0: a dead letter
            o.set_queue_config("q", max_retries=3)
            p.send("q", "e", 3, partition_key="k1")
            o.tick("q")
            batch = t.receive_partitioned("q", "g", slot=slot, slots=2)
            assert batch is not None and batch.fence is not None
            t.ack(batch, nack=batch.messages)
            assert ("q", "retry", 1) in o.maintenance()
            o.tick("q")
            batch = t.receive_partitioned("q", "g", slot=slot, slots=2)
            assert batch is not None and [m.retry_count for m in batch] == [1]
            assert batch.fence is not None and batch.messages[0].fence == batch.fence
            other.check_fence(batch.fence)
            t.ack(batch)
            assert len(t.dead_letters("q")) == 2
    finally:
        deployment.server.drop_database(old.dbname)
        deployment.server.drop_database(fresh.dbname)


# -- upgrades from 0.1 with odd state -----------------------------------------------------------


def test_upgrade_then_install_again_changes_nothing(empty_dsn: str) -> None:
    """Installing again after an upgrade from 0.1 changes neither the catalog nor the
    migration records."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        client.send("q", "e", 1)
        assert pgque.install(client.conn) == "0.1.0"
        first = catalog(client.conn)
        mig = client.conn.execute("select * from pgque.migration order by 1").fetchall()
        assert pgque.install(client.conn) == pgque.__version__
        assert catalog(client.conn) == first
        assert client.conn.execute("select * from pgque.migration order by 1").fetchall() == mig


def test_upgrade_of_many_odd_queues(empty_dsn: str) -> None:
    """0.1 with 30 queues, some dropped, one with 5 event tables rotated a few times,
    a consumer mid-batch: all kept, every queue ticks, sends, rotates."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        for n in range(30):
            client.create_queue(f"q{n}")
        for n in range(0, 30, 3):
            client.drop_queue(f"q{n}", force=True)
        client.create_queue("wide", event_tables=5, rotation_period=1)
        client.subscribe("wide", "c")
        sent = []
        for _ in range(7):
            sent.append(client.send("wide", "e", len(sent)))
            client.tick("wide")
            client.conn.execute("update pgque.queue set queue_switch_time = "
                                "queue_switch_time - interval '1 hour' "
                                "where queue_name = 'wide'")
            client.maintenance("wide")
        batch = client.receive("wide", "c", max_events=1)
        assert batch is not None
        held = [m.id for m in batch]
        pgque.install(client.conn)
        assert client.queue_config("wide")["event_tables"] == 5
        assert sorted(r.queue_name for r in client.queue_info()) == sorted(
            ["wide", *(f"q{n}" for n in range(30) if n % 3)])
        client.ack(batch)
        got = [m.id for m in drain(client, "wide", "c")]
        assert held + got == sent
        for n in range(1, 30, 3):
            client.send(f"q{n}", "e", 1)
            assert client.tick(f"q{n}") > 0
        assert scalar(client.conn, "select count(*) from pgque.queue_lock") == 2 * 21


def test_upgrade_by_a_non_superuser_owner_of_its_0_1_install(dsn: str) -> None:
    """0.1 installed (in one transaction, as psql -1 does) by a database owner without
    superuser, upgraded by that owner; a superuser is not the installer, and is
    refused (PQ013), as documented."""
    suffix = uuid.uuid4().hex[:8]
    owner, database = f"pgque_owner_{suffix}", f"owned_{suffix}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {owner} login nosuperuser nocreaterole nocreatedb")
        su.execute(f"create database {database} owner {owner}")
    try:
        owner_dsn = make_conninfo(**{**conninfo_to_dict(dsn), "user": owner, "dbname": database})
        install_0_1(owner_dsn)
        with pgque.connect(owner_dsn) as client:
            client.create_queue("q")
            client.subscribe("q", "c")
            sent = client.send("q", "e", 1)
            assert pgque.install(client.conn) == "0.1.0"
            assert [m.id for m in drain(client, "q", "c")] == [sent]
        # A superuser is not the installer: refused, as documented.
        with psycopg.connect(make_conninfo(**{**conninfo_to_dict(dsn), "dbname": database}),
                             autocommit=True) as su, pytest.raises(psycopg.Error) as caught:
            pgque.install(su)
        assert caught.value.sqlstate == "PQ013"
    finally:
        with psycopg.connect(dsn, autocommit=True) as su:
            su.execute(f"drop database if exists {database} with (force)")
            su.execute(f"drop role if exists {owner}")


def test_installer_killed_mid_way_leaves_nothing(empty_dsn: str) -> None:
    """An upgrade from 0.1 whose backend is terminated mid-script leaves 0.1 as it
    was; the next install upgrades."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        before = catalog(client.conn)
    with psycopg.connect(empty_dsn, autocommit=True) as blocker:
        # Hold a lock the code step needs, so the install stops mid-way.
        blocker.execute("begin")
        blocker.execute("lock table pgque.queue in access share mode")  # 0002 alters it
        conn = psycopg.connect(empty_dsn, autocommit=True)
        pid = conn.info.backend_pid
        outcome: list[BaseException] = []

        def doomed() -> None:
            try:
                pgque.install(conn)
            except psycopg.Error as exc:
                outcome.append(exc)

        t = threading.Thread(target=doomed)
        t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not scalar(
                blocker, "select wait_event_type = 'Lock' from pg_stat_activity where pid = %s",
                (pid,)):
            time.sleep(0.05)
        assert scalar(blocker, "select wait_event_type = 'Lock' from pg_stat_activity "
                               "where pid = %s", (pid,)), "the install never got stuck"
        with psycopg.connect(empty_dsn, autocommit=True) as killer:
            assert scalar(killer, "select pg_terminate_backend(%s)", (pid,))
        t.join(30)
        assert outcome, "the install was not cut off"
        conn.close()
        blocker.execute("rollback")
    with pgque.connect(empty_dsn) as client:
        assert catalog(client.conn) == before
        assert pgque.install(client.conn) == "0.1.0"
        assert client.tick("q") > 0


def test_upgrade_of_0_1_with_a_user_view_is_refused_and_leaves_0_1(empty_dsn: str) -> None:
    """A view of the user's over 0.1's consumer_info: the upgrade refuses with PQ017
    naming it, after migration 2 ran in the same transaction: all rolled back, 0.1
    as it was."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.conn.execute("create view public.lagging as select * from pgque.consumer_info")
        before = catalog(client.conn)
        with pytest.raises(psycopg.Error, match=r"public\.lagging") as caught:
            pgque.install(client.conn)
        assert caught.value.sqlstate == "PQ017"
        assert catalog(client.conn) == before
        assert scalar(client.conn, "select to_regclass('pgque.migration')") is None
        assert scalar(client.conn, "select pgque.version()") == "0.1.0"


# -- the migration record -----------------------------------------------------------------------


def test_a_migration_holding_the_outer_dollar_tag_is_refused(empty_dsn: str) -> None:
    """A migration holding the outer dollar tag ($pgque_migrate$) cannot end the DO
    block that wraps it early: _wrapped() refuses it, or the wrapped step runs
    whole and records the migration."""
    bad = Migration(99, "tagged", "do $pgque_migrate$ begin null; end $pgque_migrate$;")
    try:
        step = _wrapped(bad)
    except RuntimeError:
        return
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        pgque.install(conn)
        with conn.transaction(force_rollback=True):
            conn.execute(step.encode())
            assert scalar(conn, "select count(*) from pgque.migration "
                                "where mig_number = 99") == 1


def test_a_lost_migration_table_is_rebuilt(empty_dsn: str) -> None:
    """With pgque.migration dropped (a partial restore), or only the row of migration
    1 deleted, every migration missing from it runs again harmlessly (0001 creates
    only what is missing, as over a 0.1.0 install; the later ones too), and the
    events stay."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.create_queue("q")
        client.subscribe("q", "c")
        sent = client.send("q", "e", 1)
        for tamper in ("drop table pgque.migration",
                       "delete from pgque.migration where mig_number = 1"):
            client.conn.execute(tamper)
            client.install()
            assert [r[0] for r in client.conn.execute(
                "select mig_number from pgque.migration order by 1")] == [
                    m.number for m in migrations()]
        assert [m.id for m in drain(client, "q", "c")] == [sent]


def test_cli_refuses_a_newer_schema_clearly(empty_dsn: str) -> None:
    """`pgque install` over a newer migration: non-zero, says so, nothing claimed."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.conn.execute("insert into pgque.migration (mig_number, mig_name, mig_package) "
                            "values (99, 'future', '9.9.9')")
    out = run_cli("install", "--dsn", empty_dsn)
    assert out.returncode != 0
    assert "9.9.9" in out.stderr + out.stdout
    assert "upgraded" not in out.stdout and "installed" not in out.stdout


# -- slots, retries and dead letters across the upgrade from 0.1.0 ----------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_upgrade_while_a_0_1_session_owns_a_slot_mid_batch(empty_dsn: str) -> None:
    """A session that claimed slot 0 under 0.1.0 (its key was derived then) and
    holds half of its batch when the upgrade runs no longer owns the slot
    afterwards: its ack is refused (SlotNotOwned, G2), another session claims
    the slot at once and gets every event of the slot, the two the old owner had
    in hand among them; the old owner cannot take it back."""
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


@pytest.mark.parametrize("first, then", [("queue", "tick"), ("tick", "queue"),
                                         ("cursor", "queue")])
def test_upgrade_to_0_5_does_not_deadlock_with_a_session_of_0_4_reading_its_tables(
        empty_dsn: str, first: str, then: str) -> None:
    """A 0.4.0 session that read one of the tables migration 7 converts or locks
    and, while the migration waits for it, reads another goes on: the migration
    never waits holding one of them (attaching the ticks needs pgque.queue too).
    Both finish; neither is a deadlock's victim."""
    install_0_4(empty_dsn)
    with pgque.connect(empty_dsn) as setup:
        setup.create_queue("q")
        setup.send("q", "e", {}, partition_key="k")
        setup.tick("q")
    outcome: list[object] = []

    def upgrade() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                conn.execute("set deadlock_timeout = '200ms'")
                outcome.append(pgque.install(conn))
        except psycopg.Error as exc:
            outcome.append(exc)

    with psycopg.connect(empty_dsn) as reader, psycopg.connect(empty_dsn, autocommit=True) as mon:
        reader.execute("set deadlock_timeout = '200ms'")
        scalar(reader, f"select count(*) from pgque.{first}")
        installer = threading.Thread(target=upgrade)
        installer.start()
        wait_for(lambda: scalar(mon, "select count(*) from pg_catalog.pg_stat_activity"
                                     " where datname = current_database()"
                                     " and wait_event_type = 'Lock'"),
                 what="the upgrade waits for the reader")
        assert scalar(reader, f"select count(*) from pgque.{then}") >= 1
        reader.commit()
        installer.join(timeout=60)
    assert outcome == ["0.4.0"]
    with psycopg.connect(empty_dsn) as conn:
        assert scalar(conn, "select relkind::text from pg_catalog.pg_class"
                            " where oid = 'pgque.tick'::regclass") == "p"


def test_upgrade_keeps_retries_keys_nacks_and_replays_of_slots(empty_dsn: str) -> None:
    """Across the upgrade (migration 0003 drops ev_extra2..4 from retries and dead
    letters), a slot's waiting retry comes back to the same slot with its
    partition key and retry count; a nack of 0.1.0 in a still-open batch repeated
    after the upgrade changes nothing (batch_nack kept); a 0.1.0 dead letter of a
    slot, replayed, goes back to its slot with its key and payload."""
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


# What helpers.catalog does not compare: types, column storage, identity and
# inheritance, sequence parameters, routine properties, the one-row tables.
UPGRADE_CATALOG = {
    "types": """
        select t.typname, t.typtype, t.typacl::text,
               (select string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod),
                                  ', ' order by a.attnum)
                  from pg_attribute a
                 where a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped)
          from pg_type t where t.typnamespace = 'pgque'::regnamespace order by 1""",
    "attributes": """
        select c.relname,
               -- its place among the live columns (see helpers.CATALOG_QUERIES)
               (select count(*) from pg_attribute b where b.attrelid = c.oid and b.attnum > 0
                   and not b.attisdropped and b.attnum <= a.attnum) as place,
               a.attname, a.attstattarget, a.attstorage,
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


def test_an_upgraded_catalog_equals_a_fresh_one_beyond_what_catalog_compares(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """With two queues (one of 5 tables) and a group, the upgraded database and a
    fresh install agree on what helpers.catalog() does not compare: composite
    and row types, column storage, identity and inheritance, sequence
    parameters, routine volatility, cost and parallel safety, one-row tables.
    (Only dropped columns differ: migration 0003 leaves ev_extra2..4 as dropped
    columns in the upgraded event tables, as PostgreSQL does; nothing reads them.)"""
    def setup(client: pgque.Client) -> None:
        client.create_queue("q", max_retries=1)
        client.create_queue("r", event_tables=5)
        client.subscribe("q", "p")
        client.subscribe_slots("q", "g", slots=2)

    def upgrade_catalog(dsn: str) -> dict[str, list[Any]]:
        with psycopg.connect(dsn) as conn:
            return {k: conn.execute(q).fetchall() for k, q in UPGRADE_CATALOG.items()}

    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        setup(client)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        pgque.install(conn)
    upgraded = upgrade_catalog(empty_dsn)
    with pg_server.scratch_database(prefix="pgque_test_empty") as fresh_dsn:
        with pgque.connect(fresh_dsn) as fresh:
            fresh.install()
            setup(fresh)
        installed = upgrade_catalog(fresh_dsn)
    for name in UPGRADE_CATALOG:
        assert upgraded[name] == installed[name], f"{name} differs after the upgrade"


def test_an_older_package_does_not_silently_downgrade_a_newer_install(
        empty_dsn: str) -> None:
    """A database installed by a newer pgque that added no migration (a patch
    release: code only, pgque.installed says e.g. 99.0.0) is not overwritten by
    an older package's code: `pgque install` does not call it an upgrade, and
    the installed version stays (operations.md: "never run an older pgque's
    install over a newer one's")."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.conn.execute("update pgque.installed set in_version = '99.0.0'")
    env = {**os.environ, "PGQUE_DSN": empty_dsn, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pgque.cli", "install"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "upgraded from 99.0.0" not in done.stdout
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert scalar(conn, "select in_version from pgque.installed") == "99.0.0"


def _slot_events(conn: psycopg.Connection[Any], ids: list[int]) -> dict[int, list[int]]:
    """The ids of events sent with keys k0, k1, ... grouped by their slot of 4."""
    expected: dict[int, list[int]] = {}
    for n, ev in enumerate(ids):
        expected.setdefault(scalar(conn, "select pgque.slot_of(%s, 4)", (f"k{n}",)),
                            []).append(ev)
    return expected


def test_receive_slots_rows_read_as_0_3_read_them_after_the_upgrade(empty_dsn: str) -> None:
    """A 0.3 client keeps running while the owner upgrades (operations.md,
    Upgrades): it reads receive_slots' rows by position, the slot first, then
    batch_id, ev_id and the rest of the event. The upgraded receive_slots hands
    each slot its own events in those positions."""
    install_0_3(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.subscribe_slots("q", "g", slots=4)
        client.maintenance()
        ids = client.send_batch("q", [("e", n, f"k{n}") for n in range(12)])
        client.tick("q")
        expected = _slot_events(client.conn, ids)
        assert pgque.install(client.conn) == "0.3.0"
        for slot in range(4):
            assert client.claim_slot("q", "g", slot)
        rows = client.conn.execute(
            "select * from pgque.receive_slots('q', 'g', 4, '{0,1,2,3}')").fetchall()
    got: dict[int, list[int]] = {}
    for row in rows:
        got.setdefault(row[0], []).append(row[2])
    assert got == expected


def test_a_0_4_client_receives_slots_from_a_0_3_database(empty_dsn: str) -> None:
    """The other half of a rolling deploy: the application runs this pgque while
    the database still has 0.3.0. Client.receive_slots hands each slot its own
    events there too."""
    install_0_3(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.subscribe_slots("q", "g", slots=4)
        client.conn.execute("select * from pgque.maint()")
        ids = client.send_batch("q", [("e", n, f"k{n}") for n in range(12)])
        client.tick("q")
        expected = _slot_events(client.conn, ids)
        for slot in range(4):
            assert client.claim_slot("q", "g", slot)
        batches = client.receive_slots("q", "g", slots=4, owned=range(4))
        assert {b.slot: [m.id for m in b] for b in batches} == expected
