"""Lag per key (pgque.key_lag, Client.key_lag): the hot keys of a group, in the
recommended deployment (a non-superuser owner installed pgque, a team's login
reads its group, a producer login sends)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from helpers import scalar

import pgque
from pgque.errors import translated
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"
SLOTS = 4


@pytest.fixture
def team_client(pgque_deployment: Deployment) -> Iterator[pgque.Client]:
    deployment = pgque_deployment
    team = deployment.teams[0]
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue(QUEUE)
    with pgque.connect(deployment.dsn(deployment.login(team))) as client:
        client.conn.execute(f"set role {team}")
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
        client.conn.execute("reset role")
        yield client


def _send(deployment: Deployment, counts: dict[str | None, int]) -> list[int]:
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        ids = [int(i) for i in producer.send_batch(
            QUEUE, [("Order", {"n": n}, key) for key, count in counts.items()
                    for n in range(count)])]
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.tick(QUEUE)
    return ids


def test_the_keys_with_the_most_waiting_come_first_and_leave_once_consumed(
        pgque_deployment: Deployment, team_client: pgque.Client) -> None:
    client = team_client
    _send(pgque_deployment, {"cold": 5, "hot": 50, None: 3, "warm": 20})
    slot_of = dict(client.conn.execute(
        "select k, pgque.slot_of(k, %s) from unnest(%s::text[]) k",
        (SLOTS, ["hot", "warm", "cold"])).fetchall())
    lag = client.key_lag(QUEUE, GROUP, top=3)
    assert [(k.partition_key, k.slot, k.pending) for k in lag] == [
        ("hot", slot_of["hot"], 50), ("warm", slot_of["warm"], 20), ("cold", slot_of["cold"], 5)]
    sent_at = scalar(client.conn, "select max(oldest) from pgque.key_lag(%s, %s, 10)",
                     (QUEUE, GROUP))
    assert all(k.oldest == sent_at for k in lag)  # one transaction: one ev_time
    assert [(k.partition_key, k.slot, k.pending)
            for k in client.key_lag(QUEUE, GROUP)][3:] == [(None, 0, 3)]
    # The hot key's slot receives: its open batch still waits; once acked it is done.
    hot = slot_of["hot"]
    assert client.claim_slot(QUEUE, GROUP, hot)
    batch = client.receive_partitioned(QUEUE, GROUP, slot=hot, slots=SLOTS)
    assert batch is not None and batch.messages
    assert ("hot", 50) in [(k.partition_key, k.pending) for k in client.key_lag(QUEUE, GROUP)]
    client.ack(batch)
    while (more := client.receive_partitioned(QUEUE, GROUP, slot=hot, slots=SLOTS)) is not None:
        client.ack(more)
    assert hot not in {k.slot for k in client.key_lag(QUEUE, GROUP)}
    assert "hot" not in {k.partition_key for k in client.key_lag(QUEUE, GROUP)}
    # A failed event back in the log (a retry) waits again for its slot.
    _send(pgque_deployment, {"hot": 2})
    batch = client.receive_partitioned(QUEUE, GROUP, slot=hot, slots=SLOTS)
    assert batch is not None
    client.ack(batch, nack=[batch.messages[0]], retry_after=0)
    with pgque.connect(pgque_deployment.dsn(pgque_deployment.owner)) as owner:
        owner.maintenance(QUEUE)  # moves the retry back into the log
        owner.tick(QUEUE)
    assert ("hot", hot, 1) in [(k.partition_key, k.slot, k.pending)
                               for k in client.key_lag(QUEUE, GROUP)]
    client.release_slot(QUEUE, GROUP, hot)


def test_bad_arguments_and_roles_without_the_group_are_refused(
        pgque_deployment: Deployment, team_client: pgque.Client) -> None:
    deployment = pgque_deployment
    for top in (0, 10_001):
        with pytest.raises(pgque.InvalidArgument):
            team_client.key_lag(QUEUE, GROUP, top=top)
    with pytest.raises(pgque.ConsumerNotFound):
        team_client.key_lag(QUEUE, "nobody")
    with pytest.raises(pgque.QueueNotFound):
        team_client.key_lag("nowhere", GROUP)
    with pgque.connect(deployment.dsn(deployment.login(deployment.teams[1]))) as other, \
            pytest.raises(pgque.ConsumerAccessDenied):
        other.key_lag(QUEUE, GROUP)
    with psycopg.connect(deployment.dsn(deployment.outsider)) as outsider, \
            pytest.raises(psycopg.errors.InsufficientPrivilege), translated():
        outsider.execute("select * from pgque.key_lag(%s, %s)", (QUEUE, GROUP))
    assert team_client.key_lag(QUEUE, GROUP) == []  # nothing sent: nothing waits
