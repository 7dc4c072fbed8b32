"""The looks that wait at most lock_timeout (the ticker's, the info views')
against a lock wait granted just as its timeout fires (tests/late_grant.py):
the cancel that timeout leaves pending is taken inside the look, whether the
look then fails (the holder's drop_queue committed) or succeeds (it rolled
back), and never fails the caller with 55P03."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from late_grant import cannot_trace, late_grant

import pgque

CALLS = {
    "tick": "select pgque.tick('q')",
    "ticker of the queue": "select pgque.ticker('q')",
    "ticker": "select pgque.ticker()",
    "queue_info": "select * from pgque.queue_info",
    "consumer_info": "select * from pgque.consumer_info",
    "partition_slot_status": "select * from pgque.partition_slot_status",
}


@pytest.mark.parametrize("holder_ends", ["commit", "rollback"])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_lock_granted_as_its_timeout_fires_fails_no_look(
        client: pgque.Client, dsn: str, call: str, holder_ends: str) -> None:
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe("q", "c")
    client.subscribe_slots("q", "g", slots=2)
    client.send("q", "e", 1, partition_key="k")
    client.tick("q")
    client.send("q", "e", 2, partition_key="k")
    outcome: dict[str, Any] = {}
    with psycopg.connect(dsn, autocommit=True) as victim, psycopg.connect(dsn) as holder:
        victim.execute("select 1")
        if (reason := cannot_trace(victim.info.backend_pid)) is not None:
            pytest.skip(reason)
        holder.execute("select pgque.drop_queue('q', true)")  # holds the queue's sequence, tables

        def run() -> None:
            try:
                outcome["rows"] = victim.execute(CALLS[call]).fetchall()
            except psycopg.Error as exc:
                outcome["error"] = exc

        with late_grant(victim.info.backend_pid) as race:
            waited = race(run, holder.commit if holder_ends == "commit" else holder.rollback)
        assert waited, "the call never waited for the drop's locks"
        error = outcome.get("error")
        if error is not None:
            # The one error allowed: the queue is gone (a tick of that very queue).
            assert holder_ends == "commit" and call in ("tick", "ticker of the queue"), error
            assert error.sqlstate == "PQ001", f"{error.sqlstate}: {error}"
        assert victim.execute("select 1").fetchone() == (1,)  # the session goes on
