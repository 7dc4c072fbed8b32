"""Telling a session the server ended from one that is only idle, without a round
trip (pgque.lifecycle.session_ended and CallWatch, and their async twins): a
notification waiting on the socket is no end, a socket shut down is."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from helpers import scalar

from pgque.lifecycle import CallWatch, session_ended
from pgque.lifecycle_async import AsyncCallWatch
from pgque.lifecycle_async import session_ended as asession_ended


def test_session_ended_on_pending_notify_shut_socket_and_live_idle(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A live idle session has not ended, nor has one with a notification
    waiting to be read (it stays usable); once CallWatch.abort() shut its socket
    down it has, and so has a closed connection. The same for the async twins."""
    listener = psycopg.connect(dsn, autocommit=True)
    try:
        listener.execute("listen pgque_session_end")
        assert not session_ended(listener)  # nothing to read: returns at once
        conn.execute("notify pgque_session_end, 'x'")
        # The notification is on the socket (or in libpq's buffer): not an end.
        for _ in range(20):
            assert not session_ended(listener)
        assert scalar(listener, "select 1") == 1  # still usable
        watch = CallWatch(listener, deadline=30.0)
        assert not watch.gone()
        watch.abort()  # the socket shut down under it
        assert watch.gone()
        assert session_ended(listener)
    finally:
        listener.close()
    assert session_ended(listener)

    async def async_side() -> None:
        aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            await aconn.execute("listen pgque_session_end")
            assert not asession_ended(aconn)
            conn.execute("notify pgque_session_end, 'y'")
            for _ in range(20):
                assert not asession_ended(aconn)
            cur = await aconn.execute("select 1")
            assert await cur.fetchone() == (1,)
            watch = AsyncCallWatch(aconn, deadline=30.0)
            assert not watch.gone()
            watch.abort()
            assert watch.gone() and asession_ended(aconn)
        finally:
            await aconn.close()
        assert asession_ended(aconn)

    asyncio.run(async_side())
