"""The engine's locks: rows of pgque's own tables, with the properties the advisory
locks they replaced had, and no cost for an idle poll.

- ticks of one queue are serialized, and each tick's snapshot sees the previous
  tick's transaction committed; other queues tick meanwhile;
- the ticker skips a queue being ticked or dropped elsewhere, without waiting,
  and two tickers do not both tick what was due once;
- maintenance looks for work before it locks, and never misses any;
- an idle ticker or maintenance poll assigns no transaction id (a row lock would);
- concurrent create_queue of one name, and install/uninstall, wait for each other.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from helpers import drain, scalar, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

# Statements of the session under test give up after this: a wrong wait fails.
TIMEOUT_OPTIONS = "-c statement_timeout=20s"


def waiting_for_lock(conn: psycopg.Connection[Any], pid: int) -> bool:
    return bool(scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity "
                             "where pid = %s", (pid,)))


class Background:
    """A call run in a thread on its own connection; its result or error kept."""

    def __init__(self, dsn: str, call: Callable[[psycopg.Connection[Any]], Any]) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True, options=TIMEOUT_OPTIONS)
        self.pid = self.conn.info.backend_pid
        self.result: Any = None
        self.error: BaseException | None = None
        self._call = call
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self._call(self.conn)
        except BaseException as exc:
            self.error = exc

    def join(self) -> Any:
        self._thread.join(30)
        assert not self._thread.is_alive(), "the background call did not return"
        self.conn.close()
        if self.error is not None:
            raise self.error
        return self.result


@contextmanager
def open_transaction(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection with a transaction open; rolled back unless the test commits."""
    conn = psycopg.connect(dsn, options=TIMEOUT_OPTIONS)
    try:
        yield conn
    finally:
        conn.rollback()
        conn.close()


def tick_count(conn: psycopg.Connection[Any], queue: str) -> int:
    return int(scalar(conn, "select count(*) from pgque.tick t join pgque.queue q "
                            "on q.queue_id = t.tick_queue where q.queue_name = %s", (queue,)))


# -- ticks -------------------------------------------------------------------------------


def test_ticks_of_one_queue_wait_for_each_other_and_see_the_previous_one(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    client.create_queue("q")
    client.create_queue("other")
    with open_transaction(dsn) as first:
        first_tick, first_xid = first.execute(
            "select pgque.tick('q'), pg_current_xact_id()").fetchone() or (None, None)
        second = Background(dsn, lambda c: scalar(c, "select pgque.tick('q')"))
        wait_for(lambda: waiting_for_lock(conn, second.pid), what="the second tick to wait")

        # Meanwhile other queues tick, and the ticker passes over this one at once.
        client.send("q", "e", 1)
        client.send("other", "e", 1)
        with pgque.connect(dsn, options=TIMEOUT_OPTIONS) as ticker:
            assert ticker.ticker() == 1  # "other"
            assert ticker.tick_overdue(0) == 0
            assert ticker.tick("other") > 0
        assert second.error is None and second.result is None  # still waiting
        first.commit()
        second_tick = second.join()

    assert second_tick > first_tick
    # The second tick's snapshot was taken after the first tick's transaction ended.
    assert scalar(conn, "select pg_visible_in_snapshot(%s::xid8, tick_snapshot) "
                        "from pgque.tick where tick_id = %s", (first_xid, second_tick))
    # It covers the event sent while it waited: nothing is pending now.
    assert client.ticker() == 0


def test_two_tickers_do_not_both_tick_one_due_queue(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    client.create_queue("q")
    client.send("q", "e", 1)
    before = tick_count(conn, "q")
    with open_transaction(dsn) as first:
        assert scalar(first, "select pgque.ticker()") == 1
        # ticker(queue) waits for the tick in progress, then finds nothing due.
        second = Background(dsn, lambda c: scalar(c, "select pgque.ticker('q')"))
        wait_for(lambda: waiting_for_lock(conn, second.pid), what="ticker('q') to wait")
        first.commit()
        assert second.join() is None
    assert tick_count(conn, "q") == before + 1


def test_tick_of_a_queue_dropped_while_it_waited_raises_queue_not_found(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    client.create_queue("q")
    with open_transaction(dsn) as dropper:
        dropper.execute("select pgque.drop_queue('q')")
        waiter = Background(dsn, lambda c: scalar(c, "select pgque.tick('q')"))
        wait_for(lambda: waiting_for_lock(conn, waiter.pid), what="tick('q') to wait")
        dropper.commit()
        with pytest.raises(psycopg.Error) as caught:
            waiter.join()
    assert caught.value.sqlstate == "PQ001"


def test_ticker_and_maintenance_pass_over_a_queue_being_dropped(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """drop_queue holds the queue's lock rows, and its tables and sequence exclusively,
    until it commits: the ticker's and maintenance's look without a lock must neither
    wait for those tables nor fail once they are gone."""
    client.create_queue("doomed")
    client.subscribe("doomed", "c")
    client.send("doomed", "e", 1)  # so that the ticker wants to tick it
    client.create_queue("kept")
    with open_transaction(dsn) as dropper, pgque.connect(dsn, options=TIMEOUT_OPTIONS) as other:
        dropper.execute("select pgque.drop_queue('doomed', true)")
        client.send("kept", "e", 1)
        assert other.ticker() == 1  # "kept", promptly
        assert other.tick_overdue(0) == 0
        other.maintenance()
        dropper.commit()
        client.send("kept", "e", 2)
        assert other.ticker() == 1
        other.maintenance()
    assert [q.queue_name for q in client.queue_info()] == ["kept"]


# -- maintenance -------------------------------------------------------------------------


def test_maintenance_of_one_queue_runs_once_at_a_time(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    conn.execute("update pgque.rotation set rt_period = '1 day'")  # only the queue's steps

    def nack_one() -> None:  # work for the retry step: a retry due at once
        client.send("q", "e", 1)
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None
        client.ack(batch, nack=batch.messages, retry_after=0)

    nack_one()
    with open_transaction(dsn) as first:
        assert first.execute("select step, amount from pgque.maint('q')").fetchall() == [
            ("retry", 1)]
        nack_one()
        # A second caller skips the queue without waiting, though it has work.
        with pgque.connect(dsn, options=TIMEOUT_OPTIONS) as other:
            assert other.maintenance() == []
        first.commit()
    assert client.maintenance() == [("q", "retry", 1)]


def _queue_row_sql(function: str) -> str:
    return f"select pgque.{function}(q) from pgque.queue q where q.queue_name = %s"


def maintenance_work(dsn: str, queue: str) -> int:
    """What maintenance's steps of one queue would do now, run without its look
    first: every step in a transaction that is rolled back."""
    with psycopg.connect(dsn) as oracle:
        work = sum(int(scalar(oracle, _queue_row_sql(step), (queue,)))
                   for step in ("_maint_rotate", "_maint_retry"))
        oracle.rollback()
    return work


def maintenance_due(conn: psycopg.Connection[Any], queue: str) -> bool:
    return bool(scalar(conn, _queue_row_sql("_maint_due"), (queue,)))


_example = itertools.count()

# What happens to a queue between maintenance passes: events sent, ticks,
# batches consumed (some events nacked for now or for later), a batch left open
# with a nack in it, the rotation period and retries running out.
operation = st.sampled_from(
    ["send", "send", "tick", "consume", "consume_nack_now", "consume_nack_later",
     "open_and_nack", "rotation_due", "retries_due", "maint"])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(operations=st.lists(operation, min_size=1, max_size=25), subscribed=st.booleans())
def test_the_look_before_the_maintenance_lock_never_misses_work(
        dsn: str, operations: list[str], subscribed: bool) -> None:
    """maint() locks a queue only when _maint_due says a step has work: whenever the
    steps would do anything, it must say so."""
    queue = f"look{next(_example)}"
    with pgque.connect(dsn) as client:
        client.create_queue(queue, event_tables=2)
        if subscribed:
            client.subscribe(queue, "c")
        conn = client.conn
        for op in [*operations, "maint"]:
            if op == "send":
                client.send_batch(queue, [("e", n) for n in range(3)])
            elif op == "tick":
                client.tick(queue)
            elif op.startswith("consume") and subscribed:
                batch = client.receive(queue, "c")
                if batch is not None:
                    nack = batch.messages[:1] if op != "consume" else []
                    client.ack(batch, nack=nack, retry_after=0 if op.endswith("now") else 3600)
            elif op == "open_and_nack" and subscribed:
                batch = client.receive(queue, "c")
                if batch is not None and batch.messages:
                    client.nack(batch, batch.messages[0], retry_after=3600)
            elif op == "rotation_due":
                conn.execute("update pgque.queue set queue_switch_time = now() - interval '1 day' "
                             "where queue_name = %s", (queue,))
            elif op == "retries_due":
                conn.execute("update pgque.retry_queue set ev_retry_after = now() "
                             "where ev_queue = (select queue_id from pgque.queue "
                             "where queue_name = %s)", (queue,))
            elif op == "maint":
                # The steps first: time only makes more retries and rotations due.
                work = maintenance_work(dsn, queue)
                due = maintenance_due(conn, queue)
                assert due or work == 0, f"_maint_due missed {work} units of work after {op}"
                done = [step for step in client.maintenance(queue) if step[0] == queue]
                assert due or done == []
        client.drop_queue(queue, force=True)


def test_maintenance_finds_each_kind_of_work(client: pgque.Client,
                                             conn: psycopg.Connection[Any]) -> None:
    """Each kind of work alone makes _maint_due say yes, and maint() does it."""
    client.create_queue("q", event_tables=3)
    client.subscribe("q", "c")
    client.create_queue("bare")  # no subscription

    def settle() -> None:
        for _ in range(5):
            if not client.maintenance():
                break
        for queue in ("q", "bare"):
            assert not maintenance_due(conn, queue), queue

    def expect(queue: str, step: str) -> None:
        assert maintenance_due(conn, queue)
        done = client.maintenance(queue)
        assert step in {s for _, s, _ in done}, done
        settle()

    settle()
    client.send("q", "e", "fails")
    client.tick("q")
    while (batch := client.receive("q", "c")) is not None and not batch.messages:
        client.ack(batch)
    assert batch is not None
    client.ack(batch, nack=batch.messages, retry_after=3600)
    settle()  # a retry not yet due is no work
    conn.execute("update pgque.retry_queue set ev_retry_after = now()")
    expect("q", "retry")

    # The rotation period ran out: switch to the next (empty) event table.
    conn.execute("update pgque.queue set queue_switch_time = now() - interval '1 day'")
    expect("q", "rotate")
    assert scalar(conn, "select queue_cur_table from pgque.queue where queue_name = 'q'") == 1
    # Once the consumer is past every event of the old current table, it is
    # truncated. Until then it is no work.
    assert scalar(conn, "select count(*) from pgque.event_1_0") == 2  # the event, its retry
    assert [m.payload for m in drain(client, "q", "c")] == ["fails"]
    expect("q", "rotate")
    assert scalar(conn, "select count(*) from pgque.event_1_0") == 0


# -- idle polls --------------------------------------------------------------------------


def assigned_xid(conn: psycopg.Connection[Any], statement: str) -> Any:
    """The transaction id statement assigned to its transaction (None: none), rolled back."""
    try:
        conn.execute(statement).fetchall()
        return scalar(conn, "select pg_current_xact_id_if_assigned()")
    finally:
        conn.rollback()


IDLE_POLLS = ["select pgque.ticker()", "select pgque.ticker('q')",
              "select pgque.tick_overdue('0')", "select * from pgque.maint()",
              "select * from pgque.maint('q')"]


def test_idle_polls_take_no_lock_and_assign_no_transaction_id(client: pgque.Client,
                                                              dsn: str) -> None:
    """Locking a row assigns a transaction id and writes WAL: the Ticker polls ticker()
    every 50 ms and maint() every second, so on an idle database they must not lock."""
    client.create_queue("q", event_tables=2)
    client.create_queue("unsubscribed")
    client.subscribe("q", "c")
    client.send("q", "e", 1)
    client.send("q", "e", 2)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.ack(batch, nack=batch.messages[:1], retry_after=3600)  # a retry, not due
    client.conn.execute("update pgque.queue set queue_switch_time = now() - interval '1 day'")
    client.maintenance()  # switches, cleans up cursors and ticks
    client.tick("q")  # the old current table is consumed now ...
    assert drain(client, "q", "c", tick=False) == []
    client.maintenance()  # ... and truncated
    client.maintenance()

    with psycopg.connect(dsn) as poller:
        lockers = "select ql_queue, ql_purpose, xmax::text from pgque.queue_lock order by 1, 2"
        locks_before = poller.execute(lockers).fetchall()
        poller.rollback()
        for statement in IDLE_POLLS:
            assert assigned_xid(poller, statement) is None, statement
        locks_after = poller.execute(lockers).fetchall()
        assert locks_after == locks_before  # not even a lock without an id was taken
        poller.rollback()

        # The check can fail: with work to do, the same polls lock and do assign one.
        client.send("q", "e", 3)
        assert assigned_xid(poller, "select pgque.ticker()") is not None
        client.conn.execute("update pgque.retry_queue set ev_retry_after = now()")
        assert assigned_xid(poller, "select * from pgque.maint()") is not None


# -- create_queue, install ---------------------------------------------------------------


@pytest.mark.parametrize("first_commits", [True, False])
@pytest.mark.parametrize("exist_ok", [True, False])
def test_concurrent_create_queue_of_one_name(conn: psycopg.Connection[Any], dsn: str,
                                             first_commits: bool, exist_ok: bool) -> None:
    with open_transaction(dsn) as first:
        first_id = scalar(first, "select pgque.create_queue('n')")
        second = Background(
            dsn, lambda c: scalar(c, "select pgque.create_queue('n', '{}', %s)", (exist_ok,)))
        wait_for(lambda: waiting_for_lock(conn, second.pid), what="the second creator to wait")
        if first_commits:
            first.commit()
        else:
            first.rollback()
        if first_commits and not exist_ok:
            with pytest.raises(psycopg.Error) as caught:
                second.join()
            assert caught.value.sqlstate == "PQ006"
            return
        second_id = second.join()
    assert (second_id == first_id) == first_commits
    assert scalar(conn, "select count(*) from pgque.queue where queue_name = 'n'") == 1
    # The queue that exists has its lock rows, and ticks.
    assert scalar(conn, "select count(*) from pgque.queue_lock where ql_queue = %s",
                  (second_id,)) == 2
    assert scalar(conn, "select pgque.tick('n')") > 0


@pytest.mark.parametrize("order", ["install, uninstall", "uninstall, install"])
@pytest.mark.superuser_install  # it installs again as the superuser
def test_install_and_uninstall_wait_for_a_running_install(dsn: str, order: str) -> None:
    """Both wait for the install in progress, then run one after the other in the
    order they came: an install that waited behind an uninstall installs afresh."""
    calls = {"install": pgque.install, "uninstall": pgque.schema.uninstall}
    with psycopg.connect(dsn, autocommit=True) as watcher, open_transaction(dsn) as first:
        first.execute("select 1")  # a transaction is open: install() runs inside it
        pgque.install(first)
        waiting = []
        for name in order.split(", "):
            waiting.append(Background(dsn, calls[name]))
            wait_for(lambda: waiting_for_lock(watcher, waiting[-1].pid),
                     what=f"the {name} to wait")
        first.commit()
        for call in waiting:
            call.join()
        installed = scalar(watcher, "select to_regnamespace('pgque') is not null")
        assert installed == (order.split(", ")[-1] == "install")
        if installed:
            assert scalar(watcher, "select pgque.version()") == pgque.__version__
