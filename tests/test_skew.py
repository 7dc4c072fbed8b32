"""How evenly a group's keys spread over its slots (pgque.slot_skew, ``pgque
skew``), in the recommended deployment: a team's login reads its own group,
a producer login sends."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import scalar

import pgque
from pgque import cli
from pgque.errors import translated
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"
SLOTS = 4
SKEW = "select slot, events, keys, share, load, since from pgque.slot_skew(%s, %s, %s)"


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


def _send(deployment: Deployment, counts: dict[str | None, int]) -> None:
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        producer.send_batch(QUEUE, [("Order", {"n": n}, key) for key, count in counts.items()
                                    for n in range(count)])


def _expected(conn: psycopg.Connection[Any],
              counts: dict[str | None, int]) -> tuple[dict[int, int], dict[int, int]]:
    """Events and distinct keys per slot, routed by pgque's own pgque.slot_of."""
    keys = [k for k in counts if k is not None]
    slot_of: dict[str | None, int] = dict(conn.execute(
        "select k, pgque.slot_of(k, %s) from unnest(%s::text[]) k", (SLOTS, keys)).fetchall())
    slot_of[None] = 0
    events: Counter[int] = Counter()
    distinct: Counter[int] = Counter()
    for key, count in counts.items():
        events[slot_of[key]] += count
        distinct[slot_of[key]] += 1
    return ({k: events[k] for k in range(SLOTS)}, {k: distinct[k] for k in range(SLOTS)})


def _events(conn: psycopg.Connection[Any]) -> str:
    """The queue's event table (the parent of its rotating ones)."""
    queue_id = scalar(conn, "select queue_id from pgque.queue where queue_name = %s", (QUEUE,))
    return f"event_{queue_id}"


COUNTS: dict[str | None, int] = {"hot": 40, None: 5, **{f"k{n}": n % 4 + 1 for n in range(20)}}


def test_the_events_of_a_window_per_slot_as_routed(pgque_deployment: Deployment,
                                                   team_client: pgque.Client) -> None:
    conn = team_client.conn
    _send(pgque_deployment, COUNTS)
    events, keys = _expected(conn, COUNTS)
    total = sum(COUNTS.values())
    rows = conn.execute(SKEW, (QUEUE, GROUP, timedelta(minutes=5))).fetchall()
    assert [r[0] for r in rows] == list(range(SLOTS))
    assert {r[0]: r[1] for r in rows} == events
    assert {r[0]: r[2] for r in rows} == keys
    for _slot, n, _, share, load, _ in rows:
        assert share == pytest.approx(n / total)
        assert load == pytest.approx(n * SLOTS / total)
    # The queue is younger than the window: it starts at the queue's first tick.
    with psycopg.connect(pgque_deployment.superuser_dsn()) as su:
        assert rows[0][5] == scalar(su, "select min(tick_time) from pgque.tick")
    assert len({r[5] for r in rows}) == 1
    # A window of any length is one that reaches back further than the log.
    for huge in ("178000000 years", "1000000 days"):
        assert conn.execute(SKEW, (QUEUE, GROUP, huge)).fetchall() == rows

    # A retry moved back into the log is delivered again, not sent: not counted.
    slot = max(events, key=lambda k: events[k])
    assert team_client.claim_slot(QUEUE, GROUP, slot)
    with pgque.connect(pgque_deployment.dsn(pgque_deployment.owner)) as owner:
        owner.tick(QUEUE)
        batch = team_client.receive_partitioned(QUEUE, GROUP, slot=slot, slots=SLOTS)
        assert batch is not None
        team_client.ack(batch, nack=batch.messages[:3], retry_after=0)
        owner.maintenance(QUEUE)  # the retries, back in the log
        assert scalar(owner.conn, f"select count(*) from pgque.{_events(owner.conn)}"
                                  " where ev_owner is not null") == 3
    assert conn.execute(SKEW, (QUEUE, GROUP, timedelta(minutes=5))).fetchall() == rows


def test_the_window_leaves_out_what_was_sent_before(pgque_deployment: Deployment,
                                                    team_client: pgque.Client) -> None:
    """Events sent before the window's start are not counted: the read starts at the
    newest tick made before it. Here an hour passes, as far as the events and the
    ticks say."""
    deployment = pgque_deployment
    conn = team_client.conn
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        _send(deployment, {"old": 7})
        owner.tick(QUEUE)
        with psycopg.connect(deployment.superuser_dsn(), autocommit=True) as su:
            su.execute("update pgque.tick set tick_time = tick_time - interval '1 hour'")
            su.execute(f"update pgque.{_events(su)} set ev_time = ev_time - interval '1 hour'")
        fresh = {"a": 3, "b": 2, None: 1}
        _send(deployment, fresh)
        owner.tick(QUEUE)
    rows = conn.execute(SKEW, (QUEUE, GROUP, timedelta(minutes=10))).fetchall()
    assert {r[0]: r[1] for r in rows} == _expected(conn, fresh)[0]
    now = scalar(conn, "select now()")
    assert now - timedelta(minutes=10, seconds=5) < rows[0][5] <= now - timedelta(minutes=10)
    # Two hours back: the old events too.
    rows = conn.execute(SKEW, (QUEUE, GROUP, timedelta(hours=2))).fetchall()
    assert sum(r[1] for r in rows) == 7 + 6
    # An empty window: every slot, nothing to share.
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue("quiet")
    with psycopg.connect(deployment.superuser_dsn(), autocommit=True) as su:
        su.execute("select pgque.subscribe_slots('quiet', 'g', 2)")
        assert su.execute("select slot, events, keys, share, load from "
                          "pgque.slot_skew('quiet', 'g')").fetchall() == [
            (0, 0, 0, None, None), (1, 0, 0, None, None)]


def test_unknown_queue_or_group_bad_window_and_roles_without_the_group_are_refused(
        pgque_deployment: Deployment, team_client: pgque.Client) -> None:
    deployment = pgque_deployment

    def skew(conn: psycopg.Connection[Any], queue: str, group: str,
             window: timedelta | None = timedelta(minutes=1)) -> Any:
        with translated():
            return conn.execute(SKEW, (queue, group, window)).fetchall()

    conn = team_client.conn
    with pytest.raises(pgque.QueueNotFound):
        skew(conn, "nowhere", GROUP)
    with pytest.raises(pgque.ConsumerNotFound):
        skew(conn, QUEUE, "nobody")
    for window in (timedelta(0), timedelta(seconds=-1), None):
        with pytest.raises(pgque.InvalidArgument):
            skew(conn, QUEUE, GROUP, window)
    with pgque.connect(deployment.dsn(deployment.login(deployment.teams[1]))) as other, \
            pytest.raises(pgque.ConsumerAccessDenied):
        skew(other.conn, QUEUE, GROUP)
    with psycopg.connect(deployment.dsn(deployment.outsider)) as outsider, \
            pytest.raises(psycopg.errors.InsufficientPrivilege):
        skew(outsider, QUEUE, GROUP)


def test_the_command_prints_the_slots_and_the_largest_load(
        pgque_deployment: Deployment, team_client: pgque.Client,
        capsys: pytest.CaptureFixture[str]) -> None:
    deployment = pgque_deployment
    dsn = deployment.dsn(deployment.login(deployment.teams[0]))
    _send(deployment, COUNTS)
    events, _ = _expected(team_client.conn, COUNTS)
    busiest = max(range(SLOTS), key=lambda k: (events[k], -k))

    def run(*args: str) -> tuple[int | str | None, str, str]:
        with pytest.raises(SystemExit) as exited:
            cli.main(["skew", "--dsn", dsn, *args])
        out, err = capsys.readouterr()
        return exited.value.code, out, err

    code, out, err = run("--queue", QUEUE, "--group", GROUP, "--window", "5 minutes", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert [s["events"] for s in document["slots"]] == [events[k] for k in range(SLOTS)]
    assert document["events"] == sum(COUNTS.values())
    assert document["keys"] == len(COUNTS)
    assert document["busiest_slot"] == busiest
    assert document["max_over_mean"] == pytest.approx(
        events[busiest] * SLOTS / sum(COUNTS.values()))
    code, out, err = run("--queue", QUEUE, "--group", GROUP)
    assert code == 0, err
    assert f"largest load {document['max_over_mean']:.2f}x the mean (slot {busiest})" in out
    code, out, err = run("--queue", QUEUE, "--group", "nobody")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "'nobody'" in err and len(err.splitlines()) == 1
