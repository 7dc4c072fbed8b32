"""Roles outside a consumer group (or outside pgque) cannot stall it through the
session advisory locks that carry slot ownership, group membership and the ticker
election: advisory locks need no privilege, pg_locks shows held keys to all, and
a key taken in a prepared transaction outlives every session.

Every attacker here is a login role with no pgque grant, or a reader of another
team, and every victim call runs with a statement timeout, so that a blocking
call fails instead of hanging the suite."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import World, advisory_keys, scalar, wait_for, waits_on_advisory_lock, world_of
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

# The fixed keys of pgque 0.1, which any role could take in advance.
OLD_SLOT_CLASS = 1885827443
OLD_GROUP_CLASS = 1885827431
OLD_TICKER_KEY = 1885827435 << 32


@pytest.fixture
def roles(dsn: str) -> Iterator[dict[str, str]]:
    """DSNs of a role outside pgque ('outsider'), of a reader of another team
    ('stranger'), of the team that owns the group ('team') and of an admin."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    grants = {"outsider": None, "stranger": "pgque_reader", "team": "pgque_reader",
              "admin": "pgque_admin"}
    names = {kind: f"pgque_key_{kind}_{suffix}" for kind in grants}
    with psycopg.connect(dsn, autocommit=True) as su:
        for kind, name in names.items():
            su.execute(f"create role {name} login")
            if grants[kind]:
                su.execute(f"grant {grants[kind]} to {name}")
        su.execute("select pgque.create_queue('q')")
        try:
            yield {kind: make_conninfo(**{**params, "user": name,
                                          "options": "-c statement_timeout=5000"})
                   for kind, name in names.items()}
        finally:
            for name in names.values():
                su.execute(f"drop role if exists {name}")


def attacker(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def wait_on_key(dsn: str, *key: int, shared: bool = False) -> tuple[threading.Thread,
                                                                   psycopg.Connection[Any]]:
    """An attacker session that waits for the key (a bigint, or two integers; queued
    behind its holder) and then keeps it for as long as the connection lives."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("set statement_timeout = 0")
    fn = "pg_advisory_lock_shared" if shared else "pg_advisory_lock"

    def take() -> None:
        # Fails when the test closes the connection under it; that is the end.
        with contextlib.suppress(psycopg.Error):
            conn.execute(f"select {fn}({', '.join(['%s'] * len(key))})", key)
    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, conn


def test_the_old_fixed_keys_stall_nothing(roles: dict[str, str]) -> None:
    """0.1's keys were constants: an outsider took every slot key and the group key
    exclusively and the election key, and workers owned nothing or hung."""
    with pgque.connect(roles["team"]) as team:
        team.subscribe_slots("q", "g", slots=4)
        with attacker(roles["outsider"]) as evil:
            for sub_id in range(1, 64):  # bigint keys, as 0.1 took them
                evil.execute("select pg_advisory_lock(%s), pg_advisory_lock(%s)",
                             ((OLD_SLOT_CLASS << 32) | sub_id, (OLD_GROUP_CLASS << 32) | sub_id))
            evil.execute("select pg_advisory_lock(%s)", (OLD_TICKER_KEY,))
            assert team.join_group("q", "g") is True
            assert all(team.claim_slot("q", "g", k) for k in range(4))
            status = team.group_status("q", "g")
            assert status.members == 1 and all(s.mine for s in status.slots)
            with pgque.connect(roles["admin"]) as admin:
                assert admin.claim_ticker() is True


def test_an_outsider_waiting_on_a_seen_slot_key_cannot_keep_the_slot(
        roles: dict[str, str]) -> None:
    """The outsider reads the worker's slot key from pg_locks, queues on it, and gets
    it when the worker's session ends. The next claim renews the key: the slot is a
    worker's again, and delivery goes on."""
    with pgque.connect(roles["team"]) as setup:
        setup.subscribe_slots("q", "g", slots=1)
    first = pgque.connect(roles["team"])
    assert first.claim_slot("q", "g", 0)
    evil_probe = attacker(roles["outsider"])
    ((key,),) = advisory_keys(evil_probe, first.conn.info.backend_pid, size=1)
    thread, evil = wait_on_key(roles["outsider"], key)
    try:
        wait_for(lambda: waits_on_advisory_lock(evil_probe, evil.info.backend_pid),
                 what="the outsider to queue")
        first.close()  # the worker goes; the outsider now holds the old key
        wait_for(lambda: not thread.is_alive(), what="the outsider to get the old key")
        with pgque.connect(roles["team"]) as second, pgque.connect(roles["admin"]) as admin:
            status = second.group_status("q", "g")
            assert status.slots[0].owner_pid is None  # the outsider does not count as owner
            assert second.claim_slot("q", "g", 0) is True
            assert second.slot_lock_key("q", "g", 0) != key
            admin.conn.execute("select pgque.send('q', 'e', '1', 'k')")
            admin.tick("q")
            batch = second.receive_partitioned("q", "g", slot=0, slots=1)
            assert batch is not None and len(batch) == 1
            assert second.ack(batch)
            assert second.group_status("q", "g").slots[0].owner_pid == second.pinned_pid
    finally:
        evil.close()
        evil_probe.close()


def test_a_reader_of_another_team_is_an_outsider_to_the_group(roles: dict[str, str]) -> None:
    """A pgque_reader that may not use the group gets no further than an outsider."""
    with pgque.connect(roles["team"]) as team, attacker(roles["stranger"]) as stranger:
        team.subscribe_slots("q", "g", slots=1)
        assert team.claim_slot("q", "g", 0)
        ((key,),) = advisory_keys(stranger, team.conn.info.backend_pid, size=1)
        team.release_slot("q", "g", 0)
        assert scalar(stranger, "select pg_try_advisory_lock(%s)", (key,))
        assert team.group_status("q", "g").slots[0].owner_pid is None
        assert team.claim_slot("q", "g", 0) is True
        assert team.group_status("q", "g").slots[0].mine


def test_shared_holders_of_the_group_key_are_not_members(roles: dict[str, str]) -> None:
    """Seven outsider sessions holding the group's key in share mode shrank a worker's
    fair share to zero in 0.1; they are not counted, nor are outsiders holding member
    keys of the group's class (as members do since 0.3)."""
    with pgque.connect(roles["team"]) as team:
        team.subscribe_slots("q", "g", slots=8)
        assert team.join_group("q", "g")
        with attacker(roles["outsider"]) as probe:
            ((group_class, member),) = advisory_keys(probe, team.conn.info.backend_pid,
                                                     mode=None, size=2)
        evil = [attacker(roles["outsider"]) for _ in range(7)]
        try:
            for n, conn in enumerate(evil):
                assert scalar(conn, "select pg_try_advisory_lock(%s, %s)",
                              (group_class, (member + n + 1 + 2**31) % 2**32 - 2**31))
            status = team.group_status("q", "g")
            assert status.members == 1 and status.my_rank == 0
            assert status.fair_share() == 8
        finally:
            for conn in evil:
                conn.close()


def test_an_outsider_queued_on_the_group_key_cannot_keep_workers_out(
        roles: dict[str, str]) -> None:
    """A member's key is its own (two integers: the group's class, a random member
    number), so a request queued on it blocks no join. With one shared key for
    every member (0.2), an exclusive request queued on it made every later join
    fail, and the renewal that got round that stopped counting the members there."""
    with pgque.connect(roles["team"]) as first, pgque.connect(roles["team"]) as second:
        first.subscribe_slots("q", "g", slots=2)
        assert first.join_group("q", "g")
        with attacker(roles["outsider"]) as probe:
            (pair,) = advisory_keys(probe, first.conn.info.backend_pid, mode=None, size=2)
            thread, evil = wait_on_key(roles["outsider"], *pair)
            try:
                wait_for(lambda: waits_on_advisory_lock(probe, evil.info.backend_pid),
                         what="the outsider to queue")
                assert second.join_group("q", "g") is True
                assert second.group_status("q", "g").members == 2
                assert first.join_group("q", "g") is False  # still a member
                assert first.group_status("q", "g").my_rank is not None
            finally:
                evil.close()
        thread.join(5)


def test_an_outsider_on_the_ticker_key_cannot_keep_the_election(roles: dict[str, str],
                                                                 dsn: str) -> None:
    with pgque.Ticker(dsn) as ticker, attacker(roles["outsider"]) as probe:
        assert ticker.wait_active(10)
        ((key,),) = advisory_keys(probe, ticker.backend_pid or 0, size=1)
        thread, evil = wait_on_key(roles["outsider"], key)
        try:
            wait_for(lambda: waits_on_advisory_lock(probe, evil.info.backend_pid),
                     what="the outsider to queue")
            ticker.stop()
            wait_for(lambda: not thread.is_alive(), what="the outsider to get the old key")
            with pgque.Ticker(dsn) as successor, pgque.connect(roles["admin"]) as admin:
                assert successor.wait_active(10)
                assert admin.active_ticker() == successor.backend_pid
                admin.send("q", "e", 1)
                wait_for(lambda: successor.ticks > 0, what="the successor to tick")
        finally:
            evil.close()


# -- prepared transactions on the keys --------------------------------------------------------


@pytest.fixture
def world(dsn: str) -> Iterator[World]:
    """Teams a and b, an admin and an outsider, each a login role (helpers.World)."""
    with world_of(dsn) as w:
        yield w


@pytest.fixture
def prepared_ok(pg_server: Any) -> None:
    """max_prepared_transactions > 0 (the suite's server has 0): restarts a throwaway
    server once, or skips."""
    with psycopg.connect(pg_server.dsn(), autocommit=True) as su:
        if int(scalar(su, "show max_prepared_transactions")) > 0:
            return
        if not pg_server.restartable:
            pytest.skip("max_prepared_transactions = 0 and the server cannot restart")
        su.execute("alter system set max_prepared_transactions = 10")
    pg_server.restart()
    with psycopg.connect(pg_server.dsn(), autocommit=True) as su:
        su.execute("alter system reset max_prepared_transactions")  # from the next restart


def test_a_prepared_transaction_on_a_seen_key_stalls_nothing(prepared_ok: None,
                                                             world: World) -> None:
    """An outsider reads the slot and group keys from pg_locks and takes them in a
    transaction it prepares (the locks outlive every session, pid null). Claims and
    joins renew the keys: the next worker of the team joins, claims the slot under
    a new key and owns it."""
    with world.client("a") as first:
        first.subscribe_slots("q", "g", slots=1)
        assert first.claim_slot("q", "g", 0) and first.join_group("q", "g")
        slot_key = first.slot_lock_key("q", "g", 0)
        group_key = scalar(world.su, "select cg_lock_key from pgque.consumer_group")
        first.release_slot("q", "g", 0)
    gid = f"rv-{uuid.uuid4().hex[:8]}"
    with world.raw("outsider", autocommit=False) as evil:
        evil.execute("select pg_advisory_xact_lock(%s), pg_advisory_xact_lock(%s)",
                     (slot_key, group_key))
        evil.execute(f"prepare transaction '{gid}'")
    try:
        assert scalar(world.su, "select count(*) from pg_locks where locktype = 'advisory' "
                                "and pid is null and granted") == 2
        with world.client("a") as second:
            assert second.group_status("q", "g").slots[0].owner_pid is None
            assert second.join_group("q", "g") is True
            assert second.claim_slot("q", "g", 0) is True
            assert second.slot_lock_key("q", "g", 0) != slot_key
            status = second.group_status("q", "g")
            assert status.slots[0].mine and status.members == 1
    finally:
        world.su.execute(f"rollback prepared '{gid}'")
