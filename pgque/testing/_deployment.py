"""The deployment docs/operations.md recommends, made on a test server.

A superuser makes the roles and the database and does nothing else: pgque is
installed by the database's owner, who is no superuser and may not create
roles; producers, workers and the ticker log in as roles of their own with the
grants the docs prescribe; and a role with no pgque grant at all shares the
database. Tests of ownership, fencing and attacks run here, since a suite that
installs and runs as one superuser never meets the privilege checks (the
statistics views, role membership, SECURITY DEFINER owners) that users do.

Roles are shared by every database of a server, so one set is made per run
(:meth:`Deployment.create`, with a random prefix) and every test gets its own
database, a copy of the deployment's template owned by the same owner
(:meth:`Deployment.database`).
"""

from __future__ import annotations

import contextlib
import secrets
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgque.schema import install
from pgque.testing._server import PgServer, TemplateSetup

__all__ = ["Deployment"]

# The roles pgque's install grants to; a superuser makes them, as the docs say,
# when the installer may not.
PGQUE_ROLES = ("pgque_reader", "pgque_writer", "pgque_admin")



def _password() -> str:
    """A login's password: 24 upper-case letters. pgque hides every quoted piece
    of an error that holds four characters of the password in a row
    (pgque._dsn.redact), and the deployment's names are lower case, so no piece
    of a password is ever in a role or database name that a test reads back
    in a message (hex passwords and hex name prefixes now and then were)."""
    return "".join(secrets.choice(string.ascii_uppercase) for _ in range(24))

@dataclass(frozen=True)
class Deployment:
    """Login roles and one database, as a team of teams would deploy pgque.

    * ``owner``: owns the database and installed pgque (so it is an admin),
      with no superuser, CREATEROLE or CREATEDB attribute;
    * ``ticker``: a login in ``pgque_admin``, for the ticker and maintenance;
    * ``producer``: a login in ``pgque_writer`` only;
    * ``teams``: NOLOGIN roles in ``pgque_reader`` and ``pgque_writer``, each
      with a login ``<team>_svc`` (:meth:`login`) for its workers;
    * ``outsider``: a login with no pgque grant at all.

    Every login has a password of its own, so the DSNs work on servers that
    ask for one too. :meth:`dsn` connects as one of them.
    """

    server: PgServer
    prefix: str
    dbname: str
    owner: str
    ticker: str
    producer: str
    outsider: str
    teams: tuple[str, ...]
    passwords: dict[str, str] = field(repr=False)

    @classmethod
    def create(cls, server: PgServer, *, teams: Sequence[str] = ("billing", "shipping"),
               setup: TemplateSetup | None = None) -> Deployment:
        """Make the roles and a template database with pgque installed by its
        owner (``setup``, when given, then runs on it as the owner). Undo it with
        :meth:`drop`."""
        prefix = f"pgque_dep_{secrets.token_hex(4)}"  # roles and databases: 63 bytes at most
        names = {"owner": f"{prefix}_owner", "ticker": f"{prefix}_ticker",
                 "producer": f"{prefix}_producer", "outsider": f"{prefix}_outsider"}
        team_roles = tuple(f"{prefix}_{team}" for team in teams)
        logins = [*names.values(), *(f"{team}_svc" for team in team_roles)]
        deployment = cls(server=server, prefix=prefix, dbname=f"{prefix}_template",
                         teams=team_roles, passwords={r: _password() for r in logins},
                         **names)
        try:
            deployment._create_roles()
            with server.admin() as conn:
                conn.execute(sql.SQL("create database {} owner {} template template0").format(
                    sql.Identifier(deployment.dbname), sql.Identifier(deployment.owner)))
            with psycopg.connect(deployment.dsn(deployment.owner), autocommit=True) as conn:
                install(conn)
                if setup is not None:
                    setup(conn)
            with server.admin() as conn:
                conn.execute(sql.SQL("alter database {} is_template true allow_connections false")
                             .format(sql.Identifier(deployment.dbname)))
        except BaseException:
            deployment.drop()
            raise
        return deployment

    def _create_roles(self) -> None:
        with self.server.admin() as conn:
            for role in PGQUE_ROLES:
                if conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone():
                    continue
                with contextlib.suppress(psycopg.errors.DuplicateObject):  # a concurrent run
                    conn.execute(sql.SQL("create role {} nologin").format(sql.Identifier(role)))

            def login(role: str, *grants: str) -> None:
                conn.execute(sql.SQL("create role {} login password {} "
                                     "nosuperuser nocreaterole nocreatedb").format(
                    sql.Identifier(role), sql.Literal(self.passwords[role])))
                for grant in grants:
                    conn.execute(sql.SQL("grant {} to {}").format(
                        sql.Identifier(grant), sql.Identifier(role)))

            login(self.owner)
            login(self.ticker, "pgque_admin")
            login(self.producer, "pgque_writer")
            login(self.outsider)
            for team in self.teams:
                conn.execute(sql.SQL("create role {} nologin").format(sql.Identifier(team)))
                conn.execute(sql.SQL("grant pgque_reader, pgque_writer to {}").format(
                    sql.Identifier(team)))
                login(self.login(team), team)

    def login(self, team: str) -> str:
        """The login role of ``team``'s workers (a member of the team role)."""
        return f"{team}_svc"

    def dsn(self, role: str) -> str:
        """A connection string to this deployment's database as login ``role``."""
        return make_conninfo(self.server.dsn(self.dbname), user=role,
                             password=self.passwords[role])

    def superuser_dsn(self) -> str:
        """The server's superuser on this deployment's database (to inspect, not to use pgque)."""
        return self.server.dsn(self.dbname)

    @contextlib.contextmanager
    def database(self) -> Iterator[Deployment]:
        """A copy of the template owned by the owner, for one test: yields this
        deployment pointed at it, and drops it on exit."""
        name = f"{self.prefix}_db_{secrets.token_hex(8)}"
        with self.server.admin() as conn:
            conn.execute(sql.SQL("create database {} owner {} template {}").format(
                sql.Identifier(name), sql.Identifier(self.owner), sql.Identifier(self.dbname)))
        try:
            yield replace(self, dbname=name)
        finally:
            self.server.drop_database(name)

    def drop(self) -> None:
        """Drop the template and every role made for this deployment (their other
        databases must be gone)."""
        self.server.drop_database(f"{self.prefix}_template")
        roles: list[Any] = [self.owner, self.ticker, self.producer, self.outsider,
                            *(self.login(team) for team in self.teams), *self.teams]
        with self.server.admin() as conn:
            for role in roles:
                conn.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))
