"""Upgrades: numbered migrations over the frozen 0.1.0 baseline, code recreated,
and nothing lost on the way (pgque/schema.py, pgque/sql/)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pgtest
import psycopg
import pytest
from helpers import drain, scalar, wait_for
from test_cli import run_cli
from test_install import catalog, install_0_1, scratch_database

import pgque
from pgque.schema import migrations


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
    a slot never read, events not ticked yet. Returns what was sent and seen."""
    with pgque.connect(dsn) as client:
        client.create_queue("q", max_retries=1)
        client.subscribe("q", "plain")
        client.subscribe_slots("q", "g", slots=2)
        first = client.send_batch("q", [("e", {"n": n}, f"k{n}") for n in range(10)])
        client.tick("q")
        # plain: 4 of the 10 handed out and acked, one of them nacked: a retry.
        piece = client.receive("q", "plain", max_events=4)
        assert piece is not None and len(piece) == 4
        client.ack(piece, nack=[piece.messages[0]], retry_after=0)
        # slot 0 of the group: one event fails twice and is dead-lettered.
        assert client.claim_slot("q", "g", 0)
        batch = client.receive_partitioned("q", "g", slot=0, slots=2)
        assert batch is not None and len(batch) > 0
        doomed = batch.messages[0].id
        client.ack(batch, nack=[doomed], retry_after=0)
        client.maintenance()
        client.tick("q")
        batch = client.receive_partitioned("q", "g", slot=0, slots=2)
        assert batch is not None and [m.id for m in batch] == [doomed]
        client.ack(batch, nack={doomed: "failed twice"}, retry_after=0)
        slot0 = {ev for n, ev in enumerate(first)
                 if scalar(client.conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)) == 0}
        # Sent after the last tick: not in any batch yet.
        later = client.send_batch("q", [("e", {"n": n}, f"k{n}") for n in range(10, 15)])
        dead = [(d.id, d.consumer, d.event_id, d.reason) for d in client.dead_letters("q")]
        assert [d[2:] for d in dead] == [(doomed, "failed twice")]
        return {"first": first, "later": later, "handed": [m.id for m in piece],
                "retried": piece.messages[0].id, "slot0": slot0, "doomed": doomed,
                "dead": dead}


def test_upgrade_from_0_1_0_loses_nothing_and_equals_a_fresh_install(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    install_0_1(empty_dsn)
    seen = fill_0_1(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert pgque.install(conn) == "0.1.0"
        assert conn.execute("select mig_number, mig_package from pgque.migration "
                            "order by 1").fetchall() == [
            (1, "0.1.0"), *((m.number, pgque.__version__) for m in migrations()[1:])]
    everything = set(seen["first"]) | set(seen["later"])
    with pgque.connect(empty_dsn) as client:
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
        # The ticker election and the new locks work on the old queue.
        assert client.claim_ticker()
        assert client.ticker() >= 0
        upgraded = catalog(client.conn)
    upgraded_dump = pg_dump_schema(pg_server, empty_dsn)

    with scratch_database(pg_server) as fresh_dsn, pgque.connect(fresh_dsn) as fresh:
        fresh.install()
        fresh.create_queue("q", max_retries=1)
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
