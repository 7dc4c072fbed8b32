"""Sending.

``pgque.send``, the SQL function: for every input it gives what a reference send
written with pgque's helper functions gives (PQ001, PQ005, PQ012, PQ015, the
rows), as SECURITY DEFINER with a pinned search_path, for the writer role only;
an error writes nothing, and every call follows the queue's current table.

A ``Client.send`` from the thread (task) that made the client goes on
``client.conn`` when it is idle in autocommit: never into a transaction it did
not join (a pipeline's implicit one), never stuck behind a call that holds the
connection (a ``notifies()`` loop, a stream, another thread's statement), still
inside ``client.conn.transaction()``, still refused in a failed one, and nothing
is lost when the session ends. (Tasks on asyncio: tests/test_async_client.py.)
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pgtest
import psycopg
import pytest
from helpers import backends, committed_ids, dbname, drain, refused, scalar, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque
from pgque.testing.localpg import LocalPostgres, find_bindir

# -- pgque.send, the SQL function --------------------------------------------------------------


# pgque.send written with pgque's helper functions (_queue_row, _require_queue,
# _check_payloads, _check_keys, _event_table), under another name: the reference
# the inlined pgque.send must match for every input.


REFERENCE_SEND = """
create function pgque._reference_send(
    p_queue text, p_type text, p_payload text, p_partition_key text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_id bigint;
begin
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    perform pgque._check_payloads(array[p_payload]);
    if octet_length(p_partition_key) > 512 then
        perform pgque._check_keys(array[p_partition_key]);
    end if;
    execute format('insert into pgque.%I (ev_type, ev_data, ev_extra1) values ($1, $2, $3) '
                   'returning ev_id',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table))
       into v_id
      using p_type, p_payload, p_partition_key;
    return v_id;
end
$$;
"""


QUEUES = ["q", "missing", None, "Q", " q", "", "x'; drop table pgque.queue; --", 'a"b',
          "event_1_0", "q" * 150, "ünïcödé-queue"]


TYPES = ["T", None, "", "Ünïcode ✓"]


PAYLOADS = ['{"a": 1}', None, "null", "", " ", "not json", '{"a":', '{"a": 1}{"b": 2}',
            '"\\u0000"', '"\\ud800"', '"\\ud83d\\ude00"', "1e999999", " \t{\"a\": [1, 2]}\n",
            "NaN", "[" * 3000 + "]" * 3000, '"' + "x" * 300_000 + '"',
            '{"big": "' + "é" * 200_000 + '"', "{'single': 1}"]


KEYS = [None, "", "k", "x" * 512, "x" * 513, "é" * 256, "é" * 256 + "x", "€" * 171,
        "\U0001f600" * 128, "\U0001f600" * 128 + "!"]


def outcome(conn: psycopg.Connection[Any], function: str, args: tuple[Any, ...],
            role: str | None = None) -> tuple[Any, ...]:
    """What one call of ``function`` does (as ``role``, when given), rolled back:
    its error (SQLSTATE, message, detail, hint) or the row it wrote, and how
    many rows that is."""
    try:
        with conn.transaction():
            before = scalar(conn, "select count(*) from pgque.event_1")
            try:
                with conn.transaction():  # a failure rolls the SET ROLE back too
                    if role is not None:
                        conn.execute(f"set role {role}")
                    ev_id = scalar(conn, f"select pgque.{function}(%s, %s, %s::text, %s)", args)
                    conn.execute("reset role")
            except psycopg.Error as exc:
                diag = exc.diag
                written = scalar(conn, "select count(*) from pgque.event_1") - before
                result: tuple[Any, ...] = ("error", exc.sqlstate, diag.message_primary,
                                           diag.message_detail, diag.message_hint, written)
            else:
                row = conn.execute("select ev_type, ev_data, ev_extra1, ev_retry, ev_owner,"
                                   " tableoid::regclass::text from pgque.event_1"
                                   " where ev_id = %s", (ev_id,)).fetchall()
                written = scalar(conn, "select count(*) from pgque.event_1") - before
                result = ("ok", row, written)
            raise _Undo(result)
    except _Undo as undo:
        return undo.result


class _Undo(Exception):
    def __init__(self, result: tuple[Any, ...]) -> None:
        self.result = result


def test_send_gives_what_the_reference_send_gives_for_every_input(
        conn: psycopg.Connection[Any]) -> None:
    """pgque.send inlines the queue lookup, the event table's name and the payload and
    key checks: for every queue, type, payload and key below it gives what the
    reference gives, the same error (SQLSTATE, message, detail, hint) or the same
    row, and an error writes nothing."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.create_queue('restricted')")
    conn.execute("select pgque.grant_queue('restricted', 'pgque_admin', 'send')")
    conn.execute(REFERENCE_SEND)
    compared = errors = 0
    codes: set[str] = set()
    cases: list[tuple[Any, ...]] = [(q, "T", '{"a": 1}', "k") for q in QUEUES]
    cases += [("q", t, p, k) for t in TYPES[:2] for p in PAYLOADS for k in (None, "k")]
    cases += [("q", "T", p, k) for p in ('{"a": 1}', "not json") for k in KEYS]
    cases += [("restricted", "T", p, k) for p in ('{"a": 1}', "bad") for k in (None, "x" * 600)]
    for args in cases:
        new, old = outcome(conn, "send", args), outcome(conn, "_reference_send", args)
        assert new == old, f"send{args!r:.200}: {new!r:.400} != {old!r:.400}"
        compared += 1
        errors += new[0] == "error"
        codes.add(new[1] if new[0] == "error" else "ok")
    # The matrix covers both sides: errors of every kind and successes.
    assert compared == len(cases) and 20 < errors < compared - 20
    assert {"PQ001", "PQ005", "PQ012"} <= codes


def test_send_errors_write_nothing_and_take_no_event_id(conn: psycopg.Connection[Any]) -> None:
    """A failed send (PQ001, PQ005, PQ012) inserts nothing and takes no event id (the
    checks come first); its error says what failed, a long queue name cut short."""
    conn.execute("select pgque.create_queue('q')")
    first = scalar(conn, "select pgque.send('q', 'T', '1')")
    failing: list[tuple[tuple[Any, ...], str]] = [
        (("missing", "T", "1", None), "PQ001"),
        (("q", "T", "{bad", None), "PQ005"),
        (("q", "T", "1", "k" * 513), "PQ012"),
    ]
    with conn.transaction():
        for args, code in failing:
            try:
                with conn.transaction():  # a savepoint: the caller's transaction goes on
                    conn.execute("select pgque.send(%s, %s, %s::text, %s)", args)
            except psycopg.Error as exc:
                assert exc.sqlstate == code
            else:
                pytest.fail(f"send{args!r:.80} did not fail")
        second = scalar(conn, "select pgque.send('q', 'T', '2')")
    # The failures inserted nothing and consumed no id: the checks come first.
    assert second == first + 1
    assert committed_ids(conn, list(range(first, second + 5))) == [first, second]
    with pytest.raises(psycopg.Error) as raised:
        conn.execute("select pgque.send('q', 'T', 'nope')")
    err = raised.value
    assert err.sqlstate == "PQ005"
    assert err.diag.message_primary is not None
    assert err.diag.message_primary.startswith("payload 1 is not valid JSON: ")
    with pytest.raises(psycopg.Error) as raised:
        conn.execute("select pgque.send(%s, 'T', '1')", ("z" * 300,))
    err = raised.value
    assert err.sqlstate == "PQ001"
    assert err.diag.message_primary == f"queue '{'z' * 100}...' does not exist"


def test_send_is_security_definer_with_its_search_path_pinned(
        conn: psycopg.Connection[Any]) -> None:
    """Both pgque.send functions are SECURITY DEFINER with search_path pinned to
    pg_catalog, pg_temp: a caller's objects named like pgque's (a temporary event
    table, a schema first on its search_path) cannot divert them."""
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.prosecdef, p.proconfig from pg_proc p"
        " where p.pronamespace = 'pgque'::regnamespace and p.proname = 'send'").fetchall()
    assert len(rows) == 2
    for signature, definer, config in rows:
        assert definer, signature
        assert config == ["search_path=pg_catalog, pg_temp", "jit=off"], (signature, config)
    # A caller's objects named like pgque's cannot divert it: a temporary table
    # named as the event table, a caller's schema first in its search_path.
    conn.execute("select pgque.create_queue('q')")
    conn.execute("create temporary table event_1_0 (ev_id bigint, ev_type text, ev_data text,"
                 " ev_extra1 text)")
    conn.execute("create schema shadow")
    conn.execute("create table shadow.queue (queue_name text, queue_id int)")
    conn.execute("insert into shadow.queue values ('fake', 1)")
    conn.execute("set search_path = pg_temp, shadow, public")
    ev = scalar(conn, "select pgque.send('q', 'T', '{\"x\": 1}', 'k')")
    assert scalar(conn, "select count(*) from pg_temp.event_1_0") == 0
    assert scalar(conn, "select ev_data from pgque.event_1_0 where ev_id = %s", (ev,)) \
        == '{"x": 1}'
    assert refused(lambda: conn.execute("select pgque.send('fake', 'T', '1')"),
                   pgque.QueueNotFound)


@pytest.fixture
def roles(dsn: str) -> Iterator[dict[str, str]]:
    """DSNs of login roles: a writer, a second writer, a reader, and one of no pgque role."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    kinds = {"writer": "pgque_writer", "other_writer": "pgque_writer",
             "reader": "pgque_reader", "nobody": None}
    names = {kind: f"pgque_review_{kind}_{suffix}" for kind in kinds}
    with psycopg.connect(dsn, autocommit=True) as su:
        for kind, role in kinds.items():
            su.execute(f"create role {names[kind]} login")
            if role:
                su.execute(f"grant {role} to {names[kind]}")
        try:
            yield {kind: make_conninfo(**{**params, "user": name})
                   for kind, name in names.items()} | {
                f"{kind}_name": name for kind, name in names.items()}
        finally:
            for name in names.values():
                su.execute(f"drop role if exists {name}")


def test_send_works_for_the_writer_and_is_refused_without_rights(
        roles: dict[str, str], conn: psycopg.Connection[Any]) -> None:
    """A writer sends (a text or a jsonb payload), to a restricted queue when its
    grants name it, and reaches the event table through send only; another writer
    is refused the restricted queue, a reader and a role of none are refused
    send."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.create_queue('restricted')")
    conn.execute("select pgque.grant_queue('restricted', %s, 'send')", (roles["writer_name"],))
    with psycopg.connect(roles["writer"], autocommit=True) as writer:
        ev = scalar(writer, "select pgque.send('q', 'T', '1', 'k')")
        jsonb = scalar(writer, "select pgque.send('restricted', 'T', '{\"a\": 1}'::jsonb)")
        assert refused(lambda: writer.execute("select pgque.send('missing', 'T', '1')"),
                       pgque.QueueNotFound)
        # The writer reaches the event table through send only.
        assert refused(lambda: writer.execute(
            "insert into pgque.event_1_0 (ev_type) values ('forged')"))
    with psycopg.connect(roles["other_writer"], autocommit=True) as other:
        assert refused(lambda: other.execute("select pgque.send('restricted', 'T', '1')"),
                       pgque.QueueAccessDenied)
        assert scalar(other, "select pgque.send('q', 'T', '2')") > ev
    for kind in ("reader", "nobody"):
        with psycopg.connect(roles[kind], autocommit=True) as denied:
            assert refused(lambda: denied.execute("select pgque.send('q', 'T', '3')"))
    rows = conn.execute("select ev_id, ev_data from pgque.event_1 order by ev_id").fetchall()
    assert [r[1] for r in rows] == ["1", "2"]
    assert scalar(conn, "select count(*) from pgque.event_2") == 1 and jsonb > 0


def test_send_gives_what_the_reference_send_gives_for_each_role(
        roles: dict[str, str], conn: psycopg.Connection[Any]) -> None:
    """PQ015 and the refusals: the same outcome for the writer the queue's grants
    name, another writer, a reader and a role of none (acting as each by SET ROLE)."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.create_queue('restricted')")
    conn.execute("select pgque.grant_queue('restricted', %s, 'send')", (roles["writer_name"],))
    conn.execute(REFERENCE_SEND)
    helper = "pgque._reference_send(text, text, text, text)"
    conn.execute(f"revoke all on function {helper} from public")  # as the install does
    conn.execute(f"grant execute on function {helper} to pgque_writer")
    seen = set()
    for kind in ("writer", "other_writer", "reader", "nobody"):
        role = roles[kind + "_name"]
        for args in [("q", "T", "1", None), ("restricted", "T", "1", "k"),
                     ("restricted", "T", "bad", None), ("missing", "T", "1", None),
                     ("restricted", "T", "1", "k" * 513)]:
            new = outcome(conn, "send", args, role)
            old = outcome(conn, "_reference_send", args, role)
            if new[1] == "42501":  # the message names the function refused
                new, old = new[:2], old[:2]
            assert new == old, (kind, args, new, old)
            seen.add((kind, args[0], new[1] if new[0] == "error" else "ok"))
    assert ("writer", "restricted", "ok") in seen
    assert ("other_writer", "restricted", "PQ015") in seen
    assert ("other_writer", "q", "ok") in seen
    assert ("reader", "q", "42501") in seen and ("nobody", "q", "42501") in seen


def test_send_follows_rotation_and_a_queue_made_again_in_one_session(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """The inlined lookup reads the queue row on every call: a rotation, or a
    queue dropped and made again under the same name, is followed at once by
    the same session (no table name kept from an earlier call)."""
    client.create_queue("q", rotation_period=0)
    client.subscribe("q", "c")
    session = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
    try:
        def send(n: int) -> int:
            return int(scalar(session, "select pgque.send('q', 'T', %s::text)", (str(n),)))

        sent = [send(0), send(1)]
        got: list[int] = []
        tables = set()
        for n in range(2, 8):
            got += [m.id for m in drain(client, "q", "c")]
            client.maintenance("q")  # rotates as soon as it may
            sent.append(send(n))
            tables.add(scalar(conn, "select tableoid::regclass::text from pgque.event_1"
                                    " where ev_id = %s", (sent[-1],)))
        assert len(tables) >= 3, tables  # the sends followed the switches
        assert got + [m.id for m in drain(client, "q", "c")] == sent
        client.unsubscribe("q", "c")
        client.drop_queue("q")
        queue_id = client.create_queue("q")
        client.subscribe("q", "c")
        again = send(99)
        table = scalar(conn, f"select tableoid::regclass::text from pgque.event_{queue_id}"
                             " where ev_id = %s", (again,))
        assert table.startswith(f"pgque.event_{queue_id}_")
        assert [m.data for m in drain(client, "q", "c")] == ["99"]
    finally:
        session.close()


# -- Client.send from the owner: on client.conn, never stuck, never in another's transaction ---


DEADLINE = 8.0  # seconds a call that should return at once may take before it counts as stuck


def in_thread(target: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """``target()`` in a thread of its own (so the client it makes is that thread's):
    its result, or a failure once ``timeout`` passes (the thread, stuck, is left)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, target()))
        except BaseException as exc:
            result.append((False, exc))

    thread = threading.Thread(target=run, daemon=True, name=what)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{what}: still running after {timeout}s (stuck)")
    ok, value = result[0]
    if not ok:
        raise value
    return value


@pytest.fixture
def queue(client: pgque.Client) -> pgque.Client:
    client.create_queue("q")
    client.subscribe("q", "c")
    return client


def test_the_owners_send_inside_its_notifies_loop_does_not_hang(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """psycopg's notifies() holds the connection's lock while it yields: a send on
    client.conn from inside the loop would wait for it for ever. It commits on its
    own through the pool."""
    listening = threading.Event()

    def owner() -> list[int]:
        with pgque.connect(dsn) as client:
            client.create_queue("q")
            client.conn.execute("listen review")
            listening.set()
            sent = []
            for note in client.conn.notifies(timeout=DEADLINE, stop_after=1):
                sent.append(client.send("q", "Notified", note.payload))
                sent += client.send_batch("q", [("Notified", note.payload)])
            return sent

    def notify() -> None:
        listening.wait(DEADLINE)
        conn.execute("notify review, 'hello'")

    threading.Thread(target=notify, daemon=True).start()
    sent = in_thread(owner, "a send inside a notifies() loop")
    assert len(sent) == 2 and committed_ids(conn, sent) == sent


def test_the_owners_send_inside_a_stream_over_its_connection(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """stream() holds client.conn for the whole loop, the result still coming:
    the owner's sends from inside it commit on their own, through the pool."""
    def owner() -> list[int]:
        with pgque.connect(dsn) as client:
            client.create_queue("q")
            with client.conn.cursor() as cur:
                return [client.send("q", "Streamed", n)
                        for (n,) in cur.stream("select generate_series(1, 3)")]

    sent = in_thread(owner, "a send inside a stream() loop")
    assert len(sent) == 3 and committed_ids(conn, sent) == sent


def test_the_owners_send_while_another_thread_listens_on_the_connection(
        queue: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A listener thread waiting in client.conn.notifies() holds the connection;
    the owner's sends (this thread's: it made the client) must not wait for the
    next notification. Should they, a watchdog sends one after the deadline,
    which lets them through, and the test fails."""
    client = queue
    client.conn.execute("listen review")
    notes: list[str] = []

    def listen() -> None:
        for note in client.conn.notifies(timeout=30, stop_after=1):
            notes.append(note.payload)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    wait_for(lambda: client.conn.lock.locked(), what="the listener to hold the connection")
    watchdog = threading.Timer(DEADLINE, lambda: conn.execute("notify review, 'watchdog'"))
    watchdog.start()
    try:
        sent = [client.send("q", "Ping", 1), *client.send_batch("q", [("Ping", 2)])]
        assert not notes, "the owner's sends waited for the listener's notification"
    finally:
        watchdog.cancel()
        conn.execute("notify review, 'bye'")
        listener.join(DEADLINE)
    assert committed_ids(conn, sent) == sent and notes == ["bye"]


def test_the_owners_send_in_a_pipeline_commits_on_its_own(
        queue: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """In pipeline mode, statements until the next sync share one implicit
    transaction: the owner's send there would return an id for an event that
    is not committed, and that a later error of the pipeline rolls back."""
    client = queue
    with pytest.raises(psycopg.errors.DivisionByZero), client.conn.pipeline():
        ev = client.send("q", "Piped", 1)
        [batch_ev] = client.send_batch("q", [("Piped", 2)])
        # Committed on its own, as send promises: seen at once by others.
        assert committed_ids(conn, [ev, batch_ev]) == [ev, batch_ev]
        client.conn.execute("select 1 / 0")
    assert committed_ids(conn, [ev, batch_ev]) == [ev, batch_ev]
    assert [m.id for m in drain(client, "q", "c")] == [ev, batch_ev]


def test_the_owners_send_in_a_pipelined_transaction_joins_it(
        queue: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """In a transaction of the owner's, pipelined or not, the owner's send joins it:
    rolled back with it, never seen by others."""
    client = queue
    with pytest.raises(psycopg.errors.DivisionByZero), client.conn.pipeline(), \
            client.conn.transaction():
        ev = client.send("q", "Piped", 1)
        assert committed_ids(conn, [ev]) == []
        client.conn.execute("select 1 / 0")
    assert committed_ids(conn, [ev]) == []
    assert drain(client, "q", "c") == []


@pytest.mark.both_clients
def test_the_owners_send_does_not_wait_for_another_threads_statement(
        queue: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """While another thread's statement runs on client.conn (here blocked on an
    advisory lock the test holds), the owner's send commits through the pool at
    once; the other statement is not disturbed."""
    client = queue
    key = 424242
    conn.execute("select pg_advisory_lock(%s)", (key,))
    pid = scalar(client.conn, "select pg_backend_pid()")
    blocked: list[Any] = []
    other = threading.Thread(target=lambda: blocked.append(
        scalar(client.conn, "select pg_advisory_lock(%s) is not null", (key,))), daemon=True)
    other.start()
    try:
        wait_for(lambda: scalar(conn, "select wait_event = 'advisory' from pg_stat_activity"
                                      " where pid = %s", (pid,)),
                 what="the other thread's statement to wait on the lock")
        # Should the owner's send wait for that statement, the watchdog frees it.
        watchdog = threading.Timer(DEADLINE, lambda: conn.execute(
            "select pg_advisory_unlock(%s)", (key,)))
        watchdog.start()
        sent = [client.send("q", "Ping", 1), *client.send_batch("q", [("Ping", 2)])]
        watchdog.cancel()
        assert committed_ids(conn, sent) == sent
        assert other.is_alive() and not blocked
    finally:
        conn.execute("select pg_advisory_unlock(%s)", (key,))
        other.join(DEADLINE)
    assert blocked == [True]
    client.conn.execute("select pg_advisory_unlock(%s)", (key,))
    assert [m.id for m in drain(client, "q", "c")] == sent


@pytest.mark.both_clients
def test_the_owner_commits_alone_when_idle_and_joins_its_transaction(
        queue: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Idle in autocommit, the owner's send commits at once, on its own; inside
    client.conn.transaction() it joins that transaction (gone with a rollback, seen
    at its commit); all of it on the client's own session."""
    client = queue
    before = backends(conn)
    alone = client.send("q", "Alone", 1)
    assert committed_ids(conn, [alone]) == [alone]  # at once, not at some later commit
    with pytest.raises(ZeroDivisionError), client.conn.transaction():
        lost = client.send("q", "RolledBack", 2)
        lost_too = client.send_batch("q", [("RolledBack", 3)])
        assert committed_ids(conn, [lost, *lost_too]) == []
        raise ZeroDivisionError
    with client.conn.transaction():
        kept = client.send("q", "Kept", 4)
        assert committed_ids(conn, [kept]) == []
    after = client.send("q", "Alone", 5)
    assert committed_ids(conn, [alone, lost, *lost_too, kept, after]) == [alone, kept, after]
    assert backends(conn) == before  # all of it on the client's own session
    assert [m.id for m in drain(client, "q", "c")] == [alone, kept, after]


@pytest.mark.both_clients
def test_a_failed_transaction_refuses_the_owners_send(
        queue: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """In a transaction left in error on client.conn, the owner's send fails as
    any statement there does: it neither commits elsewhere (the pool) nor later."""
    client = queue
    before = backends(conn)
    with pytest.raises(psycopg.errors.InFailedSqlTransaction), client.conn.transaction():
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            client.conn.execute("select 1 / 0")
        assert client.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        client.send("q", "Doomed", 1)
    assert scalar(conn, "select count(*) from pgque.event_1") == 0
    assert backends(conn) == before
    ev = client.send("q", "After", 2)  # the connection is usable again
    assert [m.id for m in drain(client, "q", "c")] == [ev]


@pytest.mark.both_clients
def test_the_owners_sends_on_a_pinned_session(queue: pgque.Client,
                                              conn: psycopg.Connection[Any]) -> None:
    """A pinned client (as a Worker's or Ticker's session) sends on that session,
    between its slot calls, which keep working."""
    client = queue
    client.subscribe_slots("q", "g", slots=2)
    pid = client.pin_session({"statement_timeout": "5s"})
    before = backends(conn)
    assert client.claim_slot("q", "g", 0) and client.claim_slot("q", "g", 1)
    sent = [client.send("q", "Pinned", n, partition_key=f"k{n}") for n in range(6)]
    sent += client.send_batch("q", [("Pinned", 6, "k6")])
    assert backends(conn) == before
    assert scalar(conn, "select count(*) from pg_stat_activity where pid = %s", (pid,)) == 1
    client.tick("q")
    got = [m.id for b in client.receive_slots("q", "g", slots=2, owned=[0, 1]) for m in b]
    assert sorted(got) == sent
    assert client.pinned_pid == pid


def test_the_owners_sends_through_a_transaction_pooler(
        dsn: str, conn: psycopg.Connection[Any], pgbouncer: Any) -> None:
    """Through PgBouncer in transaction mode, as operations.md says: sends of the
    owner (client.conn) and of other threads (the pool), many more than psycopg's
    prepare threshold, all committed."""
    with pgque.connect(pgbouncer.dsn(dbname(dsn)), prepare_threshold=None) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        sent = [client.send("q", "Mine", n) for n in range(12)]
        theirs: list[int] = []
        producer = threading.Thread(
            target=lambda: theirs.extend(client.send("q", "Theirs", n) for n in range(12)))
        producer.start()
        sent += client.send_batch("q", [("Mine", n) for n in range(3)])
        producer.join(DEADLINE)
        assert len(theirs) == 12
        with client.conn.transaction():
            sent.append(client.send("q", "InTransaction", 1))
        assert sorted(m.id for m in drain(client, "q", "c")) == sorted(sent + theirs)


def test_sends_lose_nothing_across_a_server_restart(
        restartable_server: Any, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """After a restart the owner's first send fails on its dead session; the
    next ones go through the pool (whose dead connections may fail once each).
    Every id a send returned is delivered, none twice."""
    with pgque.connect(dsn, pool_size=2) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        sent = [client.send("q", "Before", 1)]
        sent += in_thread(lambda: [client.send("q", "Theirs", 2)], "another thread's send")
        conn.close()
        restartable_server.restart()
        failures = 0
        while len(sent) < 6:
            try:
                sent.append(client.send("q", "After", len(sent)))
            except (psycopg.OperationalError, pgque.PgqueError):
                failures += 1
                assert failures <= 3, "sends keep failing after the restart"
        assert failures >= 1  # the owner's dead session was not hidden
        with pgque.connect(dsn) as reader:
            assert [m.id for m in drain(reader, "q", "c")] == sent


def test_after_a_crash_only_committed_events_arrive_where_an_uncommitted_sends_ids_come_again(
        pg_server: Any) -> None:
    """A sequence's advance is WAL-logged but flushed only with some later commit:
    after a crash (immediate stop) the ids an uncommitted send took are given
    again. Whoever names sends by id alone (the fault harness did) takes the new
    events for the lost ones; pgque delivers exactly the committed events, once.
    A cluster of its own: the WAL writer must not flush behind the test's back."""
    bindir = (pg_server.postgres.bindir if isinstance(pg_server, pgtest.LocalServer)
              else find_bindir())
    settings = {"wal_writer_delay": "10s", "autovacuum": "off", "synchronous_commit": "on"}
    with LocalPostgres(bindir, tmpdir=pgtest.cluster_tmpdir(), settings=settings) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute(pgque.install_script())
            client = pgque.Client(conn)
            client.create_queue("q")
            client.subscribe("q", "c")
            conn.execute("checkpoint")  # the next nextval writes a WAL record of its own
        lost = psycopg.connect(pg.dsn())
        lost_ids = pgque.Client(lost).send_batch("q", [("Lost", i) for i in range(3)],
                                                  conn=lost)
        pg.stop("immediate")  # the open transaction's WAL, never flushed, is gone
        lost.close()
        pg.start()
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            client = pgque.Client(conn)
            kept_ids = client.send_batch("q", [("Kept", i) for i in range(3)])
            assert set(kept_ids) & set(lost_ids), "the case this test is for did not arise"
            got = [(m.id, m.type, m.payload) for m in drain(client, "q", "c")]
    assert got == [(ev, "Kept", i) for i, ev in enumerate(kept_ids)]


def test_a_workers_handlers_send_through_a_client_the_main_thread_made(
        queue: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The Worker and its Ticker run on sessions of their own (their Clients have
    no pool and no dsn): a handler that produces through the application's
    client sends from a lane thread, through the pool, while the main thread
    (the owner) sends on client.conn; every event arrives once."""
    client = queue
    client.create_queue("out")
    client.subscribe("out", "c")
    client.subscribe_slots("q", "g", slots=2)
    echoed: list[int] = []
    lock = threading.Lock()

    def handle(message: pgque.Message[Any]) -> None:
        ev = client.send("out", "Echo", message.payload, partition_key=message.partition_key)
        with lock:
            echoed.append(ev)

    with pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handle,
                      poll_interval=0.05, name="review-echo"):
        sent = [client.send("q", "Ping", n, partition_key=f"k{n}") for n in range(10)]
        sent += client.send_batch("q", [("Ping", n, f"k{n}") for n in range(10, 20)])
        wait_for(lambda: len(echoed) == 20, what="every event echoed", dsn=dsn)
        mine = [client.send("q", "Ping", 20, partition_key="k20")]
        wait_for(lambda: len(echoed) == 21, what="the last event echoed", dsn=dsn)
    assert len(set(sent + mine)) == 21
    got = drain(client, "out", "c")
    assert sorted(m.id for m in got) == sorted(echoed)
    assert sorted(m.payload for m in got) == list(range(21))
