"""Attacks on the access model between teams (docs/operations.md "Security";
docs/concepts.md "Consumer groups and slots", "Claiming"; docs/design-notes.md
"Slot locks", "Privileges"), and what holds:

* another team's refused calls leave no lock its owner waits for, and an outsider
  can lock no row of pgque;
* a group and a plain consumer of one name are two things to grants;
* a session counts as the role it acts as (SET ROLE, also from a login that does
  not inherit), judged as the server shows it now, not as a transaction's old
  snapshot showed it;
* a reader sees nothing of another team's consumers;
* grants name roles exactly: no dropped role's leftovers, truncated names, oids or
  PUBLIC;
* the caller cannot be forged, an odd role name is a name like any other, and a
  dropped owner's group is the admins'.

Attackers: a login role with no pgque grant ("outsider"), a reader/writer of
another team ("b"), and a member of the owning team trying to exceed its rights.
Every victim connection runs with a statement timeout (helpers.World), so a stall
fails the test instead of hanging the suite."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import psycopg
import pytest
from helpers import World, refused, scalar, sqlstate_of, world_of
from psycopg import sql

import pgque


@pytest.fixture
def world(dsn: str) -> Iterator[World]:
    """Teams a and b, an admin and an outsider, each a login role (helpers.World)."""
    with world_of(dsn) as w:
        yield w


# -- another team's refused calls, an outsider's: no stall ------------------------------------


def test_a_refused_ack_by_another_team_does_not_stall_the_consumer(world: World) -> None:
    """Another team's refused ack or nack of a plain consumer (PQ014) leaves no row
    lock the owner waits for: not while its transaction sits aborted, nor once a
    savepoint rolled the refusal back and the transaction goes on open. The owner
    receives and acks meanwhile (its statement timeout would fail a wait)."""
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
    """The same through a slot subscription's name: another team's
    pgque.nack('q', 'ga#0/1', ...) is refused (PQ014 or PQ021) and holds up
    neither the slot's receive nor its ack."""
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


def test_an_outsider_cannot_wake_or_block_through_notify_or_row_locks(world: World) -> None:
    """An outsider may NOTIFY the tick channel (it costs a poll, as the docs admit),
    but can lock no pgque row: every table is closed to it."""
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


# -- a group and a plain consumer of one name --------------------------------------------------


def test_a_grantee_cannot_keep_its_grant_by_squatting_the_group_name(world: World) -> None:
    """grant_consumer and revoke_consumer act on the plain consumer and the group of
    one name. Team b, granted team a's plain consumer "x", subscribes a group
    named "x" of its own: a can still revoke b's access to its consumer, and b is
    refused it from then on."""
    with world.client("a") as a, world.client("b") as b:
        a.subscribe("q", "x")
        assert a.grant_consumer("q", "x", world.roles["b"])
        b.subscribe_slots("q", "x", slots=1)  # b's own group, same name
        assert a.revoke_consumer("q", "x", world.roles["b"]) is True
        assert refused(lambda: b.receive("q", "x"), pgque.ConsumerAccessDenied)


def test_a_group_of_the_same_name_gives_no_access_to_the_plain_consumer(world: World) -> None:
    """b's group "x" does not open a's plain consumer "x" to b, and a grant b makes on
    "x" changes its own group only."""
    with world.client("a") as a, world.client("b") as b:
        a.subscribe("q", "x")
        b.subscribe_slots("q", "x", slots=1)
        assert refused(lambda: b.receive("q", "x"), pgque.ConsumerAccessDenied)
        b.grant_consumer("q", "x", world.roles["b"])
        assert refused(lambda: b.receive("q", "x"), pgque.ConsumerAccessDenied)
        assert refused(lambda: b.unsubscribe("q", "x"), pgque.ConsumerAccessDenied)
        assert refused(lambda: a.claim_slot("q", "x", 0), pgque.ConsumerAccessDenied)


# -- a session counts as the role it acts as -------------------------------------------------


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
    """The documented pattern is to SET ROLE to the team. A login that does not
    inherit (NOINHERIT, or PG16's GRANT ... WITH INHERIT FALSE) and acts as its team
    counts as the owner of the slot it claimed and as a member: group_status shows
    the slot its own, one member, and its rank."""
    _team, dsn1, _dsn2 = _noinherit_team(world)
    with pgque.connect(dsn1) as w1:
        w1.subscribe_slots("q", "g", slots=2)
        assert w1.claim_slot("q", "g", 0) and w1.join_group("q", "g")
        status = w1.group_status("q", "g")
        assert status.slots[0].owner_pid == w1.pinned_pid and status.slots[0].mine
        assert status.members == 1 and status.my_rank == 0


def test_a_noinherit_teammate_cannot_take_a_slot_another_one_owns(world: World) -> None:
    """Two such logins of one team: the second one's claim of a slot the first owns is
    refused, and the first goes on receiving and acking."""
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
    """A Worker on such a login is a member of its group: it claims every slot and
    runs without an error."""
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
    """The same for the ticker election: an admin login that does not inherit and acts
    through SET ROLE pgque_admin is the active ticker once it claimed the election,
    and a second such login is refused it."""
    suffix = uuid.uuid4().hex[:8]
    logins = [world.make_role(f"pgque_rv_tick{i}_{suffix}", "login noinherit in role pgque_admin")
              for i in (1, 2)]
    dsn1, dsn2 = (world.dsn_for(name, "-c role=pgque_admin") for name in logins)
    with pgque.connect(dsn1) as t1, pgque.connect(dsn2) as t2:
        assert t1.claim_ticker() is True
        assert t1.active_ticker() == t1.conn.info.backend_pid
        assert t2.claim_ticker() is False


def test_a_claim_in_a_long_transaction_does_not_displace_a_newer_owner(world: World) -> None:
    """pg_stat_activity is snapshotted once per transaction. A teammate whose
    transaction read it (group_status here) before a worker connected does not
    take that worker's lock for an outsider's: its claim_slot of the worker's slot
    is refused, and the worker keeps the slot. (Client(conn) runs calls in the
    caller's transaction: the Python API reaches this as well.)"""
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


# -- what a reader sees of another team ------------------------------------------------------


def test_a_reader_of_another_team_does_not_read_its_cursors_in_the_info_views(
        world: World) -> None:
    """docs/operations.md: a reader of another team "cannot read or change events,
    cursors, consumers or queues" of that team. consumer_info does not list the
    other team's consumer of a queue restricted to it, and partition_slot_status
    does not list its group."""
    with world.client("a") as a, world.client("b") as b, world.client("admin") as admin:
        admin.create_queue("private")
        admin.grant_queue("private", world.roles["a"], "consume")
        a.subscribe("private", "ca")
        a.subscribe_slots("q", "ga", slots=2)
        seen = {(r.queue_name, r.consumer_name) for r in b.consumer_info()}
        assert ("private", "ca") not in seen
        assert not any(r.consumer_name == "ga" for r in b.partition_slot_status())


# -- grants name roles exactly ---------------------------------------------------------------


def test_a_grant_of_a_dropped_role_can_be_revoked(world: World) -> None:
    """Grants are kept by oid. After the role is dropped, queue_grants shows the grant
    under the bare oid, and revoke_queue takes what it shows: the grant goes, and
    the queue is open to every writer again."""
    gone = world.make_role(f"pgque_rv_gone_{uuid.uuid4().hex[:8]}")
    with world.client("admin") as admin, world.client("b") as b:
        admin.grant_queue("q", gone, "send")
        world.su.execute(f"drop role {gone}")
        [(privilege, shown)] = admin.queue_grants("q")
        assert privilege == "send"
        assert admin.revoke_queue("q", shown, "send") is True
        assert b.send("q", "e", 1) > 0  # open again to every writer


def test_a_grant_to_an_overlong_name_is_refused(world: World) -> None:
    """A role argument longer than a name (63 bytes) names no role, even when its
    first 63 bytes name one: grant_queue and grant_consumer refuse it
    (InvalidGrant) instead of granting the role it would be truncated to."""
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
    """Null, empty, PUBLIC, other case, trailing blanks and quotes name no role."""
    with world.client("admin") as admin, world.client("a") as a:
        a.subscribe("q", "ca")
        for call in (lambda: admin.grant_queue("q", role, "send"),  # type: ignore[arg-type]
                     lambda: admin.revoke_queue("q", role, "send"),  # type: ignore[arg-type]
                     lambda: a.grant_consumer("q", "ca", role)):  # type: ignore[arg-type]
            assert refused(call, pgque.InvalidGrant)
        assert admin.queue_grants("q") == []
        assert scalar(world.su, "select to_regnamespace('pgque') is not null")


def test_a_role_oid_as_text_is_not_that_role(world: World) -> None:
    """Grants look roles up by name; b's oid as text is no role."""
    oid = scalar(world.su, "select oid::text from pg_roles where rolname = %s",
                 (world.roles["b"],))
    with world.client("a") as a, world.client("b") as b:
        a.subscribe("q", "ca")
        assert refused(lambda: a.grant_consumer("q", "ca", oid), pgque.InvalidGrant)
        assert refused(lambda: b.receive("q", "ca"), pgque.ConsumerAccessDenied)


def test_grant_consumer_on_slot_names_and_nulls(world: World) -> None:
    """A slot subscription's name, a null consumer or queue grant nothing."""
    with world.client("a") as a, world.client("b") as b:
        a.subscribe_slots("q", "ga", slots=2)
        for consumer in ("ga#0/2", "ga#", None):
            state = sqlstate_of(partial(b.grant_consumer, "q", consumer, world.roles["b"]))  # type: ignore[arg-type]
            assert state in ("PQ002", "PQ004", "PQ014")
        assert sqlstate_of(lambda: b.grant_consumer(None, "ga", world.roles["b"])) == "PQ001"  # type: ignore[arg-type]
        assert refused(lambda: b.claim_slot("q", "ga", 0), pgque.ConsumerAccessDenied)
        assert refused(lambda: b.dead_letters("q", "ga#0/2"), pgque.ConsumerAccessDenied)


# -- the caller, and roles that are odd or gone ----------------------------------------------


def test_the_caller_cannot_be_forged(world: World) -> None:
    """set_config('role') to another team is refused by PostgreSQL, and a SECURITY
    DEFINER function of b's own is judged as b's session."""
    with world.client("a") as a, world.raw("b") as b:
        a.subscribe("q", "ca")
        assert refused(lambda: b.execute("select set_config('role', %s, false)",
                                         (world.roles["a"],)),
                       psycopg.errors.InsufficientPrivilege)
        b.execute("create function pg_temp.steal() returns bigint language sql "
                  "security definer as $$ select count(*) from pgque.receive('q', 'ca') $$")
        assert sqlstate_of(lambda: b.execute("select pg_temp.steal()")) == "PQ014"


def test_a_role_with_an_odd_name_owns_its_consumer(world: World) -> None:
    """Quotes, blanks and case in a role name neither break nor widen the checks."""
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


def test_a_dropped_owner_leaves_its_group_to_the_admins(world: World) -> None:
    """After the owning role is dropped (no dependency stops it), nobody but an admin
    may use its group, and the info views keep working (showing it to admins)."""
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
