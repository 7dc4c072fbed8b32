"""The AsyncClient used natively, on asyncio (each test runs its coroutine with
asyncio.run). The Client's own tests run against it too (modules marked
both_clients, see conftest.py); these are the cases only asyncio code has: an
AsyncConnection of the caller's, tasks instead of threads (the owner task's
sends inside notifies() and a pipeline, tasks gathered alongside it), the type
checks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import committed_ids, scalar

import pgque


async def _setup(client: pgque.AsyncClient) -> None:
    await client.create_queue("q")
    await client.subscribe("q", "c")


async def _drain(client: pgque.AsyncClient) -> list[pgque.Message[Any]]:
    await client.tick("q")
    received: list[pgque.Message[Any]] = []
    while (batch := await client.receive("q", "c")) is not None:
        received.extend(batch.messages)
        await client.ack(batch)
    return received


def test_send_receive_ack(dsn: str) -> None:
    async def main() -> None:
        async with await pgque.connect_async(dsn) as client:
            await _setup(client)
            first = await client.send("q", "OrderPlaced", {"id": 1}, partition_key="k")
            ids = await client.send_batch("q", [("OrderLine", {"id": 1}, "k"),
                                                pgque.Event("OrderPaid", 7)])
            await client.tick("q")
            batch = await client.receive("q", "c")
            assert batch is not None
            assert [(m.id, m.type, m.payload, m.partition_key) for m in batch] == [
                (first, "OrderPlaced", {"id": 1}, "k"),
                (ids[0], "OrderLine", {"id": 1}, "k"),
                (ids[1], "OrderPaid", 7, None)]
            assert await client.ack(batch) is True
            assert await client.receive("q", "c") is None
        assert client.conn.closed

    asyncio.run(main())


def test_send_in_the_callers_transaction_on_an_async_connection(dsn: str) -> None:
    async def main() -> None:
        async with await pgque.connect_async(dsn) as client:
            await _setup(client)
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                await conn.execute("create table orders (id int)")
                await conn.commit()
                # An AsyncClient over the caller's connection: its transaction.
                await conn.execute("insert into orders values (1)")
                kept = await pgque.AsyncClient(conn).send("q", "OrderPlaced", 1)
                await conn.commit()
                # The conn argument of a client that has a connection of its own.
                await client.send("q", "Dropped", 2, conn=conn)
                await client.send_batch("q", [("Dropped", 3)], conn=conn)
                await conn.rollback()
            assert [m.id for m in await _drain(client)] == [kept]

    asyncio.run(main())


def test_the_task_that_made_the_client_joins_its_transaction(dsn: str) -> None:
    """The outbox pattern on the client's own connection: the task that made the
    client joins a transaction open on client.conn; another task's send (there,
    one gathered alongside) commits on its own, through the pool."""
    async def main() -> None:
        client = await pgque.connect_async(dsn, pool_size=2)
        try:
            await _setup(client)
            theirs: list[int] = []

            async def other_task() -> None:
                theirs.append(await client.send("q", "Theirs", 2))

            with pytest.raises(ZeroDivisionError):
                async with client.conn.transaction():
                    await client.send("q", "Mine", 1)
                    await asyncio.gather(other_task())
                    raise ZeroDivisionError
            assert [m.id for m in await _drain(client)] == theirs
        finally:
            await client.close()

    asyncio.run(main())


def test_concurrent_sends_share_one_pool(dsn: str) -> None:
    async def main() -> None:
        async with await pgque.connect_async(dsn, pool_size=3) as client:
            await _setup(client)
            ids = await asyncio.gather(*(client.send("q", "e", n, str(n)) for n in range(30)))
            assert client._pool is not None and client._pool.max_size == 3
            assert sorted(m.id for m in await _drain(client)) == sorted(ids)

    asyncio.run(main())


def test_slots_and_fences(dsn: str) -> None:
    async def main() -> None:
        async with await pgque.connect_async(dsn) as owner, \
                await pgque.connect_async(dsn) as other:
            await owner.create_queue("q")
            assert await owner.subscribe_slots("q", "g", slots=1) == 1
            assert await owner.claim_slot("q", "g", 0) is True
            assert owner.pinned_pid == owner.conn.info.backend_pid
            assert await other.claim_slot("q", "g", 0) is False
            await owner.send("q", "e", 1)
            await owner.tick("q")
            batch = await owner.receive_partitioned("q", "g", slot=0, slots=1)
            assert batch is not None and batch.fence is not None
            with pytest.raises(pgque.SlotNotOwned):
                await other.receive_partitioned("q", "g", slot=0, slots=1)
            await owner.check_fence(batch.fence)
            assert await owner.ack(batch) is True
            status = await owner.group_status("q", "g")
            assert status.slots[0].mine
            assert await owner.release_slot("q", "g", 0) is True
            with pytest.raises(pgque.StaleEpoch):
                await other.check_fence(batch.fence)

    asyncio.run(main())


def test_ticker_election_settings_and_maintenance(dsn: str) -> None:
    """The calls the both_clients modules do not make (the lock and attack modules,
    which test the SQL with a Client as the vehicle, make them)."""
    async def main() -> None:
        async with await pgque.connect_async(dsn) as first, \
                await pgque.connect_async(dsn) as second:
            pid = await first.pin_session({"application_name": "pgque-async-test"})
            assert pid == first.pinned_pid == first.conn.info.backend_pid
            row = await (await first.conn.execute("show application_name")).fetchone()
            assert row == ("pgque-async-test",)
            assert await first.claim_ticker() is True
            assert await second.claim_ticker() is False
            assert await second.active_ticker() == pid
            await first.create_queue("q", max_retries=1)
            assert (await first.set_queue_config("q", ticker_max_lag=2))["ticker_max_lag"] == 2
            assert (await first.queue_config("q"))["max_retries"] == 1
            await first.subscribe("q", "c")
            await first.send("q", "e", 1)
            assert await first.tick_overdue(0) == 1
            assert await first.ticker() == 0
            assert isinstance(await first.maintenance("q"), list)
            assert await first.release_ticker() is True
            assert await second.active_ticker() is None

    asyncio.run(main())


def test_install_and_uninstall(empty_dsn: str) -> None:
    async def main() -> None:
        async with await pgque.connect_async(empty_dsn) as client:
            assert await client.install() == pgque.__version__
            assert await client.create_queue("q") > 0
            await client.uninstall()
            with pytest.raises(psycopg.errors.InvalidSchemaName):
                await client.create_queue("q")

    asyncio.run(main())


def test_a_client_refuses_the_other_kind_of_connection(dsn: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(
            TypeError, match=r"pgque.AsyncClient needs a psycopg.AsyncConnection, not a "
                             r"psycopg.Connection: use pgque.Client"):
        pgque.AsyncClient(conn)  # type: ignore[arg-type]

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            with pytest.raises(TypeError, match=r"pgque.Client needs a psycopg.Connection, "
                                                r"not a psycopg.AsyncConnection: use "
                                                r"pgque.AsyncClient"):
                pgque.Client(aconn)  # type: ignore[arg-type]

    asyncio.run(main())
    with pytest.raises(TypeError, match=r"needs a psycopg.Connection, not builtins.str"):
        pgque.Client(dsn)  # type: ignore[arg-type]


def test_connect_errors_and_a_stop_event() -> None:
    async def main() -> None:
        with pytest.raises(pgque.ConnectError, match="invalid DSN") as error:
            await pgque.connect_async("password=hunter2 nonsense", timeout=1)
        assert "hunter2" not in str(error.value)
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = asyncio.get_running_loop().time()
        with pytest.raises(pgque.ConnectError, match="stopped while connecting"):
            await pgque.open_connection_async("host=127.0.0.1 port=1 connect_timeout=1",
                                              timeout=30, stop=stop)
        assert asyncio.get_running_loop().time() - started < 5

    asyncio.run(main())


# -- the owner task's sends ---------------------------------------------------------------------


DEADLINE = 8.0  # seconds a call that should return at once may take before it counts as stuck


def run_async(main: Callable[[], Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(main(), DEADLINE * 2)
    return asyncio.run(bounded())


def test_the_owner_tasks_send_inside_async_notifies_does_not_hang(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """AsyncConnection.notifies() holds the connection while it yields: the owner
    task's send from inside the loop commits on its own, through the pool."""
    async def main() -> list[int]:
        async with await pgque.connect_async(dsn) as client:
            await client.create_queue("q")
            await client.conn.execute("listen review")
            conn.execute("notify review, 'hello'")
            sent = []
            async for note in client.conn.notifies(timeout=DEADLINE, stop_after=1):
                # Awaited here, not in wait_for: that would send from a task of its own.
                sent.append(await client.send("q", "Notified", note.payload))
            return sent

    sent = run_async(main)
    assert committed_ids(conn, sent) == sent


def test_the_owner_tasks_send_in_a_pipeline_commits_on_its_own(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """In pipeline mode the statements until the next sync share one implicit
    transaction: the owner task's send there commits on its own all the same, and
    an error of the pipeline takes nothing of it back."""
    async def main() -> list[int]:
        async with await pgque.connect_async(dsn) as client:
            await client.create_queue("q")
            sent = []
            with pytest.raises(psycopg.errors.DivisionByZero):
                async with client.conn.pipeline():
                    sent.append(await client.send("q", "Piped", 1))
                    sent += await client.send_batch("q", [("Piped", 2)])
                    assert committed_ids(conn, sent) == sent
                    await client.conn.execute("select 1 / 0")
            return sent

    sent = run_async(main)
    assert committed_ids(conn, sent) == sent


def test_tasks_gathered_alongside_the_owner(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Inside the owner's transaction: gathered tasks commit on their own, the
    owner's sends roll back with it; a task whose statement holds client.conn
    does not hold up the owner's send; outside, the owner commits alone."""
    key = 434343

    async def main() -> tuple[list[int], list[int], list[int]]:
        async with await pgque.connect_async(dsn, pool_size=3) as client:
            await client.create_queue("q")
            theirs: list[int] = []

            async def other(n: int) -> None:
                theirs.append(await client.send("q", "Theirs", n))

            mine: list[int] = []
            with pytest.raises(ZeroDivisionError):
                async with client.conn.transaction():
                    mine.append(await client.send("q", "Mine", 0))
                    await asyncio.gather(other(1), other(2), other(3))
                    mine.append(await client.send("q", "Mine", 4))
                    raise ZeroDivisionError
            conn.execute("select pg_advisory_lock(%s)", (key,))
            pid = (await (await client.conn.execute("select pg_backend_pid()")).fetchone())[0]
            busy = asyncio.create_task(client.conn.execute(
                "select pg_advisory_lock(%s)", (key,)))
            while not scalar(conn, "select wait_event = 'advisory' from pg_stat_activity"
                                   " where pid = %s", (pid,)):
                await asyncio.sleep(0.01)  # polling the server, with the test's deadline
            alone = [await client.send("q", "Alone", 5)]  # the owner's, not a wait_for task
            assert committed_ids(conn, alone) == alone and not busy.done()
            conn.execute("select pg_advisory_unlock(%s)", (key,))
            await busy
            await client.conn.execute("select pg_advisory_unlock(%s)", (key,))
            alone.append(await client.send("q", "Alone", 6))
            return mine, theirs, alone

    mine, theirs, alone = run_async(main)
    assert committed_ids(conn, mine) == []
    assert committed_ids(conn, theirs) == sorted(theirs) and len(theirs) == 3
    assert committed_ids(conn, alone) == alone
