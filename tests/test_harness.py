"""The test harness itself: fresh databases, the right server, restarts that keep data."""

from __future__ import annotations

from typing import Any

import pgtest
import psycopg
import pytest

from pgque.testing.localpg import LocalPostgres, find_bindir


@pytest.mark.parametrize("round_", [1, 2])
def test_each_test_gets_a_fresh_database_with_pgque(
    conn: psycopg.Connection[Any], round_: int
) -> None:
    # Both rounds create the same table: the second fails if it sees the first's database.
    row = conn.execute("select to_regclass('public.harness_probe')").fetchone()
    assert row == (None,)
    conn.execute("create table public.harness_probe (round int)")
    row = conn.execute("select count(*) from pg_namespace where nspname = 'pgque'").fetchone()
    assert row == (1,)
    row = conn.execute("select current_database()").fetchone()
    assert row is not None and row[0].startswith("pgque_test_")


def test_empty_database_has_no_pgque(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:
        row = conn.execute("select count(*) from pg_namespace where nspname = 'pgque'").fetchone()
    assert row == (0,)


def test_major_version_matches_the_server(
    pg_server: pgtest.PgServer, conn: psycopg.Connection[Any]
) -> None:
    row = conn.execute("select current_setting('server_version_num')::int").fetchone()
    assert row is not None
    assert row[0] // 10000 == pg_server.major_version


def test_local_postgres_restart_keeps_data(pg_server: pgtest.PgServer) -> None:
    # A separate cluster, so restarting it cannot disturb the session's server.
    if isinstance(pg_server, pgtest.LocalServer):
        bindir = pg_server.postgres.bindir
    else:
        bindir = find_bindir()
    with LocalPostgres(bindir, tmpdir=pgtest.cluster_tmpdir()) as pg:
        port, root = pg.port, pg.datadir.parent
        with psycopg.connect(pg.dsn()) as conn:
            conn.execute("create table kept (x int)")
            conn.execute("insert into kept values (42)")
        pg.restart()
        assert pg.port == port
        with psycopg.connect(pg.dsn()) as conn:
            assert conn.execute("select x from kept").fetchall() == [(42,)]
    assert not root.exists()
    pg.close()  # closing twice is fine


def test_session_server_restart(restartable_server: pgtest.PgServer, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as before:
        before.execute("create table survivor (x int)")
        restartable_server.restart()
        with pytest.raises(psycopg.OperationalError):
            before.execute("select 1")
    with psycopg.connect(dsn) as after:
        assert after.execute("select count(*) from survivor").fetchone() == (0,)
