"""A throwaway PgBouncer in front of the test server, for the pooler tests.

:class:`PgBouncer` writes a config into a temporary directory and runs the
machine's ``pgbouncer`` (Debian package ``pgbouncer``; ``make system-deps``
installs it) in the foreground on a free TCP port of 127.0.0.1, until
:meth:`PgBouncer.close`. One wildcard database entry forwards every database
name to the test server, so the fresh database of each test works through it.

PgBouncer refuses to run as root: when this process is root the program runs as
the system user ``nobody`` (or the ``pgque`` user of :mod:`pgque.testing.localpg`),
which owns the temporary directory.

Clients authenticate with ``auth_type = trust`` (the user must still be listed
in the auth file, which is written for the server's user); pgbouncer logs in to
the server with the user and, if the server DSN has one, the password of the
server DSN. With ``users`` (name to password) it forwards each client as its
own user instead, logging in with that user's password from the auth file: a
team's workers behind it then log in as the team's role, as they would
directly.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["PgBouncer", "PgBouncerUnavailable", "find_pgbouncer"]

PoolMode = Literal["session", "transaction", "statement"]

_START_TIMEOUT = 15.0
_STOP_TIMEOUT = 10.0
_LOG_TAIL_LINES = 30
_RUN_AS = ("nobody", "pgque")  # the first that exists, when we are root


class PgBouncerUnavailable(RuntimeError):
    """pgbouncer is not installed, or could not be started here (a reason to skip)."""


def find_pgbouncer() -> str | None:
    """Path of the pgbouncer program, or None."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer") if os.access(p, os.X_OK)),
        None,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quote_ini(value: str) -> str:
    """A value inside a pgbouncer connect string: single-quoted, \\ and ' escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in _RUN_AS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PgBouncerUnavailable(f"pgbouncer refuses root and none of the users {_RUN_AS} exists")


class PgBouncer:
    """A pgbouncer process in front of the server at ``server_dsn``.

    ``pool_mode`` is pgbouncer's (``transaction`` is the one that breaks
    session state: consecutive transactions of one client may run on different
    server sessions); ``pool_size`` is ``default_pool_size``: the number of
    server connections per (database, user), so a small one makes clients share
    them. Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, server_dsn: str, *, pool_mode: PoolMode = "transaction",
                 pool_size: int = 2, program: str | None = None,
                 users: dict[str, str] | None = None) -> None:
        self.server_dsn = server_dsn
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.program = program or find_pgbouncer()
        self.port: int | None = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        params = conninfo_to_dict(server_dsn)
        self.user = str(params.get("user") or "postgres")
        self._server = {
            "host": str(params.get("host") or "127.0.0.1"),
            "port": str(params.get("port") or 5432),
            "user": self.user,
        }
        if params.get("password"):
            self._server["password"] = str(params["password"])
        self._password = str(params.get("password") or "")
        self.users = dict(users or {})
        if self.users:  # each client as its own user (see the module docstring)
            self._server = {k: v for k, v in self._server.items()
                            if k not in ("user", "password")}

    # -- public API ----------------------------------------------------------

    def dsn(self, dbname: str, user: str | None = None) -> str:
        """Connection string for ``dbname`` through this pgbouncer, as ``user``
        (the server DSN's by default; another must be one of ``users``)."""
        if self.port is None:
            raise RuntimeError("pgbouncer is not started")
        return make_conninfo(host="127.0.0.1", port=self.port, dbname=dbname,
                             user=user or self.user)

    @property
    def logfile(self) -> Path:
        """pgbouncer's log."""
        if self._dir is None:
            raise RuntimeError("pgbouncer is not started")
        return self._dir / "pgbouncer.log"

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of the log (for failure messages)."""
        try:
            text = self.logfile.read_text(encoding="utf-8", errors="replace")
        except (OSError, RuntimeError):
            return "(no pgbouncer log)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> None:
        """Write the config, start pgbouncer, wait until it accepts connections.

        Raises :class:`PgBouncerUnavailable` when the program is missing or
        does not come up.
        """
        if self._proc is not None:
            return
        if self.program is None:
            raise PgBouncerUnavailable(
                "pgbouncer is not installed (`make system-deps` installs Debian's package)")
        user = _run_as()
        self._dir = Path(tempfile.mkdtemp(prefix="pgque-bouncer-")).resolve()
        self.port = _free_port()
        self._write_config()
        if user is not None:
            for path in (self._dir, *self._dir.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._proc = subprocess.Popen(
            [self.program, str(self._dir / "pgbouncer.ini")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # everything goes to the logfile too
            cwd=self._dir,
            user=user.pw_uid if user else None,
            group=user.pw_gid if user else None,
            extra_groups=[] if user else None,
            start_new_session=True,  # a ^C of the test run is for pytest, not for it
        )
        try:
            self._wait_listening()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop pgbouncer (immediate shutdown) and delete its directory."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # SIGTERM: immediate shutdown; SIGINT waits
            try:
                proc.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PgBouncer {self.pool_mode} 127.0.0.1:{self.port} -> {self._server['host']}:" \
               f"{self._server['port']}>"

    # -- internals ---------------------------------------------------------

    def _write_config(self) -> None:
        assert self._dir is not None and self.port is not None
        target = " ".join(f"{k}={_quote_ini(v)}" for k, v in self._server.items())
        ini = f"""\
[databases]
; Any database name goes to the test server, under the same name.
* = {target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self._dir / "userlist.txt"}
pool_mode = {self.pool_mode}
default_pool_size = {self.pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
max_db_connections = 0
server_lifetime = 3600
server_idle_timeout = 600
; Let clients wait for a server connection rather than fail.
query_wait_timeout = 60
; After a failed login to the server (it restarts), try again after 1 s, not
; the default 15 s (docs/operations.md advises the same).
server_login_retry = 1
ignore_startup_parameters = extra_float_digits,options
logfile = {self.logfile}
pidfile = {self._dir / "pgbouncer.pid"}
log_connections = 0
log_disconnections = 0
admin_users = {self.user}
stats_users = {self.user}
"""
        (self._dir / "pgbouncer.ini").write_text(ini, encoding="utf-8")
        users = {self.user: self._password, **self.users}
        (self._dir / "userlist.txt").write_text(
            "".join(f'"{name}" "{password}"\n' for name, password in users.items()),
            encoding="utf-8")
        self.logfile.touch()

    def _wait_listening(self) -> None:
        assert self._proc is not None and self.port is not None
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise PgBouncerUnavailable(
                    f"pgbouncer exited at start (code {self._proc.returncode}):\n{self.log_tail()}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.5)
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise PgBouncerUnavailable(
                    f"pgbouncer did not listen on 127.0.0.1:{self.port} within "
                    f"{_START_TIMEOUT}s:\n{self.log_tail()}")
            time.sleep(0.05)
