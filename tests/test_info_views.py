"""What the info views show a role that is not an admin (docs/api.md: "the info
views show a role that is not an admin only the queues and consumers it may
use"): the slots of a group it subscribed, and of a group made by 0.1.0 (open to
every reader), in partition_slot_status as in consumer_info; and what they count:
a slot's dead letters are those of its own subscription, the ones its owner can
list."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest
from helpers import install_0_1, scalar
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque


def _role_dsn(dsn: str, role: str) -> str:
    return make_conninfo(**{**conninfo_to_dict(dsn), "user": role})


def test_a_group_owner_sees_its_own_slots_in_partition_slot_status(
        dsn: str, reader_role: str) -> None:
    """A role that is not an admin sees the slots of the group it subscribed in
    partition_slot_status (with its own session as the owner of the slot it
    claimed), as it sees the group's slot subscriptions in consumer_info."""
    with pgque.connect(dsn) as admin:
        admin.create_queue("q")
    with pgque.connect(_role_dsn(dsn, reader_role)) as owner:
        owner.subscribe_slots("q", "g", slots=2)
        assert [c.consumer_name for c in owner.consumer_info("q")] == ["g#0/2", "g#1/2"]
        assert owner.claim_slot("q", "g", 0)
        rows = owner.partition_slot_status("q")
        assert [(r.consumer_name, r.slot) for r in rows] == [("g", 0), ("g", 1)]
        assert rows[0].owner_pid == owner.pinned_pid


def test_an_upgraded_0_1_group_is_in_partition_slot_status_for_readers(
        empty_dsn: str) -> None:
    """Consumers made by 0.1.0 have no owner and stay open to every reader
    (docs/api.md, Changes): after the upgrade a plain reader that may claim and
    read a 0.1.0 group's slots sees them in partition_slot_status too."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as admin:
        admin.create_queue("q")
        admin.subscribe_slots("q", "g", slots=2)
    role = f"pgque_rv_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_dsn, autocommit=True) as su:
        assert pgque.install(su) == "0.1.0"
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_reader to {role}")
    try:
        with pgque.connect(_role_dsn(empty_dsn, role)) as r:
            assert r.claim_slot("q", "g", 1)
            assert len(r.consumer_info("q")) == 2
            assert [(s.slot, s.owner_pid) for s in r.partition_slot_status("q")] == [
                (0, None), (1, r.pinned_pid)]
    finally:
        with psycopg.connect(empty_dsn, autocommit=True) as su:
            su.execute(f"drop role if exists {role}")


def test_a_slots_dead_letter_count_is_that_of_its_subscription(
        dsn: str, reader_role: str) -> None:
    """partition_slot_status.dead_letters (and consumer_info's) are those of the
    slot's subscription (operations.md), which follow its id, not its name: a
    group unsubscribed and subscribed again starts at zero, as dead_letters()
    lists its owner none of the old group's."""
    with pgque.connect(dsn) as admin:
        admin.create_queue("q", max_retries=0)
    with pgque.connect(_role_dsn(dsn, reader_role)) as owner, pgque.connect(dsn) as admin:
        owner.subscribe_slots("q", "g", slots=1)
        admin.send("q", "e", {}, partition_key="k")
        admin.tick("q")
        assert owner.claim_slot("q", "g", 0)
        batch = owner.receive_partitioned("q", "g", slot=0, slots=1)
        assert batch is not None
        owner.ack(batch, nack=[batch.messages[0]])
        assert len(owner.dead_letters("q")) == 1
        owner.release_slot("q", "g", 0)
        owner.unsubscribe_slots("q", "g")
        owner.subscribe_slots("q", "g", slots=1)
        assert owner.dead_letters("q") == []
        assert [c.dead_letters for c in owner.consumer_info("q")] == [0]
        assert [s.dead_letters for s in admin.partition_slot_status("q")] == [0]


@pytest.mark.parametrize("view", ["generated_code", "queue_info", "consumer_info",
                                  "partition_slot_status", "group_info"])
def test_info_views_answer_while_queues_are_dropped(dsn: str, view: str) -> None:
    """`pgque status` while an admin creates and drops queues: every look at each
    info view answers; none fails on a queue whose tables or sequence were
    dropped after the look began (its row still in the statement's snapshot)."""
    with pgque.connect(dsn) as client:
        for n in range(30):
            client.create_queue(f"keep{n}")
            client.subscribe_slots(f"keep{n}", "g", slots=2)
        client.maintenance()
    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        with pgque.connect(dsn) as admin:
            while not stop.is_set():
                name = f"churn{uuid.uuid4().hex[:6]}"
                admin.create_queue(name)
                admin.subscribe_slots(name, "g", slots=2)
                admin.drop_queue(name, force=True)
                churned[0] += 1

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    failures: list[str] = []
    looks = 0
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            # Until 30 queues were made and dropped while it looked: what the
            # test is about. At least 10 looks (the slow views take up to half
            # a second a look on PostgreSQL 15, so more would only cost time).
            while looks < 10 or churned[0] < 30:
                try:
                    c.execute(f"select * from pgque.{view}").fetchall()
                except psycopg.Error as exc:
                    failures.append(f"{type(exc).__name__}: {exc} {exc.diag.message_detail}"
                                    f" {exc.diag.context}")
                looks += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert failures == [], (looks, failures[:5], len(failures))


def test_no_statement_of_the_info_views_ticker_or_receive_is_compiled_by_jit(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Every statement that runs inside pgque's entry points, planned as cheap
    as it may be, runs without JIT: auto_explain reports each nested plan to
    this session (with JIT forced for any cost), and none names JIT. Before,
    partition_slot_status compiled 111 functions in 0.4 s at every call on a
    server with LLVM."""
    if not scalar(conn, "select pg_jit_available()"):
        pytest.skip("this server is built without JIT (LLVM)")
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=4)
    client.send_batch("q", [("e", i, f"k{i}") for i in range(20)])
    plans: list[str] = []
    conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    conn.execute("load 'auto_explain'")
    for setting, value in [("auto_explain.log_min_duration", "0"),
                           ("auto_explain.log_nested_statements", "on"),
                           ("auto_explain.log_analyze", "on"),
                           ("auto_explain.log_timing", "off"),
                           ("auto_explain.log_level", "notice"),
                           ("jit_above_cost", "0")]:
        conn.execute(f"set {setting} = {value}")
    calls = ["select pgque.ticker()", "select * from pgque.maint()",
             "select * from pgque.partition_slot_status", "select * from pgque.queue_info",
             "select * from pgque.consumer_info", "select * from pgque.group_info",
             "select * from pgque.ticker_info",
             "select * from pgque.receive_slots('q', 'g', 4, array[0, 1, 2, 3], null)"]
    claim = "select pgque.claim_slot('q', 'g', s) from generate_series(0, 3) s"
    conn.execute(claim)
    for call in calls:
        conn.execute(call).fetchall()
    # (The calls themselves are this session's statements: JIT as it likes.)
    nested = [p for p in plans
              if "Query Text" in p and p.split("Query Text: ", 1)[1].split("\n", 1)[0]
              not in [*calls, claim]]
    assert len(nested) > 50, plans[:3]
    jitted = [p for p in nested if "JIT:" in p]
    assert jitted == [], jitted[0][:2000]
