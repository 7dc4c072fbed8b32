"""Slot ownership by lease (pgque/sql/code/slots/lease.sql), call by call.

A group set to ``ownership='lease'`` owns its slots by leases with an expiry,
named by tokens that every owner call carries, so that its clients may sit
behind a transaction-mode pooler. These tests drive the Client's calls, most
of them through a real PgBouncer in transaction mode with other clients'
traffic, so that consecutive calls land on different server sessions: a claim,
receive and ack must work there; a second lease must not get a slot whose
lease lives; an expired lease must change nothing, and its epoch must be
fenced out; the two modes must not mix. (The Worker's lease mode:
tests/test_lease_worker.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from psycopg.conninfo import conninfo_to_dict
from test_pooler import churn

import pgque

LEASE = 1.0  # seconds: short, so that expiry is quick to wait for


def dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


@pytest.fixture
def pooled(dsn: str, pgbouncer: Any) -> Iterator[str]:
    """The test database through PgBouncer in transaction mode, with traffic."""
    url = pgbouncer.dsn(dbname(dsn))
    with churn(url, clients=2):
        yield url


def pooled_client(url: str) -> pgque.Client:
    """A client through the pooler (prepared statements off: PgBouncer 1.18)."""
    return pgque.connect(url, prepare_threshold=None, pool_size=0)


def lease_group(client: pgque.Client, *, slots: int = 2, lease: float = LEASE) -> list[int]:
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=slots)
    assert client.set_ownership("q", "g", "lease", lease=lease)
    ids = client.send_batch("q", [("e", {"n": n}, "k") for n in range(5)])
    client.tick("q")
    return ids


def test_a_lease_claims_receives_and_acks_behind_a_transaction_pooler(
        client: pgque.Client, pooled: str) -> None:
    ids = lease_group(client, lease=30)
    slot = scalar(client.conn, "select pgque.slot_of('k', 2)")
    with pooled_client(pooled) as owner:
        lease = owner.take_lease("q", "g", name="owner", member=True)
        assert "token" not in repr(lease) and lease.token not in repr(lease)
        assert lease.lease == timedelta(seconds=30)
        pids = set()
        assert owner.claim_slot("q", "g", slot)
        for _ in range(20):  # calls on different server sessions
            pids.add(scalar(owner.conn, "select pg_backend_pid()"))
            status = owner.group_status("q", "g")
            assert status.members == 1 and status.my_rank == 0
            assert status.owned == [slot]
        assert len(pids) > 1, "the pooler gave every call the same server session"
        batch = owner.receive_partitioned("q", "g", slot=slot, slots=2)
        assert batch is not None and [m.id for m in batch] == ids
        epoch = batch.messages[0].fence.epoch
        owner.check_fence(batch.messages[0].fence)
        owner.ack(batch)
        assert owner.release_slot("q", "g", slot)
        assert not owner.release_slot("q", "g", slot)
        assert owner.group_status("q", "g").owned == []
        # Released: its epoch is over, and the next claim takes a new one.
        with pytest.raises(pgque.StaleEpoch):
            client.check_fence(batch.messages[0].fence)
        assert owner.claim_slot("q", "g", slot)
        assert scalar(client.conn, "select max(sc_epoch) from pgque.slot_claim") > epoch
        assert owner.end_lease() == 1
        assert owner.lease is None


def test_an_expired_lease_changes_nothing_and_its_epoch_is_fenced_out(
        client: pgque.Client, pooled: str) -> None:
    ids = lease_group(client)
    slot = scalar(client.conn, "select pgque.slot_of('k', 2)")
    with pooled_client(pooled) as old, pooled_client(pooled) as new:
        old.take_lease("q", "g", name="old")
        new.take_lease("q", "g", name="new")
        assert old.claim_slot("q", "g", slot)
        assert not new.claim_slot("q", "g", slot)  # a live lease holds it
        batch = old.receive_partitioned("q", "g", slot=slot, slots=2)
        assert batch is not None
        fence = batch.messages[0].fence
        client.check_fence(fence)
        # The old holder stops renewing (frozen, cut off): once its lease has
        # expired its epoch is fenced out, before anyone claims the slot.
        wait_for(lambda: _stale(client, fence), timeout=10, what="the epoch to go stale")
        assert owner_of(client, slot) is None
        for call in (lambda: old.ack(batch),
                     lambda: old.receive_partitioned("q", "g", slot=slot, slots=2),
                     lambda: old.nack(batch, [batch.messages[0]], retry_after=0),
                     lambda: old.claim_slot("q", "g", slot), old.renew_lease,
                     lambda: old.release_slot("q", "g", slot)):
            with pytest.raises(pgque.LeaseExpired):
                call()
        new.take_lease("q", "g", name="new")  # its first expired meanwhile too
        assert new.claim_slot("q", "g", slot)
        again = new.receive_partitioned("q", "g", slot=slot, slots=2)
        assert again is not None and [m.id for m in again] == ids  # nothing was acked
        assert again.messages[0].fence.epoch > fence.epoch
        with pytest.raises(pgque.StaleEpoch):
            client.check_fence(fence)
        new.ack(again)


def _stale(client: pgque.Client, fence: pgque.Fence) -> bool | None:
    try:
        client.check_fence(fence)
    except pgque.StaleEpoch:
        return True
    return None


def owner_of(client: pgque.Client, slot: int) -> int | None:
    return client.group_status("q", "g").slots[slot].owner_pid


def test_a_renewed_lease_keeps_its_slot_past_its_lease_time(
        client: pgque.Client, pooled: str) -> None:
    lease_group(client)
    with pooled_client(pooled) as owner, pooled_client(pooled) as other:
        lease = owner.take_lease("q", "g", name="owner")
        others = other.take_lease("q", "g", name="other")
        assert owner.claim_slot("q", "g", 0)
        renewed_until = scalar(client.conn, "select clock_timestamp() + interval '3 seconds'")
        while scalar(client.conn, "select clock_timestamp()") < renewed_until:
            assert owner.renew_lease() == timedelta(seconds=LEASE)
            assert other.renew_lease() == timedelta(seconds=LEASE)
            assert not other.claim_slot("q", "g", 0)
            assert owner_of(client, 0) == lease.id
            # A third of the lease between renewals, as the Worker renews.
            scalar(client.conn, "select pg_sleep(%s)", (LEASE / 3,))
        assert owner.renew_leases([lease, others]) == {lease.id, others.id}
        owner.end_lease()
        assert owner.renew_leases([lease, others]) == {others.id}


def test_the_two_modes_do_not_mix(client: pgque.Client, dsn: str, pooled: str) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    with pgque.connect(dsn) as advisory:
        assert advisory.claim_slot("q", "g", 0)
        # In use by an advisory lock: the mode stays.
        with pytest.raises(pgque.OwnershipMismatch, match="in use"):
            client.set_ownership("q", "g", "lease")
        with pooled_client(pooled) as leaser, pytest.raises(pgque.OwnershipMismatch):
            leaser.take_lease("q", "g", name="x")
        assert advisory.release_slot("q", "g", 0)
        assert client.set_ownership("q", "g", "lease", lease=5)
        assert not client.set_ownership("q", "g", "lease", lease=7)  # only the time
        assert scalar(client.conn, "select cg_lease from pgque.consumer_group") == \
            timedelta(seconds=7)
        # Without a lease, on a group that owns by lease: refused, not ignored.
        for call in (lambda: advisory.claim_slot("q", "g", 1),
                     lambda: advisory.join_group("q", "g")):
            with pytest.raises(pgque.OwnershipMismatch, match="without one"):
                call()
        with pooled_client(pooled) as leaser:
            leaser.take_lease("q", "g", name="x", member=True)
            with pytest.raises(pgque.OwnershipMismatch, match="in use"):
                client.set_ownership("q", "g", "advisory")
            leaser.end_lease()
        assert client.set_ownership("q", "g", "advisory")
        assert advisory.claim_slot("q", "g", 1)
    for mode, lease in (("leases", 5.0), ("lease", 0.5), ("lease", 7200.0)):
        with pytest.raises(pgque.InvalidArgument):
            client.set_ownership("q", "g", mode, lease=lease)


def test_a_lease_token_is_no_key_for_another_role_or_group(
        pgque_deployment: pgque.testing.Deployment) -> None:
    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue("q")
    billing, shipping = deployment.teams
    clients = {}
    try:
        for team in (billing, shipping):
            clients[team] = pgque.connect(deployment.dsn(deployment.login(team)))
            clients[team].conn.execute(f"set role {team}")
            clients[team].subscribe_slots("q", f"g_{team}", slots=2)
            clients[team].set_ownership("q", f"g_{team}", "lease")
        lease = clients[billing].take_lease("q", f"g_{billing}", name="b")
        assert clients[billing].claim_slot("q", f"g_{billing}", 0)
        # Shipping, even holding billing's token, may not use billing's group.
        clients[shipping].lease = lease
        with pytest.raises(pgque.ConsumerAccessDenied):
            clients[shipping].receive_partitioned("q", f"g_{billing}", slot=0, slots=2)
        with pytest.raises(pgque.ConsumerAccessDenied):
            clients[shipping].take_lease("q", f"g_{billing}", name="s")
        # Nor end or renew billing's lease with it (a trigger of shipping's in
        # billing's transaction could read the token there).
        with pytest.raises(pgque.ConsumerAccessDenied):
            clients[shipping].end_lease(lease)
        assert clients[shipping].renew_leases([lease]) == set()
        assert clients[billing].renew_lease() == timedelta(seconds=15)
        # A lease of one group claims nothing of another.
        with pytest.raises(pgque.LeaseExpired, match="not one of group"):
            clients[shipping].claim_slot("q", f"g_{shipping}", 0)
        with pgque.connect(deployment.dsn(deployment.outsider)) as outsider, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            outsider.take_lease("q", f"g_{billing}", name="o")
    finally:
        for each in clients.values():
            each.close()


def test_a_bad_token_or_name_is_refused(client: pgque.Client) -> None:
    lease_group(client)
    with pytest.raises(pgque.InvalidArgument):
        client.take_lease("q", "g", name="")
    client.lease = pgque.Lease(id=0, token="short", lease=timedelta(seconds=1))
    with pytest.raises(pgque.InvalidArgument, match="32 to 64"):
        client.claim_slot("q", "g", 0)
    client.lease = pgque.Lease(id=0, token="x" * 40, lease=timedelta(seconds=1))
    with pytest.raises(pgque.LeaseExpired):
        client.claim_slot("q", "g", 0)


def test_the_ticker_election_by_lease(client: pgque.Client, dsn: str) -> None:
    a, b = "a" * 32, "b" * 32
    assert client.claim_ticker_lease(a, "ticker-a", LEASE)
    assert not client.claim_ticker_lease(b, "ticker-b", LEASE)
    assert [row[0] for row in client.conn.execute("select name from pgque.ticker_lease()")] \
        == ["ticker-a"]
    with pgque.connect(dsn) as advisory:
        assert not advisory.claim_ticker()  # a live lease is the active ticker
        wait_for(lambda: client.claim_ticker_lease(b, "ticker-b", LEASE) or None, timeout=10,
                 what="ticker-b to take over once ticker-a's lease expired")
        assert client.release_ticker_lease(b)
        assert advisory.claim_ticker()
        assert not client.claim_ticker_lease(a, "ticker-a", LEASE)  # the lock holds it


def test_a_lease_whose_role_lost_the_group_owns_nothing(
        pgque_deployment: pgque.testing.Deployment) -> None:
    """A role granted a group takes a lease and claims a slot; the grant is
    revoked: its lease no longer keeps the slot from the group's owner, whose
    claim succeeds at once (as a session of a role that lost the group does not
    count either), and its calls are refused."""
    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue("q")
    billing, shipping = deployment.teams
    with pgque.connect(deployment.dsn(deployment.login(billing))) as bill, \
            pgque.connect(deployment.dsn(deployment.login(shipping))) as ship:
        bill.conn.execute(f"set role {billing}")
        ship.conn.execute(f"set role {shipping}")
        bill.subscribe_slots("q", "g", slots=2)
        bill.set_ownership("q", "g", "lease", lease=3600)
        bill.grant_consumer("q", "g", shipping)
        ship.take_lease("q", "g", name="ship")
        assert ship.claim_slot("q", "g", 0)
        bill.take_lease("q", "g", name="bill")
        assert not bill.claim_slot("q", "g", 0)
        bill.revoke_consumer("q", "g", shipping)
        assert bill.claim_slot("q", "g", 0)
        with pytest.raises(pgque.ConsumerAccessDenied):
            ship.receive_partitioned("q", "g", slot=0, slots=2)


def test_the_info_views_and_metrics_show_owners_by_lease(client: pgque.Client) -> None:
    lease_group(client, lease=30)
    with pgque.connect(client.conn.info.dsn) as owner:
        lease = owner.take_lease("q", "g", name="billing-1-lane1", member=True)
        assert owner.claim_slot("q", "g", 0)
        [mine, free] = client.partition_slot_status("q")
        assert (mine.owner_lease, mine.owner_name, mine.owner_pid, mine.owned) == \
            (lease.id, "billing-1-lane1", None, True)
        assert (free.owner_lease, free.owned) == (None, False)
        [group] = client.group_info("q")
        assert (group.members, group.owned_slots) == (1, 1)
        figures = {(metric, labels): value for metric, labels, value in client.conn.execute(
            "select metric, labels, value from pgque.metrics()")}
        assert figures[("pgque_group_members", 'queue="q",group="g"')] == 1
        assert figures[("pgque_slot_owned", 'queue="q",group="g",slot="0"')] == 1
        assert figures[("pgque_slot_owned", 'queue="q",group="g",slot="1"')] == 0
        assert figures[("pgque_slot_owner_info",
                        'queue="q",group="g",slot="0",owner="billing-1-lane1",pid=""')] == 1
        owner.end_lease()
        assert not client.partition_slot_status("q")[0].owned


def test_maintenance_deletes_leases_expired_a_while_and_ids_are_bigint(
        client: pgque.Client) -> None:
    lease_group(client, lease=30)
    client.conn.execute("alter table pgque.lease alter column lease_id restart with 3000000000")
    with pgque.connect(client.conn.info.dsn) as owner:
        lease = owner.take_lease("q", "g", name="big", member=True)
        assert lease.id >= 3_000_000_000
        assert owner.claim_slot("q", "g", 1)
        assert owner.group_status("q", "g").slots[1].owner_pid == lease.id
        assert owner.group_status("q", "g").slots[1].mine
        client.conn.execute("update pgque.lease set lease_until = clock_timestamp() "
                            "- interval '2 minutes'")
    assert scalar(client.conn, "select count(*) from pgque.lease") == 1
    assert ("leases", 1) in [(step, amount) for _, step, amount in client.conn.execute(
        "select * from pgque.maint()")]
    assert scalar(client.conn, "select count(*) from pgque.lease") == 0
    assert owner_of(client, 1) is None


def test_a_lock_taken_by_hand_owns_nothing_in_a_group_that_owns_by_lease(
        client: pgque.Client, dsn: str) -> None:
    """A session that read a slot's lock key while the group owned by lock, and
    takes that lock by hand once it owns by lease, must not pass for an owner
    beside the lease that holds the slot (one owner per slot); nor may the key
    be read any more."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=2)
    key = client.slot_lock_key("q", "g", 0)
    assert client.set_ownership("q", "g", "lease", lease=30)
    client.send_batch("q", [("e", {"n": n}, "k") for n in range(3)])
    client.tick("q")
    with pgque.connect(dsn) as owner, pgque.connect(dsn) as by_hand:
        owner.take_lease("q", "g", name="owner")
        slot = scalar(client.conn, "select pgque.slot_of('k', 2)")
        assert owner.claim_slot("q", "g", slot)
        for k in (key, client.conn.execute(
                "select s.sub_lock_key from pgque.subscription s "
                "where s.sub_consumer = pgque._slot_name('g', %s, 2)", (slot,)).fetchone()[0]):
            by_hand.conn.execute("select pg_advisory_lock(%s), pg_advisory_lock(%s)", (k, k))
        with pytest.raises(pgque.SlotNotOwned):
            by_hand.receive_partitioned("q", "g", slot=slot, slots=2)
        with pytest.raises(pgque.OwnershipMismatch):
            by_hand.slot_lock_key("q", "g", slot)
        assert owner.receive_partitioned("q", "g", slot=slot, slots=2) is not None


def test_the_pause_verbs_see_a_head_handed_out_by_lease(client: pgque.Client, dsn: str) -> None:
    """skip_head refuses (HeadInFlight) while a lease owner has the blocked key's
    head in hand, as it does while a lock owner has (it looked at the lock
    only, found nobody, and voided the owner's piece)."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    client.set_failure_policy("q", "g", "pause")
    client.set_ownership("q", "g", "lease", lease=30)
    with pgque.connect(dsn) as owner:
        owner.take_lease("q", "g", name="owner")
        assert owner.claim_slot("q", "g", 0)
        client.send_batch("q", [("e", {"n": n}, "a") for n in range(2)])
        client.tick("q")
        batch = owner.receive_partitioned("q", "g", slot=0, slots=1)
        assert batch is not None
        owner.ack(batch, nack=[batch.messages[0].id], retry_after=3600)
        client.retry_head("q", "g", "a")
        held = owner.receive_partitioned("q", "g", slot=0, slots=1)
        assert held is not None and held.messages[0].id == batch.messages[0].id
        with pytest.raises(pgque.HeadInFlight):
            client.skip_head("q", "g", "a")
        owner.ack(held)
