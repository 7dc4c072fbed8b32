"""The engine's SQL as files: pgque/sql/manifest.txt orders them, and the
install script holds each once, in that order, whatever calls what.

The code files are created with check_function_bodies off, so that a function
may call one defined in a later file; these tests make up for the check the
install skips, by validating every routine's body once it is installed.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import psycopg

from pgque import _script, schema

SQL_DIR = resources.files("pgque").joinpath("sql")


def _sql_files(folder: str) -> list[str]:
    found = []
    stack = [(folder, SQL_DIR.joinpath(folder))]
    while stack:
        path, entry = stack.pop()
        for child in entry.iterdir():
            if child.is_dir():
                stack.append((f"{path}/{child.name}", child))
            elif child.name.endswith(".sql"):
                found.append(f"{path}/{child.name}")
    return sorted(found)


def test_the_manifest_names_every_code_and_install_file_once() -> None:
    named = _script._manifest()
    assert len(named) == len(set(named)), "a file is named twice"
    assert sorted(named) == sorted(_sql_files("code") + _sql_files("install"))


def test_the_script_holds_the_files_in_manifest_order() -> None:
    script = schema.install_script()
    positions = [script.index(f"-- ===== {path} =====\n") for path in _script._manifest()]
    assert positions == sorted(positions)
    assert script.index("-- ===== guard.sql =====") < script.index("-- ===== migration 0001")
    assert script.index("-- ===== migration 0001") < positions[0]


def test_function_bodies_are_checked_again_after_the_code() -> None:
    """Bodies unchecked while the code files are created, checked again for the
    install steps after them (the generated code)."""
    script = schema.install_script()
    off = script.index("set local check_function_bodies = off;")
    on = script.index("set local check_function_bodies = on;")
    first_code = min(script.index(f"-- ===== {p} =====") for p in _script._manifest()
                     if p.startswith("code/"))
    last_code = max(script.index(f"-- ===== {p} =====") for p in _script._manifest()
                    if p.startswith("code/"))
    generated = script.index("-- ===== install/generated.sql =====")
    assert off < first_code and last_code < on < generated


def test_every_installed_routine_body_is_valid(conn: psycopg.Connection[Any]) -> None:
    """Each SQL and PL/pgSQL routine of schema pgque, its queues' generated code
    included, passes its language's validator with bodies checked: a name that
    resolves to nothing, a wrong column or a syntax error would raise here."""
    conn.execute("create table public.layout_probe (x int)")  # nothing pgque needs
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 4)")
    conn.execute("select * from pgque.maint()")
    routines = conn.execute(
        "select p.oid::regprocedure::text, l.lanname, l.lanvalidator::regproc::text"
        "  from pg_proc p join pg_language l on l.oid = p.prolang"
        " where p.pronamespace = 'pgque'::regnamespace and l.lanname in ('sql', 'plpgsql')"
        " order by 1").fetchall()
    assert len(routines) > 150
    assert any(name.startswith("pgque._batch_reader_") for name, _, _ in routines)
    assert any(name.startswith("pgque._write_event(") for name, _, _ in routines)
    conn.execute("set check_function_bodies = on")
    failed = []
    for name, _language, validator in routines:
        try:
            conn.execute(f"select {validator}(%s::regprocedure)", (name,))
        except psycopg.Error as exc:
            failed.append(f"{name}: {exc}")
    assert failed == []
