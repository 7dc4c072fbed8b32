"""Team self-service for dead letters, in the recommended deployment.

The role that may use a consumer (its owner, a role it was granted to, and
their members) lists, replays and purges that consumer's dead letters; another
team is refused with ConsumerAccessDenied (PQ014), a queue's 'consume' grants
still apply (PQ015), a role outside pgque gets 42501, and admins may do all.
Dead letters of a consumer that was unsubscribed are the admins' alone, not the
next owner's of its name, and a plain consumer and a group of one name keep
theirs apart. Every
refusal leaves the log, the cursors and the dead letters as they were, and the
CLI's refusal says what the role lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from helpers import World, assert_one_line_error, refused, run_cli, world_of

import pgque
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"  # billing's consumer group of two slots
PLAIN = "audit"   # billing's plain consumer
OTHER = "ship"    # shipping's plain consumer
NEEDS = ("it needs to own the consumer or be granted it (pgque.grant_consumer), "
         "or be in pgque_admin")


@dataclass
class Setup:
    dep: Deployment
    billing: str  # the team roles
    shipping: str
    admin: pgque.Client  # the installer
    billing_svc: pgque.Client  # the teams' logins, acting as themselves (no SET ROLE)
    shipping_svc: pgque.Client
    letters: dict[str, list[int]]  # dead letter ids by consumer (a group's by slot)

    def state(self) -> tuple[Any, ...]:
        """The log, cursors, retries, subscriptions and dead letters, as a superuser sees them."""
        with psycopg.connect(self.dep.superuser_dsn(), autocommit=True) as su:
            tables = [t for (t,) in su.execute(
                "select c.oid::regclass::text from pg_class c"
                " where c.relnamespace = 'pgque'::regnamespace and c.relkind = 'r'"
                "   and c.relname ~ '^event_[0-9]+_[0-9]+$' order by 1")]
            events = [su.execute(f"select ev_id, ev_owner, ev_retry from {t} order by 1")
                      .fetchall() for t in tables]
            return (events,
                    su.execute("select * from pgque.cursor order by cur_sub, cur_seq").fetchall(),
                    su.execute("select ev_id, ev_owner from pgque.retry_queue order by 1")
                    .fetchall(),
                    su.execute("select sub_id, sub_consumer from pgque.subscription order by 1")
                    .fetchall(),
                    su.execute("select dl_id, dl_consumer, dl_sub from pgque.dead_letter"
                               " order by 1").fetchall())


def _key_of_slot(client: pgque.Client, slot: int) -> str:
    for n in range(100):
        row = client.conn.execute("select pgque.slot_of(%s, 2)", (f"customer-{n}",)).fetchone()
        if row is not None and row[0] == slot:
            return f"customer-{n}"
    raise AssertionError(f"no key of slot {slot}")


def _dead_letter_all(client: pgque.Client, batch: pgque.Batch[Any] | None) -> None:
    assert batch is not None
    client.ack(batch, nack={m.id: "declined" for m in batch.messages})


@pytest.fixture
def setup(pgque_deployment: Deployment) -> Iterator[Setup]:
    """Billing's group (two slots) and plain consumer, shipping's plain consumer, each
    with two dead letters (one per slot for the group)."""
    dep = pgque_deployment
    billing, shipping = dep.teams
    with pgque.connect(dep.dsn(dep.owner)) as admin, \
            pgque.connect(dep.dsn(dep.producer)) as producer, \
            pgque.connect(dep.dsn(dep.login(billing))) as billing_svc, \
            pgque.connect(dep.dsn(dep.login(shipping))) as shipping_svc:
        admin.create_queue(QUEUE, max_retries=0)
        billing_svc.conn.execute(f"set role {billing}")
        billing_svc.subscribe_slots(QUEUE, GROUP, slots=2)
        billing_svc.subscribe(QUEUE, PLAIN)
        billing_svc.conn.execute("reset role")
        shipping_svc.conn.execute(f"set role {shipping}")
        shipping_svc.subscribe(QUEUE, OTHER)
        shipping_svc.conn.execute("reset role")
        producer.send_batch(QUEUE, [("Order", {"n": slot}, _key_of_slot(billing_svc, slot))
                                    for slot in (0, 1)])
        admin.tick(QUEUE)
        for slot in (0, 1):
            assert billing_svc.claim_slot(QUEUE, GROUP, slot)
            _dead_letter_all(billing_svc,
                             billing_svc.receive_partitioned(QUEUE, GROUP, slot=slot, slots=2))
            billing_svc.release_slot(QUEUE, GROUP, slot)
        _dead_letter_all(billing_svc, billing_svc.receive(QUEUE, PLAIN))
        _dead_letter_all(shipping_svc, shipping_svc.receive(QUEUE, OTHER))
        letters: dict[str, list[int]] = {}
        for letter in admin.dead_letters(QUEUE):
            letters.setdefault(letter.consumer, []).append(letter.id)
        assert {c: len(ids) for c, ids in letters.items()} == {
            f"{GROUP}#0/2": 1, f"{GROUP}#1/2": 1, PLAIN: 2, OTHER: 2}
        yield Setup(dep, billing, shipping, admin, billing_svc, shipping_svc, letters)


def consumers(letters: list[pgque.DeadLetter]) -> list[str]:
    return sorted(d.consumer for d in letters)


def test_a_team_lists_replays_and_purges_its_own_dead_letters(setup: Setup) -> None:
    billing, letters = setup.billing_svc, setup.letters
    assert consumers(billing.dead_letters(QUEUE)) == [
        PLAIN, PLAIN, f"{GROUP}#0/2", f"{GROUP}#1/2"]  # not shipping's
    assert consumers(billing.dead_letters(QUEUE, GROUP)) == [f"{GROUP}#0/2", f"{GROUP}#1/2"]
    # A slot's dead letter goes back to its slot, a plain consumer's to it.
    [slot0] = letters[f"{GROUP}#0/2"]
    event = billing.replay_dead_letter(QUEUE, slot0)
    billing.replay_dead_letter(QUEUE, letters[PLAIN][0])
    setup.admin.tick(QUEUE)
    assert billing.claim_slot(QUEUE, GROUP, 0)
    batch = billing.receive_partitioned(QUEUE, GROUP, slot=0, slots=2)
    assert batch is not None and [(m.id, m.retry_count) for m in batch] == [(event, 0)]
    billing.ack(batch)
    plain = billing.receive(QUEUE, PLAIN)
    assert plain is not None and len(plain) == 1
    billing.ack(plain)
    # Purges: by id, by group, then everything it may use (shipping's stay).
    assert billing.purge_dead_letters(QUEUE, ids=letters[PLAIN][1:]) == 1
    assert billing.purge_dead_letters(QUEUE, GROUP) == 1
    assert billing.dead_letters(QUEUE) == []
    assert billing.purge_dead_letters(QUEUE) == 0
    assert consumers(setup.admin.dead_letters(QUEUE)) == [OTHER, OTHER]


def test_another_team_is_refused_until_granted(setup: Setup) -> None:
    shipping, letters = setup.shipping_svc, setup.letters
    before = setup.state()
    denied = pgque.ConsumerAccessDenied
    calls: list[Callable[[], Any]] = [
        lambda: shipping.dead_letters(QUEUE, GROUP),
        lambda: shipping.dead_letters(QUEUE, PLAIN),
        lambda: shipping.replay_dead_letter(QUEUE, letters[f"{GROUP}#1/2"][0]),
        lambda: shipping.replay_dead_letter(QUEUE, letters[PLAIN][0]),
        lambda: shipping.purge_dead_letters(QUEUE, GROUP),
        lambda: shipping.purge_dead_letters(QUEUE, f"{GROUP}#0/2"),
        lambda: shipping.purge_dead_letters(QUEUE, ids=letters[PLAIN]),
        # One of them another team's: none is purged, its own neither.
        lambda: shipping.purge_dead_letters(QUEUE, ids=[*letters[OTHER], *letters[PLAIN]]),
    ]
    for call in calls:
        assert refused(call, denied)
    assert setup.state() == before
    with pytest.raises(denied, match=f"may not replay dead letters of consumer '{GROUP}'"):
        shipping.replay_dead_letter(QUEUE, letters[f"{GROUP}#1/2"][0])
    assert consumers(shipping.dead_letters(QUEUE)) == [OTHER, OTHER]

    # Granted the group (not the plain consumer), shipping may handle its dead letters.
    assert setup.billing_svc.grant_consumer(QUEUE, GROUP, setup.shipping) is True
    assert consumers(shipping.dead_letters(QUEUE, GROUP)) == [f"{GROUP}#0/2", f"{GROUP}#1/2"]
    assert shipping.replay_dead_letter(QUEUE, letters[f"{GROUP}#0/2"][0]) > 0
    assert shipping.purge_dead_letters(QUEUE, ids=letters[f"{GROUP}#1/2"]) == 1
    assert refused(lambda: shipping.replay_dead_letter(QUEUE, letters[PLAIN][0]), denied)
    assert consumers(setup.admin.dead_letters(QUEUE)) == [PLAIN, PLAIN, OTHER, OTHER]


def test_a_role_outside_pgque_gets_42501(setup: Setup) -> None:
    before = setup.state()
    dep = setup.dep
    for role in (dep.outsider, dep.producer):  # no pgque role; pgque_writer only
        with pgque.connect(dep.dsn(role)) as client:
            for call in (lambda: client.dead_letters(QUEUE),
                         lambda: client.replay_dead_letter(QUEUE, setup.letters[PLAIN][0]),
                         lambda: client.purge_dead_letters(QUEUE)):
                assert refused(call, psycopg.errors.InsufficientPrivilege)
    assert setup.state() == before


def test_admins_may_do_all(setup: Setup) -> None:
    dep, letters = setup.dep, setup.letters
    with pgque.connect(dep.dsn(dep.ticker)) as ticker:  # a login in pgque_admin
        assert len(ticker.dead_letters(QUEUE)) == 6
        ticker.replay_dead_letter(QUEUE, letters[f"{GROUP}#0/2"][0])
        ticker.replay_dead_letter(QUEUE, letters[OTHER][0])
        assert ticker.purge_dead_letters(QUEUE, PLAIN) == 2
    setup.admin.replay_dead_letter(QUEUE, letters[OTHER][1])  # the installer
    assert setup.admin.purge_dead_letters(QUEUE) == 1
    assert setup.admin.dead_letters(QUEUE) == []


def test_dead_letters_of_an_unsubscribed_consumer_are_the_admins(setup: Setup) -> None:
    billing, letters = setup.billing_svc, setup.letters
    billing.conn.execute(f"set role {setup.billing}")
    assert billing.unsubscribe(QUEUE, PLAIN) is True
    assert billing.subscribe(QUEUE, PLAIN) is True  # another subscription of that name
    assert billing.unsubscribe_slots(QUEUE, GROUP) == 2
    billing.conn.execute("reset role")
    before = setup.state()
    for letter in (letters[PLAIN][0], letters[f"{GROUP}#0/2"][0]):
        with pytest.raises(pgque.ConsumerAccessDenied, match="pgque_admin"):
            billing.replay_dead_letter(QUEUE, letter)
        with pytest.raises(pgque.ConsumerAccessDenied, match="unsubscribed"):
            billing.purge_dead_letters(QUEUE, ids=[letter])
    assert billing.dead_letters(QUEUE) == []
    assert billing.purge_dead_letters(QUEUE, PLAIN) == 0  # the new audit has none
    assert billing.purge_dead_letters(QUEUE) == 0
    assert setup.state() == before
    # An admin still may: replayed to the consumer of that name, or refused when none.
    assert setup.admin.replay_dead_letter(QUEUE, letters[PLAIN][0]) > 0
    with pytest.raises(pgque.ConsumerNotFound):
        setup.admin.replay_dead_letter(QUEUE, letters[f"{GROUP}#0/2"][0])
    assert setup.admin.purge_dead_letters(QUEUE, GROUP) == 2


def test_a_queue_restricted_to_another_team_refuses_even_the_owner(setup: Setup) -> None:
    setup.admin.grant_queue(QUEUE, setup.shipping, "consume")
    billing, letters = setup.billing_svc, setup.letters
    before = setup.state()
    for call in (lambda: billing.dead_letters(QUEUE),
                 lambda: billing.replay_dead_letter(QUEUE, letters[PLAIN][0]),
                 lambda: billing.purge_dead_letters(QUEUE, GROUP),
                 lambda: billing.purge_dead_letters(QUEUE)):
        assert refused(call, pgque.QueueAccessDenied)
    assert setup.state() == before
    assert setup.shipping_svc.replay_dead_letter(QUEUE, letters[OTHER][0]) > 0


def test_the_cli_says_what_the_role_lacks(setup: Setup) -> None:
    dep, letters = setup.dep, setup.letters
    shipping_svc = dep.login(setup.shipping)
    before = setup.state()
    line = assert_one_line_error(run_cli(
        "dlq", "replay", QUEUE, str(letters[f"{GROUP}#0/2"][0]),
        "--dsn", dep.dsn(shipping_svc)), 1)
    assert (f"error: role {shipping_svc} may not replay dead letters of consumer '{GROUP}' "
            f"of queue '{QUEUE}': {NEEDS}") in line
    line = assert_one_line_error(run_cli(
        "dlq", "purge", QUEUE, "--consumer", PLAIN, "--yes", "--dsn", dep.dsn(shipping_svc)), 1)
    assert (f"role {shipping_svc} may not purge dead letters of consumer '{PLAIN}' "
            f"of queue '{QUEUE}': {NEEDS}") in line
    line = assert_one_line_error(run_cli(
        "dlq", "replay", QUEUE, str(letters[PLAIN][0]), "--dsn", dep.dsn(dep.outsider)), 1)
    assert line == (f"error: role {dep.outsider} may not replay dead letters of queue "
                    f"'{QUEUE}': it needs to be in pgque_reader and own the consumer or be "
                    "granted it (pgque.grant_consumer), or be in pgque_admin")
    # Another team's dead letter is not shown, and the refusal says it may exist.
    line = assert_one_line_error(run_cli(
        "dlq", "show", QUEUE, str(letters[PLAIN][0]), "--dsn", dep.dsn(shipping_svc)), 1)
    assert line == (f"error: queue '{QUEUE}' has no dead letter {letters[PLAIN][0]}"
                    " that this role may see")
    assert setup.state() == before


# -- dead letters of a consumer that is gone, and the next owner of its name ------------------


@pytest.fixture
def world(dsn: str) -> Iterator[World]:
    """Teams a and b, an admin and an outsider, each a login role (helpers.World)."""
    with world_of(dsn) as w:
        yield w


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
    """Once a consumer is gone, its dead letters are the admins' only: another team
    that subscribes a consumer of the same name reads none of them."""
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
    """The same for a consumer group: unsubscribe_slots keeps the dead letters of
    "g#k/N", and another team that subscribes group "g" next reads none of them."""
    with world.client("a") as a, world.client("b") as b, world.client("admin") as admin:
        admin.create_queue("dq", max_retries=0)
        a.subscribe_slots("dq", "g", slots=1)
        _dead_letter_one(a, admin, slot=True)
        a.unsubscribe_slots("dq", "g")
        assert b.subscribe_slots("dq", "g", slots=1) == 1
        assert b.dead_letters("dq") == []
        assert b.dead_letters("dq", "g") == []


# -- a plain consumer and a group of one name, of two teams -----------------------------------


@pytest.fixture
def deployment(pgque_deployment: Deployment) -> Deployment:
    return pgque_deployment


@pytest.fixture
def owner(deployment: Deployment) -> Iterator[pgque.Client]:
    """The installer (an admin): creates the queue and ticks by hand."""
    with pgque.connect(deployment.dsn(deployment.owner)) as client:
        client.create_queue(QUEUE)
        yield client


@pytest.fixture
def producer(deployment: Deployment, owner: pgque.Client) -> Iterator[pgque.Client]:
    with pgque.connect(deployment.dsn(deployment.producer)) as client:
        yield client


def team_dsn(deployment: Deployment, index: int = 0) -> str:
    return deployment.dsn(deployment.login(deployment.teams[index]))


def test_a_plain_consumer_and_a_group_of_one_name_keep_their_dead_letters_apart(
        deployment: Deployment, owner: pgque.Client, producer: pgque.Client) -> None:
    """billing's plain consumer and shipping's group share the name "x" on one queue.
    Each team, naming "x", lists and purges its own dead letters only, and is
    refused the other's by id."""
    owner.set_queue_config(QUEUE, max_retries=0)
    billing, shipping = deployment.teams
    with pgque.connect(team_dsn(deployment, 0)) as b, pgque.connect(team_dsn(deployment, 1)) as s:
        b.conn.execute(f"set role {billing}")
        b.subscribe(QUEUE, "x")
        s.conn.execute(f"set role {shipping}")
        s.subscribe_slots(QUEUE, "x", slots=1)
        producer.send(QUEUE, "e", {"n": 1}, partition_key="k")
        owner.tick(QUEUE)
        plain = b.receive(QUEUE, "x")
        assert plain is not None
        b.ack(plain, nack=plain.messages)
        assert s.claim_slot(QUEUE, "x", 0)
        slot = s.receive_partitioned(QUEUE, "x", slot=0, slots=1)
        assert slot is not None
        s.ack(slot, nack=slot.messages)
        mine = b.dead_letters(QUEUE, "x")
        theirs = s.dead_letters(QUEUE, "x")
        assert [d.consumer for d in mine] == ["x"]
        assert [d.consumer for d in theirs] == ["x#0/1"]
        with pytest.raises(pgque.ConsumerAccessDenied):
            b.replay_dead_letter(QUEUE, theirs[0].id)
        with pytest.raises(pgque.ConsumerAccessDenied):
            s.purge_dead_letters(QUEUE, "x", ids=[mine[0].id])
        assert b.purge_dead_letters(QUEUE, "x") == 1
        assert [d.consumer for d in owner.dead_letters(QUEUE)] == ["x#0/1"]
