"""A streaming-replication pair for the failover tests: a primary and a hot
standby, throwaway clusters of pgque.testing.localpg.

:class:`ReplicaPair` starts a primary (``wal_level = replica``, durable
commits: ``synchronous_commit = on``, and with ``sync=True`` the standby in
``synchronous_standby_names``, so a commit returns once the standby has it),
then a standby made from it by ``pg_basebackup -R`` (its ``primary_conninfo``
names it by ``application_name``). :meth:`ReplicaPair.fail_over` kills the
primary (an immediate stop: a crash, no shutdown checkpoint, clients cut) and
promotes the standby; :meth:`ReplicaPair.dsn` is a multi-host connection
string over both (``target_session_attrs=read-write``), as clients of a
failover cluster are given.

Both servers keep ``fsync = off`` as every test cluster does: the machine does
not crash here, only the postmaster, so what is written survives.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from pgque.testing.localpg import LocalPostgres, _free_port

__all__ = ["ReplicaPair", "Standby"]

STANDBY_NAME = "pgque_standby"
_PRIMARY_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "5",
    "synchronous_commit": "on",
    "hot_standby": "on",
    "wal_keep_size": "256MB",
}


class Standby(LocalPostgres):
    """A hot standby of ``primary``: its data directory comes from
    ``pg_basebackup -R`` (which writes standby.signal and primary_conninfo)
    instead of initdb."""

    def __init__(self, primary: LocalPostgres, *, tmpdir: Path | None = None) -> None:
        super().__init__(primary.bindir, {"hot_standby": "on"}, tmpdir=tmpdir)
        self.primary = primary

    def _create(self) -> None:
        # As LocalPostgres._create (the temporary directory, its owner), but the
        # data directory is the primary's base backup.
        root = Path(tempfile.mkdtemp(prefix="pgque-standby-", dir=self.tmpdir)).resolve()
        if self.primary._user is not None:  # root: run as the primary's service user
            self._user = self.primary._user
            shutil.chown(root, self._user.pw_uid, self._user.pw_gid)
        self._root = root
        atexit.register(self._close_at_exit)
        rc, out = self._run(["pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port),
                             "-U", "postgres", "-D", str(self.datadir), "-R", "-X", "stream",
                             "--no-sync", "-d",
                             f"application_name={STANDBY_NAME}"], timeout=120)
        if rc != 0:
            raise RuntimeError(f"pg_basebackup failed ({rc}):\n{out.strip()}")
        self._port = _free_port()
        # Promoted, it has no standby of its own: a synchronous_standby_names
        # copied from the primary would make every commit wait for ever (what a
        # failover manager such as Patroni clears at promotion).
        self._append_conf({"port": str(self._port), "unix_socket_directories": "",
                           "hot_standby": "on", "synchronous_standby_names": ""},
                          "the standby's own")

    def promote(self) -> None:
        """``pg_ctl promote``, waiting until the server accepts writes."""
        rc, out = self._run(["pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "promote"],
                            timeout=90)
        if rc != 0:
            raise RuntimeError(f"pg_ctl promote failed ({rc}):\n{out.strip()}")


class ReplicaPair:
    """A primary and its hot standby, streaming; see the module docstring."""

    def __init__(self, bindir: Path | None = None, *, sync: bool = True,
                 tmpdir: Path | None = None) -> None:
        settings = dict(_PRIMARY_SETTINGS)
        if sync:
            settings["synchronous_standby_names"] = STANDBY_NAME
        self.sync = sync
        self.primary = LocalPostgres(bindir, settings, tmpdir=tmpdir)
        self.standby: Standby | None = None
        self.primary.start()
        try:
            self.standby = Standby(self.primary, tmpdir=tmpdir)
            self.standby.start()
            self.wait_streaming()
        except BaseException:
            self.close()
            raise

    def dsn(self, dbname: str, **params: Any) -> str:
        """A multi-host connection string over both servers, primary first, that
        connects to whichever accepts writes."""
        assert self.standby is not None
        return make_conninfo(host="127.0.0.1,127.0.0.1",
                             port=f"{self.primary.port},{self.standby.port}",
                             dbname=dbname, user="postgres",
                             target_session_attrs="read-write", **params)

    def wait_streaming(self, timeout: float = 30.0) -> None:
        """Until the primary sees the standby streaming (and, when sync, as its
        synchronous standby)."""
        deadline = time.monotonic() + timeout
        want = "sync" if self.sync else "async"
        while True:
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                row = conn.execute("select state, sync_state from pg_stat_replication "
                                   "where application_name = %s", (STANDBY_NAME,)).fetchone()
            if row is not None and row[0] == "streaming" and row[1] == want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby is not streaming ({row}) after {timeout}s")
            time.sleep(0.05)

    def fail_over(self) -> None:
        """Kill the primary (immediate stop) and promote the standby."""
        assert self.standby is not None
        self.primary.stop("immediate")
        self.standby.promote()

    def close(self) -> None:
        if self.standby is not None:
            self.standby.close()
        self.primary.close()

    def __enter__(self) -> ReplicaPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
