"""A role without any pgque grant cannot stall pgque by taking its lock keys first.

pgque 0.1 serialized ticks, maintenance, create_queue and the install with
advisory locks on constant keys. Any role that may connect could take such a
key first (a session lock, exclusive or shared) and hold it: tick() then waited
forever, the ticker and maintenance skipped the queue forever, create_queue
and install() waited forever. Each test here holds the old key as a role with
no pgque grant, and checks that the operation completes and does its work.
The victim's statement_timeout turns a stall into a failure, not a hang.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from helpers import drain, scalar
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

# The keys of pgque 0.1: the tick and maintenance lock classes (each with the
# queue id as second key), and the install's bigint key.
OLD_TICK_CLASS = 1885827444
OLD_MAINT_CLASS = 1885827437
OLD_INSTALL_KEY = 0x7067_7169

# Long enough for any of these operations; a stalled one fails with QueryCanceled.
VICTIM_OPTIONS = "-c statement_timeout=5s"

LOCK_MODES = ["exclusive", "shared"]


@contextmanager
def intruder_session(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit session of a fresh login role with no pgque grant at all."""
    role = f"pgque_intruder_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        try:
            with psycopg.connect(make_conninfo(**{**params, "user": role}),
                                 autocommit=True) as conn:
                yield conn
        finally:
            su.execute(f"drop role if exists {role}")


@pytest.fixture
def intruder(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with intruder_session(dsn) as conn:
        yield conn


@pytest.fixture
def victim(dsn: str) -> Iterator[pgque.Client]:
    """An admin's client whose statements give up after 5 s."""
    with pgque.connect(dsn, options=VICTIM_OPTIONS) as client:
        yield client


def hold(conn: psycopg.Connection[Any], mode: str, *keys: Any) -> None:
    """Take a session advisory lock on keys (two integers or one bigint) and keep it."""
    function = "pg_advisory_lock" if mode == "exclusive" else "pg_advisory_lock_shared"
    placeholders = ", ".join(["%s"] * len(keys))
    conn.execute(f"select {function}({placeholders})", keys)
    held = scalar(conn, "select count(*) from pg_locks where locktype = 'advisory' "
                        "and pid = pg_backend_pid() and granted")
    assert held == 1


def test_the_intruder_can_reach_nothing_of_pgque(intruder: psycopg.Connection[Any]) -> None:
    """What the new locks rely on: no role without a grant may name pgque's tables."""
    for statement in ("select from pgque.queue_lock for update",
                      "select from pgque.install_lock for update",
                      "lock table pgque.queue_lock",
                      "lock table pgque.install_lock",
                      "select pgque.ticker()"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege), intruder.transaction():
            intruder.execute(statement)


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_a_held_tick_key_stalls_no_forced_tick(client: pgque.Client, victim: pgque.Client,
                                               intruder: psycopg.Connection[Any],
                                               mode: str) -> None:
    queue_id = client.create_queue("q")
    hold(intruder, mode, OLD_TICK_CLASS, queue_id)
    first = victim.tick("q")
    assert victim.tick("q") > first


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_a_held_tick_key_stalls_no_ticker(client: pgque.Client, victim: pgque.Client,
                                          intruder: psycopg.Connection[Any], mode: str) -> None:
    queue_id = client.create_queue("q")
    hold(intruder, mode, OLD_TICK_CLASS, queue_id)
    client.send("q", "e", 1)
    assert victim.ticker() == 1, "ticker() skipped a queue whose old tick key is held"
    client.send("q", "e", 2)
    assert victim.tick_overdue(0) == 1
    client.send("q", "e", 3)
    assert victim.ticker("q") == 1


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_a_held_maintenance_key_stalls_no_maintenance(
        client: pgque.Client, victim: pgque.Client, intruder: psycopg.Connection[Any],
        mode: str) -> None:
    queue_id = client.create_queue("q")
    client.subscribe("q", "c")
    client.send("q", "e", "fails")
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.ack(batch, nack=batch.messages, retry_after=0)
    client.tick("q")
    hold(intruder, mode, OLD_MAINT_CLASS, queue_id)

    steps = {step: amount for _, step, amount in victim.maintenance()}
    assert steps.get("retry") == 1, f"the due retry did not come back: {steps}"
    assert [m.payload for m in drain(client, "q", "c")] == ["fails"]


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_a_held_create_queue_key_stalls_no_create_queue(
        victim: pgque.Client, intruder: psycopg.Connection[Any], mode: str) -> None:
    keys = intruder.execute("select hashtext('pgque.create_queue'), hashtext('q2')").fetchone()
    assert keys is not None
    hold(intruder, mode, *keys)

    created = victim.create_queue("q2")
    assert victim.create_queue("q2", exist_ok=True) == created
    with pytest.raises(pgque.QueueExists):
        victim.create_queue("q2")


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_a_held_install_key_stalls_no_install(empty_dsn: str, mode: str) -> None:
    with intruder_session(empty_dsn) as intruder, \
            psycopg.connect(empty_dsn, autocommit=True, options=VICTIM_OPTIONS) as conn:
        hold(intruder, mode, OLD_INSTALL_KEY)
        pgque.install(conn)  # the first install
        pgque.install(conn)  # and one over it
        assert scalar(conn, "select pgque.version()") == pgque.__version__
        pgque.schema.uninstall(conn)
        assert scalar(conn, "select to_regnamespace('pgque') is null")


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_a_held_install_key_stalls_no_uninstall(dsn: str, intruder: psycopg.Connection[Any],
                                                mode: str) -> None:
    hold(intruder, mode, OLD_INSTALL_KEY)
    with psycopg.connect(dsn, autocommit=True, options=VICTIM_OPTIONS) as conn:
        pgque.schema.uninstall(conn)
        assert scalar(conn, "select to_regnamespace('pgque') is null")
