"""The engine's install script, assembled from the SQL in ``pgque/sql/``.

No I/O here but reading the package's files: :mod:`pgque.schema` says what the
script holds and installs it (through :mod:`pgque._install`).
"""


from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import resources

from pgque._version import __version__

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:
    from importlib.abc import Traversable

__all__ = ["PIN_SEARCH_PATH", "Migration", "install_script", "migrations"]

# The first statement of the install transaction, also at the top of the script:
# every name the install resolves comes from pg_catalog, never from a schema
# another role can create in (public on PostgreSQL 14), and temporary objects
# cannot shadow anything.
PIN_SEARCH_PATH = "set local search_path = pg_catalog, pg_temp"

_MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    """One migration file: its number, name and SQL."""

    number: int
    name: str
    sql: str


def _sql_dir() -> Traversable:
    return resources.files("pgque").joinpath("sql")


def migrations() -> list[Migration]:
    """The package's migrations, in the order they apply."""
    found = []
    for entry in _sql_dir().joinpath("migrations").iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
        elif entry.name.endswith(".sql"):
            raise RuntimeError(f"migration file {entry.name} is not named NNNN_name.sql")
    found.sort(key=lambda m: m.number)
    if [m.number for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError("migrations must be numbered 1, 2, 3, ... without gaps")
    return found


def _manifest() -> list[str]:
    """The paths sql/manifest.txt names, in order, folders expanded to their files."""
    paths = []
    for line in _sql_dir().joinpath("manifest.txt").read_text("utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        path = line.split()[0]
        entry = _sql_dir().joinpath(path)
        if entry.is_dir():
            paths.extend(sorted(f"{path}/{e.name}" for e in entry.iterdir()
                                if e.name.endswith(".sql")))
        else:
            paths.append(path)
    return paths


def _steps_after_migrations() -> list[str]:
    """The script's parts that sql/manifest.txt orders, each under its path."""
    parts = []
    code_started = False
    for path in _manifest():
        is_code = path.startswith("code/")
        if is_code != code_started:
            # A function body is resolved when it first runs, not when it is
            # created: any function may call any other, whatever the order.
            parts.append(f"set local check_function_bodies = {'off' if is_code else 'on'};\n")
            code_started = is_code
        text = _sql_dir().joinpath(path).read_text("utf-8")
        parts.append(f"-- ===== {path} =====\n{text.replace('@PGQUE_VERSION@', __version__)}")
    return parts


def _newer_check(latest: int) -> str:
    # Versions compare as their leading major.minor.patch numbers; a version
    # that does not start so (a hand-made one) compares as 0.0.0.
    return f"""-- ===== refuse a database migrated or installed by a newer pgque =====
do $pgque_newer$
declare
    v_mine integer;
    v_by text;
    v_installed text := pg_catalog.current_setting('pgque.installed_before');
    v_numbers constant text := '^([0-9]+)[.]([0-9]+)[.]([0-9]+)';
begin
    select m.mig_number, m.mig_package into v_mine, v_by
      from pgque.migration m order by m.mig_number desc limit 1;
    if v_mine > {latest} then
        raise exception using
            errcode = 'PQ018',
            message = pg_catalog.format(
                'this database has pgque migration %s (from pgque %s); pgque {__version__} '
                'knows migrations up to {latest} only', v_mine, v_by),
            hint = 'Install with the newer pgque (or later); never downgrade.';
    end if;
    if coalesce(pg_catalog.regexp_match(v_installed, v_numbers)::integer[], '{{0,0,0}}')
       > coalesce(pg_catalog.regexp_match('{__version__}', v_numbers)::integer[], '{{0,0,0}}') then
        raise exception using
            errcode = 'PQ018',
            message = pg_catalog.format(
                'this database has pgque %s installed, newer than pgque {__version__}',
                v_installed),
            hint = 'Install with the newer pgque (or later); never downgrade.';
    end if;
end
$pgque_newer$;
"""


# Run right after the first statement: SET LOCAL outside a transaction block
# only warns, and the rest would then run statement by statement, neither
# atomic, nor serialized, nor with search_path pinned. An error would not stop
# a client that carries on after errors (psql without ON_ERROR_STOP), so the
# session ends itself: nothing after this line runs.
_ONE_TRANSACTION = """-- ===== refuse to run outside one transaction =====
do $pgque_one_transaction$
begin
    if pg_catalog.current_setting('search_path') <> 'pg_catalog, pg_temp' then
        raise warning using
            message = 'the pgque install script must run in one transaction: '
                      'this session ends here, and nothing was installed',
            hint = 'Use psql --single-transaction (-1), or pgque install.';
        perform pg_catalog.pg_terminate_backend(pg_catalog.pg_backend_pid());
    end if;
end
$pgque_one_transaction$;
"""


def _wrapped(migration: Migration) -> str:
    """A migration as one step of the script: run and recorded unless recorded."""
    tag = f"$pgque_migration_{migration.number:04d}$"
    for quote in (tag, "$pgque_migrate$"):
        if quote in migration.sql:
            raise RuntimeError(f"migration {migration.number} contains {quote}")
    return f"""-- ===== migration {migration.number:04d}_{migration.name} =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = {migration.number}) then
        execute {tag}
{migration.sql}
{tag};
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values ({migration.number}, '{migration.name}', '{__version__}');
    end if;
end
$pgque_migrate$;
"""


def install_script() -> str:
    """Return the whole install (and upgrade) script.

    Run it in one transaction (``psql -1 -f``): its first statement pins
    ``search_path`` for that transaction only.
    """
    steps = migrations()
    parts = [f"{PIN_SEARCH_PATH};\n",
             _ONE_TRANSACTION,
             f"-- ===== guard.sql =====\n{_sql_dir().joinpath('guard.sql').read_text('utf-8')}",
             _newer_check(steps[-1].number),
             *(_wrapped(m) for m in steps),
             *_steps_after_migrations(),
             "-- ===== record the installed version =====\n"
             f"insert into pgque.installed (in_version) values ('{__version__}')\n"
             "on conflict (in_single) do update set in_version = excluded.in_version;\n"]
    return "\n".join(parts)
