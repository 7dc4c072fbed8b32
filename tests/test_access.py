"""Isolation between teams: consumers belong to the roles that made them, and queues
may be restricted per role (pgque/sql/code/base/access.sql)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from helpers import refused, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


@dataclass
class Team:
    role: str
    client: pgque.Client


@pytest.fixture
def teams(dsn: str) -> Iterator[dict[str, Team]]:
    """Two teams that may read and write (a, b), an admin, and a login role outside
    pgque; queue 'q' made by the superuser."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    grants = {"a": "pgque_reader, pgque_writer", "b": "pgque_reader, pgque_writer",
              "admin": "pgque_admin", "outsider": None}
    roles = {kind: f"pgque_team_{kind}_{suffix}" for kind in grants}
    made: dict[str, Team] = {}
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("select pgque.create_queue('q')")
        for kind, role in roles.items():
            su.execute(f"create role {role} login")
            if grants[kind]:
                su.execute(f"grant {grants[kind]} to {role}")
        try:
            for kind, role in roles.items():
                made[kind] = Team(role, pgque.connect(make_conninfo(**{**params, "user": role})))
            yield made
        finally:
            for team in made.values():
                team.client.close()
            for role in roles.values():
                su.execute(f"drop role if exists {role}")




def batch_of(client: pgque.Client, consumer: str) -> pgque.Batch[Any]:
    batch = client.receive("q", consumer)
    assert batch is not None
    return batch


def test_a_consumer_belongs_to_the_role_that_subscribed_it(teams: dict[str, Team]) -> None:
    a, b, admin = teams["a"].client, teams["b"].client, teams["admin"].client
    assert a.subscribe("q", "ca") is True
    a.send("q", "e", 1)
    admin.tick("q")
    denied = pgque.ConsumerAccessDenied
    assert refused(lambda: b.receive("q", "ca"), denied)
    assert refused(lambda: b.subscribe("q", "ca"), denied)  # not "already there": refused
    assert refused(lambda: b.unsubscribe("q", "ca"), denied)
    batch = batch_of(a, "ca")
    assert refused(lambda: b.nack(batch, batch.messages[0].id), denied)
    assert refused(lambda: b.ack(batch), denied)
    assert refused(lambda: b.ack(batch, nack=[batch.messages[0].id]), denied)
    # The owner's batch is untouched by all that: still open, the same events.
    again = batch_of(a, "ca")
    assert again.batch_id == batch.batch_id and len(again) == 1
    assert a.ack(again) is True
    # An admin may use it (e.g. to drain it), and its owner may drop it.
    assert admin.receive("q", "ca") is None
    assert a.unsubscribe("q", "ca") is True


def test_a_consumer_group_belongs_to_the_role_that_made_it(teams: dict[str, Team]) -> None:
    a, b, admin = teams["a"].client, teams["b"].client, teams["admin"].client
    a.subscribe_slots("q", "ga", slots=2)
    denied = pgque.ConsumerAccessDenied
    calls: list[Callable[[], Any]] = [
        lambda: b.subscribe_slots("q", "ga", slots=2),
        lambda: b.conn.execute("select pgque.subscribe_slot(%s, %s, 0, 2)", ("q", "ga")),
        lambda: b.join_group("q", "ga"),
        lambda: b.group_status("q", "ga"),
        lambda: b.slot_lock_key("q", "ga", 0),
        lambda: b.claim_slot("q", "ga", 0),
        lambda: b.release_slot("q", "ga", 0),
        lambda: b.receive_partitioned("q", "ga", slot=0, slots=2),
        lambda: b.unsubscribe_slots("q", "ga"),
    ]
    for call in calls:
        assert refused(call, denied)
    # Another team's group is not in b's views either.
    assert b.partition_slot_status("q") == [] and b.consumer_info("q") == []
    assert len(admin.partition_slot_status("q")) == 2
    assert a.claim_slot("q", "ga", 0) and a.join_group("q", "ga")
    assert admin.group_status("q", "ga").slots[0].owner_pid == a.pinned_pid
    assert a.unsubscribe_slots("q", "ga") == 2


def test_dead_letters_are_read_by_those_who_may_use_the_consumer(teams: dict[str, Team],
                                                                dsn: str) -> None:
    a, b, admin = teams["a"].client, teams["b"].client, teams["admin"].client
    admin.create_queue("dq", max_retries=0)
    a.subscribe("dq", "ca")
    b.subscribe("dq", "cb")
    a.send("dq", "e", 1)
    admin.tick("dq")
    for client, consumer in ((a, "ca"), (b, "cb")):
        batch = client.receive("dq", consumer)
        assert batch is not None
        client.nack(batch, batch.messages[0].id, reason=f"{consumer} failed")
        client.ack(batch)
    assert {d.consumer for d in a.dead_letters("dq")} == {"ca"}
    assert {d.consumer for d in b.dead_letters("dq")} == {"cb"}
    assert {d.consumer for d in admin.dead_letters("dq")} == {"ca", "cb"}
    assert refused(lambda: b.dead_letters("dq", "ca"), pgque.ConsumerAccessDenied)
    # Once the consumer is gone, its dead letters are the admins' only.
    a.unsubscribe("dq", "ca")
    assert a.dead_letters("dq") == []
    assert refused(lambda: a.dead_letters("dq", "ca"), pgque.ConsumerAccessDenied)
    assert [d.consumer for d in admin.dead_letters("dq", "ca")] == ["ca"]


def test_the_owner_grants_a_consumer_and_takes_it_back(teams: dict[str, Team]) -> None:
    a, b = teams["a"].client, teams["b"].client
    a.subscribe("q", "ca")
    a.subscribe_slots("q", "ga", slots=1)
    assert refused(lambda: b.grant_consumer("q", "ca", teams["b"].role),
                   pgque.ConsumerAccessDenied)  # only the owner or an admin grants
    assert a.grant_consumer("q", "ca", teams["b"].role) is True
    assert a.grant_consumer("q", "ca", teams["b"].role) is False
    assert a.grant_consumer("q", "ga", teams["b"].role) is True
    a.send("q", "e", 1)
    a.conn.execute("select 1")  # a's send is committed (autocommit)
    teams["admin"].client.tick("q")
    assert len(batch_of(b, "ca")) == 1
    assert b.claim_slot("q", "ga", 0) is True
    # A grantee may use the consumer, not hand it on.
    assert refused(lambda: b.grant_consumer("q", "ca", teams["admin"].role),
                   pgque.ConsumerAccessDenied)
    assert a.revoke_consumer("q", "ca", teams["b"].role) is True
    assert a.revoke_consumer("q", "ga", teams["b"].role) is True
    assert refused(lambda: b.receive("q", "ca"), pgque.ConsumerAccessDenied)
    # The slot lock b still holds is worth nothing now.
    assert refused(lambda: b.receive_partitioned("q", "ga", slot=0, slots=1),
                   pgque.ConsumerAccessDenied)
    with pytest.raises(pgque.InvalidGrant):
        a.grant_consumer("q", "ca", "no_such_role_" + uuid.uuid4().hex[:6])
    with pytest.raises(pgque.ConsumerNotFound):
        a.grant_consumer("q", "nobody", teams["b"].role)


def test_queue_grants_restrict_sending_and_consuming(teams: dict[str, Team]) -> None:
    a, b, admin = teams["a"].client, teams["b"].client, teams["admin"].client
    b.subscribe("q", "cb")  # before the queue is restricted
    assert refused(lambda: a.grant_queue("q", teams["a"].role, "send"),
                   psycopg.errors.InsufficientPrivilege)  # admins only
    assert admin.grant_queue("q", teams["a"].role, "send") is True
    assert admin.grant_queue("q", teams["a"].role, "consume") is True
    assert admin.grant_queue("q", teams["a"].role, "consume") is False
    assert sorted(b.queue_grants("q")) == [("consume", teams["a"].role),
                                           ("send", teams["a"].role)]
    denied = pgque.QueueAccessDenied
    assert refused(lambda: b.send("q", "e", 1), denied)
    assert refused(lambda: b.send_batch("q", [("e", 1)]), denied)
    assert refused(lambda: b.subscribe("q", "cb2"), denied)
    assert refused(lambda: b.subscribe_slots("q", "gb", slots=2), denied)
    assert refused(lambda: b.receive("q", "cb"), denied)  # its own consumer, made before
    ev = a.send("q", "e", 1)
    assert a.subscribe("q", "ca") is True
    assert admin.send("q", "e", 2) > ev  # admins are never restricted
    with pytest.raises(pgque.InvalidGrant):
        admin.grant_queue("q", teams["b"].role, "receive")
    with pytest.raises(pgque.InvalidGrant):
        admin.grant_queue("q", "no_such_role_" + uuid.uuid4().hex[:6], "send")
    # Revoking the last grant of a kind opens the queue again.
    assert admin.revoke_queue("q", teams["a"].role, "send") is True
    assert admin.revoke_queue("q", teams["a"].role, "send") is False
    assert b.send("q", "e", 3) > ev
    assert refused(lambda: b.receive("q", "cb"), denied)
    assert admin.revoke_queue("q", teams["a"].role, "consume") is True
    assert b.queue_grants("q") == []
    admin.tick("q")
    assert len(batch_of(b, "cb")) == 3


def test_a_team_role_shared_by_its_logins(teams: dict[str, Team], dsn: str) -> None:
    """Logins that SET ROLE to a team role subscribe for the team; every member of the
    team role may use the consumer, nobody else."""
    suffix = uuid.uuid4().hex[:8]
    team, alice, bob = (f"pgque_{n}_{suffix}" for n in ("team", "alice", "bob"))
    params = conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {team} nologin")
        su.execute(f"grant pgque_reader, pgque_writer to {team}")
        su.execute(f"create role {alice} login in role {team}")
        su.execute(f"create role {bob} login in role {team}")
        try:
            with pgque.connect(make_conninfo(**{**params, "user": alice})) as a1, \
                    pgque.connect(make_conninfo(**{**params, "user": bob})) as b1:
                a1.conn.execute(f"set role {team}")
                assert a1.subscribe("q", "shared") is True
                owner = su.execute("select sub_owner::regrole::text from pgque.subscription "
                                   "where sub_consumer = 'shared'").fetchone()
                assert owner == (team,)
                assert b1.receive("q", "shared") is None  # bob is in the team: allowed
                assert refused(lambda: teams["b"].client.receive("q", "shared"),
                               pgque.ConsumerAccessDenied)
        finally:
            su.execute(f"drop owned by {alice}, {bob}, {team}")
            su.execute(f"drop role {alice}, {bob}, {team}")


def test_a_consumer_made_before_owners_existed_stays_open_to_readers(
        teams: dict[str, Team], dsn: str) -> None:
    """Subscriptions from before 0.2 have no owner: every reader may use them, as then."""
    teams["a"].client.subscribe("q", "old")
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("update pgque.subscription set sub_owner = null where sub_consumer = 'old'")
    assert teams["b"].client.receive("q", "old") is None
    assert refused(lambda: teams["outsider"].client.receive("q", "old"),
                   psycopg.errors.InsufficientPrivilege)


def test_a_worker_of_another_team_stops_with_the_refusal(teams: dict[str, Team]) -> None:
    a, b = teams["a"], teams["b"]
    a.client.subscribe_slots("q", "ga", slots=2)
    worker = pgque.Worker(b.client.conn.info.dsn, queue="q", consumer="ga", slots=2,
                          handler=lambda message: None, ticker=False)
    with pytest.raises(pgque.ConsumerAccessDenied), worker:
        worker.wait(timeout=10)
    assert isinstance(worker.error, pgque.ConsumerAccessDenied)
    # Granted the group, the same worker runs and owns both slots.
    a.client.grant_consumer("q", "ga", b.role)
    worker = pgque.Worker(b.client.conn.info.dsn, queue="q", consumer="ga", slots=2,
                          handler=lambda message: None, ticker=False, rebalance_interval=0.1)
    with worker:
        wait_for(lambda: len(worker.owned_slots) == 2, what="both slots owned")
        assert worker.error is None


def test_a_group_named_like_another_teams_consumer_shows_nothing_of_it(
        teams: dict[str, Team]) -> None:
    """A name without '#' is a plain consumer in consumer_info and dead letters: b's
    group "x" opens neither the info nor the dead letters of a's plain consumer "x"."""
    a, b, admin = teams["a"].client, teams["b"].client, teams["admin"].client
    admin.create_queue("dq", max_retries=0)
    a.subscribe("dq", "x")
    b.subscribe_slots("dq", "x", slots=1)
    a.send("dq", "e", 1)
    admin.tick("dq")
    batch = a.receive("dq", "x")
    assert batch is not None
    a.ack(batch, nack=batch.messages)
    assert [d.consumer for d in a.dead_letters("dq")] == ["x"]
    assert b.dead_letters("dq") == []
    assert [c.consumer_name for c in b.consumer_info("dq")] == ["x#0/1"]
    assert {c.consumer_name for c in a.consumer_info("dq")} == {"x"}
