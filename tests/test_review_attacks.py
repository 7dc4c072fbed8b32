"""Security review: attacks on the access model of docs/operations.md ("Security"),
docs/concepts.md ("Consumer groups and slots", "Claiming") and docs/design-notes.md
("Slot locks", "Privileges").

Each test asserts what the documentation promises. Tests whose docstring starts
with ``DEFECT`` FAIL on the code reviewed (commit 0d62d10) and should pass once the
engine (or, where said, the docs) is fixed; those starting with ``Held`` are attacks
that did not work and guard against regressions.

Attackers: a login role with no pgque grant ("outsider"), a reader/writer of another
team ("b"), and a member of the owning team trying to exceed its rights. Every victim
connection runs with a statement timeout, so a stall fails the test instead of
hanging the suite."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import pytest
from helpers import refused, scalar
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

VICTIM_TIMEOUT_MS = 3000


@dataclass
class World:
    """Roles of one test: team a, team b (reader + writer each), an admin and an
    outsider (login, no pgque grant); DSNs with a statement timeout; superuser DSN."""

    su: psycopg.Connection[Any]
    su_dsn: str
    roles: dict[str, str]
    dsns: dict[str, str]
    extra_roles: list[str]

    def client(self, kind: str) -> pgque.Client:
        return pgque.connect(self.dsns[kind])

    def raw(self, kind: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsns[kind], autocommit=autocommit)

    def dsn_for(self, user: str, *options: str) -> str:
        params = conninfo_to_dict(self.su_dsn)
        opts = " ".join([f"-c statement_timeout={VICTIM_TIMEOUT_MS}", *options])
        return make_conninfo(**{**params, "user": user, "options": opts})  # type: ignore[arg-type]

    def make_role(self, name: str, ddl: str = "") -> str:
        """Creates a role dropped after the test (ddl: the rest of CREATE ROLE)."""
        self.su.execute(f"create role {sql.Identifier(name).as_string(self.su)} {ddl}")
        self.extra_roles.append(name)
        return name


@pytest.fixture
def world(dsn: str) -> Iterator[World]:
    suffix = uuid.uuid4().hex[:8]
    grants = {"a": "pgque_reader, pgque_writer", "b": "pgque_reader, pgque_writer",
              "admin": "pgque_admin", "outsider": None}
    roles = {kind: f"pgque_rv_{kind}_{suffix}" for kind in grants}
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("select pgque.create_queue('q')")
        w = World(su, dsn, roles, {}, [])
        try:
            for kind, role in roles.items():
                su.execute(f"create role {role} login")
                if grants[kind]:
                    su.execute(f"grant {grants[kind]} to {role}")
                w.dsns[kind] = w.dsn_for(role)
            yield w
        finally:
            # Sessions of these roles may still be open (a failed test): end them first.
            names = list(roles.values()) + w.extra_roles
            su.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                       "where usename = any(%s) and pid <> pg_backend_pid()", (names,))
            for name in reversed(names):
                ident = sql.Identifier(name).as_string(su)
                with contextlib.suppress(psycopg.Error):
                    su.execute(f"drop owned by {ident}")
                with contextlib.suppress(psycopg.Error):
                    su.execute(f"drop role if exists {ident}")




def sqlstate_of(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except psycopg.Error as exc:
        return exc.sqlstate
    except pgque.PgqueError as exc:
        return getattr(exc, "sqlstate", None)
    return None


# ---------------------------------------------------------------------------
# DoS: row locks taken before the access check
# ---------------------------------------------------------------------------

def test_a_refused_ack_by_another_team_does_not_stall_the_consumer(world: World) -> None:
    """Held (but fragile). pgque.ack/nack of a plain consumer lock the subscription row
    (FOR UPDATE in _find_subscription) BEFORE _require_consumer refuses with PQ014.
    That does not stall the owner only because PostgreSQL releases a statement's
    locks as soon as the error aborts the transaction, even when the block stays
    open ("idle in transaction (aborted)"), and a subtransaction's row locks when
    it rolls back. Checking access before locking would not depend on that."""
    with world.client("a") as a, world.client("admin") as admin, \
            world.raw("b", autocommit=False) as evil:
        a.subscribe("q", "ca")
        a.send("q", "e", 1)
        admin.tick("q")
        assert sqlstate_of(lambda: evil.execute("select pgque.ack('q', 'ca', 1)")) == "PQ014"
        # evil now sits in an aborted transaction.
        batch = a.receive("q", "ca")  # statement_timeout: fails instead of hanging
        assert batch is not None and len(batch) == 1
        evil.rollback()
        evil.execute("savepoint s")
        assert sqlstate_of(lambda: evil.execute(
            "select pgque.nack('q', 'ca', %s, %s)",
            (batch.batch_id, [batch.messages[0].id]))) == "PQ014"
        evil.execute("rollback to savepoint s")  # the transaction goes on, open
        assert a.ack(batch)


def test_a_plain_ack_on_a_slot_name_by_another_team_does_not_stall_the_slot(
        world: World) -> None:
    """Held (but fragile). The same through a slot subscription's name: pgque.nack('q',
    'ga#0/1', ...) locks the slot's subscription row, then raises PQ021 without ever
    checking the caller's access to the group; harmless for the same reason."""
    with world.client("a") as a, world.client("admin") as admin, \
            world.raw("b", autocommit=False) as evil:
        a.subscribe_slots("q", "ga", slots=1)
        assert a.claim_slot("q", "ga", 0)
        a.send("q", "e", 1, partition_key="k")
        admin.tick("q")
        state = sqlstate_of(lambda: evil.execute("select pgque.nack('q', 'ga#0/1', 1, '{1}')"))
        assert state in ("PQ014", "PQ021")
        batch = a.receive_partitioned("q", "ga", slot=0, slots=1)
        assert batch is not None and len(batch) == 1
        assert a.ack(batch)


# ---------------------------------------------------------------------------
# Dead letters of a consumer that is gone
# ---------------------------------------------------------------------------

def _dead_letter_one(client: pgque.Client, admin: pgque.Client, *, slot: bool) -> None:
    client.send("dq", "secret", {"card": "4111"}, partition_key="k")
    admin.tick("dq")
    if slot:
        assert client.claim_slot("dq", "g", 0)
        batch = client.receive_partitioned("dq", "g", slot=0, slots=1)
    else:
        batch = client.receive("dq", "c")
    assert batch is not None and len(batch) == 1
    client.ack(batch, nack=[batch.messages[0].id])


def test_dead_letters_of_an_unsubscribed_consumer_do_not_go_to_the_next_owner_of_its_name(
        world: World) -> None:
    """Found in review (medium), fixed. "Once the consumer is gone, its dead letters are the admins'
    only." Dead letters are matched to consumers by name: another team subscribes a
    consumer of the same name and reads every dead letter (payloads included) of the
    consumer that is gone."""
    with world.client("a") as a, world.client("b") as b, world.client("admin") as admin:
        admin.create_queue("dq", max_retries=0)
        a.subscribe("dq", "c")
        _dead_letter_one(a, admin, slot=False)
        assert len(admin.dead_letters("dq", "c")) == 1
        a.unsubscribe("dq", "c")
        assert b.subscribe("dq", "c") is True  # the name is free again
        assert b.dead_letters("dq") == []
        assert b.dead_letters("dq", "c") == []


def test_dead_letters_of_a_removed_group_do_not_go_to_the_next_owner_of_its_name(
        world: World) -> None:
    """Found in review (medium), fixed. The same for a consumer group: unsubscribe_slots keeps the
    dead letters of "g#k/N", and whoever subscribes group "g" next reads them."""
    with world.client("a") as a, world.client("b") as b, world.client("admin") as admin:
        admin.create_queue("dq", max_retries=0)
        a.subscribe_slots("dq", "g", slots=1)
        _dead_letter_one(a, admin, slot=True)
        a.unsubscribe_slots("dq", "g")
        assert b.subscribe_slots("dq", "g", slots=1) == 1
        assert b.dead_letters("dq") == []
        assert b.dead_letters("dq", "g") == []


# ---------------------------------------------------------------------------
# Grants: a group and a plain consumer of the same name
# ---------------------------------------------------------------------------

def test_a_grantee_cannot_keep_its_grant_by_squatting_the_group_name(world: World) -> None:
    """Found in review (medium), fixed. grant_consumer/revoke_consumer act on the plain consumer AND
    the group of that name and raise PQ014 unless the caller may change both. Team b,
    granted team a's plain consumer "x", subscribes a group named "x" (it owns that):
    from then on a can no longer revoke b's access (only an admin can)."""
    with world.client("a") as a, world.client("b") as b:
        a.subscribe("q", "x")
        assert a.grant_consumer("q", "x", world.roles["b"])
        b.subscribe_slots("q", "x", slots=1)  # b's own group, same name
        assert a.revoke_consumer("q", "x", world.roles["b"]) is True
        assert refused(lambda: b.receive("q", "x"), pgque.ConsumerAccessDenied)


def test_a_group_of_the_same_name_gives_no_access_to_the_plain_consumer(world: World) -> None:
    """Held: b's group "x" does not open a's plain consumer "x" to b, and a grant b
    makes on "x" changes its own group only."""
    with world.client("a") as a, world.client("b") as b:
        a.subscribe("q", "x")
        b.subscribe_slots("q", "x", slots=1)
        assert refused(lambda: b.receive("q", "x"), pgque.ConsumerAccessDenied)
        b.grant_consumer("q", "x", world.roles["b"])
        assert refused(lambda: b.receive("q", "x"), pgque.ConsumerAccessDenied)
        assert refused(lambda: b.unsubscribe("q", "x"), pgque.ConsumerAccessDenied)
        assert refused(lambda: a.claim_slot("q", "x", 0), pgque.ConsumerAccessDenied)


# ---------------------------------------------------------------------------
# Sessions judged by their login role: NOINHERIT logins acting through SET ROLE
# ---------------------------------------------------------------------------

def _noinherit_team(world: World) -> tuple[str, str, str]:
    """A team role with reader+writer and two NOINHERIT logins in it, which act as
    the team through SET ROLE (here: role=team in the connection options, the way a
    Worker's DSN carries it). DSNs of both logins."""
    suffix = uuid.uuid4().hex[:8]
    team = world.make_role(f"pgque_rv_team_{suffix}", "nologin")
    world.su.execute(f"grant pgque_reader, pgque_writer to {team}")
    logins = [world.make_role(f"pgque_rv_svc{i}_{suffix}", f"login noinherit in role {team}")
              for i in (1, 2)]
    return team, world.dsn_for(logins[0], f"-c role={team}"), \
        world.dsn_for(logins[1], f"-c role={team}")


def test_a_noinherit_login_acting_as_its_team_counts_as_owner_and_member(
        world: World) -> None:
    """Found in review (high), fixed. The documented pattern is to SET ROLE to the team. For a login
    that does not inherit (NOINHERIT, or PG16's GRANT ... WITH INHERIT FALSE),
    _may_consume(login) is false (has_function_privilege(login, receive_partitioned)
    needs inheritance), so the team's own worker counts neither as owner nor as
    member: group_status shows its slot unowned and my_rank null."""
    _team, dsn1, _dsn2 = _noinherit_team(world)
    with pgque.connect(dsn1) as w1:
        w1.subscribe_slots("q", "g", slots=2)
        assert w1.claim_slot("q", "g", 0) and w1.join_group("q", "g")
        status = w1.group_status("q", "g")
        assert status.slots[0].owner_pid == w1.pinned_pid and status.slots[0].mine
        assert status.members == 1 and status.my_rank == 0


def test_a_noinherit_teammate_cannot_take_a_slot_another_one_owns(world: World) -> None:
    """Found in review (high), fixed. Consequence: the holder looks like an outsider, so a second
    worker of the same team renews the key and "claims" a slot the first one owns;
    the first is displaced mid-work (SlotNotOwned). Two such workers steal slots from
    each other forever; an outsider does not even need to act."""
    _team, dsn1, dsn2 = _noinherit_team(world)
    with pgque.connect(dsn1) as w1, pgque.connect(dsn2) as w2, \
            world.client("admin") as admin:
        w1.subscribe_slots("q", "g", slots=1)
        assert w1.claim_slot("q", "g", 0)
        assert w2.claim_slot("q", "g", 0) is False  # taken: must be refused
        admin.send("q", "e", 1, partition_key="k")
        admin.tick("q")
        batch = w1.receive_partitioned("q", "g", slot=0, slots=1)
        assert batch is not None and w1.ack(batch)


def test_a_worker_of_a_noinherit_login_acting_as_its_team_runs(world: World) -> None:
    """Found in review (high), fixed. The Worker stopped for good with
    ConsumerAccessDenied at its first rebalance: it was not counted as a member
    (my_rank null) and join_group returned false as it already held the key."""
    _team, dsn1, _dsn2 = _noinherit_team(world)
    with pgque.connect(dsn1) as setup:
        setup.subscribe_slots("q", "g", slots=2)
    worker: pgque.Worker[Any] = pgque.Worker(dsn1, queue="q", consumer="g", slots=2,
                          handler=lambda message: None, ticker=False, rebalance_interval=0.1)
    with worker:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(worker.owned_slots) < 2 \
                and worker.error is None:
            time.sleep(0.05)
        assert worker.error is None
        assert worker.owned_slots == frozenset({0, 1})


def test_a_noinherit_admin_acting_as_pgque_admin_keeps_the_election(world: World) -> None:
    """Found in review (medium), fixed. The same for the election: _may_tick(login) uses
    has_function_privilege, so an admin login that does not inherit and acts through
    SET ROLE pgque_admin is not the active ticker (active_ticker() is null) and a
    second one renews the key and becomes "active" too."""
    suffix = uuid.uuid4().hex[:8]
    logins = [world.make_role(f"pgque_rv_tick{i}_{suffix}", "login noinherit in role pgque_admin")
              for i in (1, 2)]
    dsn1, dsn2 = (world.dsn_for(name, "-c role=pgque_admin") for name in logins)
    with pgque.connect(dsn1) as t1, pgque.connect(dsn2) as t2:
        assert t1.claim_ticker() is True
        assert t1.active_ticker() == t1.conn.info.backend_pid
        assert t2.claim_ticker() is False


# ---------------------------------------------------------------------------
# Sessions judged through a stale pg_stat_activity snapshot
# ---------------------------------------------------------------------------

def test_a_claim_in_a_long_transaction_does_not_displace_a_newer_owner(world: World) -> None:
    """Found in review (medium-low), fixed. pg_stat_activity is snapshotted once per transaction. A
    teammate whose transaction read it (group_status, an earlier claim_slot) before a
    worker connected sees that worker's lock with no role, i.e. an outsider, and its
    claim_slot renews the key of a slot the worker owns: "a legitimate holder is
    never displaced" does not hold. (Client(conn) runs calls in the caller's
    transaction, so this is reachable through the Python API as well.)"""
    with world.client("a") as setup:
        setup.subscribe_slots("q", "g", slots=2)
    with world.raw("a", autocommit=False) as mate:
        mate.execute("select * from pgque.group_status('q', 'g')").fetchall()
        with world.client("a") as worker:  # connects after mate's snapshot
            assert worker.claim_slot("q", "g", 1)
            stolen = scalar(mate, "select pgque.claim_slot('q', 'g', 1)")
            mate.commit()
            assert stolen is False
            assert worker.group_status("q", "g").slots[1].mine


# ---------------------------------------------------------------------------
# What the docs say about reading other teams' things
# ---------------------------------------------------------------------------

def test_a_reader_of_another_team_does_not_read_its_cursors_in_the_info_views(
        world: World) -> None:
    """DEFECT (low; docs vs behaviour). operations.md: a reader of another team "cannot
    read or change events, cursors, consumers or queues" of that team. consumer_info
    and partition_slot_status (granted to every reader, SECURITY DEFINER, unfiltered)
    list every team's consumers with their cursor position, open batch, pending and
    dead-letter counts and slot owners; queue_info lists queues whose 'consume'
    grants leave the reader out. (tests/test_access.py asserts the opposite for
    partition_slot_status, so either the views or the docs must change.)"""
    with world.client("a") as a, world.client("b") as b, world.client("admin") as admin:
        admin.create_queue("private")
        admin.grant_queue("private", world.roles["a"], "consume")
        a.subscribe("private", "ca")
        a.subscribe_slots("q", "ga", slots=2)
        seen = {(r.queue_name, r.consumer_name) for r in b.consumer_info()}
        assert ("private", "ca") not in seen
        assert not any(r.consumer_name == "ga" for r in b.partition_slot_status())


# ---------------------------------------------------------------------------
# Grant and revoke inputs
# ---------------------------------------------------------------------------

def test_a_grant_of_a_dropped_role_can_be_revoked(world: World) -> None:
    """Found in review (low), fixed. Grants are kept by oid. After the role is dropped, queue_grants
    shows the grant under the bare oid, but revoke_queue looks roles up by name and
    raises PQ016 for it: the queue stays restricted to nobody for good (short of
    editing pgque's tables as the installer). Dropping a role is not refused either,
    so "revoke before dropping" is easy to miss."""
    gone = world.make_role(f"pgque_rv_gone_{uuid.uuid4().hex[:8]}")
    with world.client("admin") as admin, world.client("b") as b:
        admin.grant_queue("q", gone, "send")
        world.su.execute(f"drop role {gone}")
        [(privilege, shown)] = admin.queue_grants("q")
        assert privilege == "send"
        assert admin.revoke_queue("q", shown, "send") is True
        assert b.send("q", "e", 1) > 0  # open again to every writer


def test_a_grant_to_an_overlong_name_is_refused(world: World) -> None:
    """Found in review (low), fixed. _role_id takes a name, so a role argument is truncated to 63
    bytes: grant_queue/grant_consumer with a string that is NOT a role's name (a
    63-byte role name plus anything) silently grant that role instead of raising
    InvalidGrant."""
    role = world.make_role("r" * 63)
    world.su.execute(f"grant pgque_reader to {role}")
    with world.client("admin") as admin, world.client("a") as a:
        with pytest.raises(pgque.InvalidGrant):
            admin.grant_queue("q", role + "-not-this-one", "consume")
        a.subscribe("q", "ca")
        with pytest.raises(pgque.InvalidGrant):
            a.grant_consumer("q", "ca", role + "-not-this-one")


@pytest.mark.parametrize("role", [None, "", "PUBLIC", "public", "pg_database_owner ",
                                  "Pgque_Admin", "'; drop schema pgque cascade; --"])
def test_grant_inputs_that_name_no_role_are_refused(world: World, role: str | None) -> None:
    """Held: null, empty, PUBLIC, other case, trailing blanks and quotes name no role."""
    with world.client("admin") as admin, world.client("a") as a:
        a.subscribe("q", "ca")
        for call in (lambda: admin.grant_queue("q", role, "send"),  # type: ignore[arg-type]
                     lambda: admin.revoke_queue("q", role, "send"),  # type: ignore[arg-type]
                     lambda: a.grant_consumer("q", "ca", role)):  # type: ignore[arg-type]
            assert refused(call, pgque.InvalidGrant)
        assert admin.queue_grants("q") == []
        assert scalar(world.su, "select to_regnamespace('pgque') is not null")


def test_a_role_oid_as_text_is_not_that_role(world: World) -> None:
    """Held: grants look roles up by name; b's oid as text is no role."""
    oid = scalar(world.su, "select oid::text from pg_roles where rolname = %s",
                 (world.roles["b"],))
    with world.client("a") as a, world.client("b") as b:
        a.subscribe("q", "ca")
        assert refused(lambda: a.grant_consumer("q", "ca", oid), pgque.InvalidGrant)
        assert refused(lambda: b.receive("q", "ca"), pgque.ConsumerAccessDenied)


def test_grant_consumer_on_slot_names_and_nulls(world: World) -> None:
    """Held: a slot subscription's name, a null consumer or queue grant nothing."""
    with world.client("a") as a, world.client("b") as b:
        a.subscribe_slots("q", "ga", slots=2)
        for consumer in ("ga#0/2", "ga#", None):
            state = sqlstate_of(partial(b.grant_consumer, "q", consumer, world.roles["b"]))  # type: ignore[arg-type]
            assert state in ("PQ002", "PQ004", "PQ014")
        assert sqlstate_of(lambda: b.grant_consumer(None, "ga", world.roles["b"])) == "PQ001"  # type: ignore[arg-type]
        assert refused(lambda: b.claim_slot("q", "ga", 0), pgque.ConsumerAccessDenied)
        assert refused(lambda: b.dead_letters("q", "ga#0/2"), pgque.ConsumerAccessDenied)


# ---------------------------------------------------------------------------
# Forging the caller
# ---------------------------------------------------------------------------

def test_the_caller_cannot_be_forged(world: World) -> None:
    """Held: set_config('role') to another team is refused by PostgreSQL, and a
    SECURITY DEFINER function of b's own is judged as b's session."""
    with world.client("a") as a, world.raw("b") as b:
        a.subscribe("q", "ca")
        assert refused(lambda: b.execute("select set_config('role', %s, false)",
                                         (world.roles["a"],)),
                       psycopg.errors.InsufficientPrivilege)
        b.execute("create function pg_temp.steal() returns bigint language sql "
                  "security definer as $$ select count(*) from pgque.receive('q', 'ca') $$")
        assert sqlstate_of(lambda: b.execute("select pg_temp.steal()")) == "PQ014"


def test_a_role_with_an_odd_name_owns_its_consumer(world: World) -> None:
    """Held: quotes, blanks and case in a role name neither break nor widen the checks."""
    odd = world.make_role(f'Team "Q"; {uuid.uuid4().hex[:6]} ', "login")
    ident = sql.Identifier(odd).as_string(world.su)
    world.su.execute(f"grant pgque_reader, pgque_writer to {ident}")
    with pgque.connect(world.dsn_for(odd)) as o, world.client("b") as b, \
            world.client("admin") as admin:
        assert o.subscribe("q", "co") is True
        assert refused(lambda: b.receive("q", "co"), pgque.ConsumerAccessDenied)
        assert o.grant_consumer("q", "co", world.roles["b"]) is True
        assert b.receive("q", "co") is None
        assert o.revoke_consumer("q", "co", world.roles["b"]) is True
        admin.grant_queue("q", odd, "send")
        assert ("send", odd) in admin.queue_grants("q")
        assert o.send("q", "e", 1) > 0
        assert refused(lambda: b.send("q", "e", 1), pgque.QueueAccessDenied)


# ---------------------------------------------------------------------------
# Advisory keys: prepared transactions, dropped owners
# ---------------------------------------------------------------------------

@pytest.fixture
def prepared_ok(pg_server: Any) -> None:
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
    """Held: an outsider reads the slot and group keys from pg_locks, takes them
    in a transaction it prepares (the locks outlive every session, pid null). Claims
    and joins renew the keys."""
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


def test_a_dropped_owner_leaves_its_group_to_the_admins(world: World) -> None:
    """Held: after the owning role is dropped (no dependency stops it), nobody but an
    admin may use its group, and the info views keep working (showing it to admins)."""
    gone = world.make_role(f"pgque_rv_owner_{uuid.uuid4().hex[:8]}", "login")
    world.su.execute(f"grant pgque_reader to {gone}")
    with pgque.connect(world.dsn_for(gone)) as g:
        g.subscribe_slots("q", "g", slots=1)
        assert g.claim_slot("q", "g", 0)
    world.su.execute(f"drop role {gone}")
    with world.client("b") as b, world.client("admin") as admin:
        assert refused(lambda: b.claim_slot("q", "g", 0), pgque.ConsumerAccessDenied)
        assert b.partition_slot_status() == []
        assert len(admin.partition_slot_status()) == 1
        assert admin.claim_slot("q", "g", 0) is True
        assert admin.unsubscribe_slots("q", "g") == 1


def test_an_outsider_cannot_wake_or_block_through_notify_or_row_locks(world: World) -> None:
    """Held (within what the docs admit): an outsider may NOTIFY the tick channel, but
    can lock no pgque row: every table is closed to it."""
    with world.client("a") as a, world.raw("outsider", autocommit=False) as evil:
        a.subscribe("q", "ca")
        channel = scalar(world.su, "select pgque.tick_channel('q')")
        evil.execute(f"notify {channel}")  # costs a poll, nothing more
        evil.commit()
        for statement in ("select 1 from pgque.subscription for update",
                          "lock table pgque.subscription in access share mode",
                          "select pgque.ack('q', 'ca', 1)"):
            assert refused(partial(evil.execute, statement), psycopg.errors.InsufficientPrivilege)
            evil.rollback()
        assert a.receive("q", "ca") is None
