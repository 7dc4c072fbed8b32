"""The documentation's examples run, so they cannot rot.

Every fenced block marked ``python`` or ``sql`` in README.md and docs/*.md is a
test case of its own (id: file and block number). Blocks of one file build on
each other, the way a reader goes through the page:

- the ``python`` blocks of a file run in order in one namespace, seeded with
  nothing but ``dsn``: a fresh database with pgque installed, made like the
  ``dsn`` fixture's (cloned from the run's template) but kept for the whole file;
- the ``sql`` blocks of a file run in order on one connection to another such
  database, statement by statement in autocommit, as psql would run them; a
  statement that makes the server warn (a WARNING, which psql would show and
  the server log keeps) fails its block.

A python block followed by the paragraph "It prints:" and a ``text`` block must
print exactly that text. Running one block alone (``-k``) first runs the blocks
of its file before it.

A block that cannot run in a test at all (shell, configuration files) is marked
``sh``, ``ini`` or ``text``; any other fence language, an untagged fence or an
indented code block fails :func:`test_every_code_block_has_a_known_language`,
so an example cannot slip out of the suite by accident.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pgtest
import psycopg
import pytest
from doc_blocks import ROOT, RUNNABLE, Block, extract
from helpers import scalar
from markdown_it import MarkdownIt

import pgque

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Roles are cluster-wide: the ones an example creates are dropped after its file ran,
# so that the examples also run twice on a server given by PGQUE_TEST_DSN.
CREATE_ROLE = re.compile(r'^\s*create\s+(?:role|user)\s+("[^"]+"|\w+)',
                         re.IGNORECASE | re.MULTILINE)


def split_sql(script: str) -> list[str]:
    """The statements of a script, split at top-level semicolons: not inside
    quotes, quoted identifiers, dollar quotes or comments. Statements that are
    only comments and blanks are dropped."""
    statements: list[str] = []
    current: list[str] = []
    i, n = 0, len(script)
    while i < n:
        c = script[i]
        if c == ";":
            statements.append("".join(current))
            current = []
            i += 1
            continue
        if script.startswith("--", i):
            end = script.find("\n", i)
            end = n if end < 0 else end
        elif script.startswith("/*", i):
            depth, end = 1, i + 2
            while depth and end < n:
                if script.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif script.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                else:
                    end += 1
        elif c in "'\"":
            end = i + 1
            while end < n:
                if script[end] == c:
                    if script[end + 1:end + 2] == c:  # doubled quote inside
                        end += 2
                        continue
                    end += 1
                    break
                end += 1
        elif c == "$" and (tag := _dollar_tag(script, i)):
            close = script.find(tag, i + len(tag))
            end = n if close < 0 else close + len(tag)
        else:
            end = i + 1
        current.append(script[i:end])
        i = end
    statements.append("".join(current))
    return [s.strip() for s in statements if _has_code(s)]


def _dollar_tag(script: str, i: int) -> str | None:
    """The dollar-quote tag ($$ or $name$) starting at i, if one does."""
    if i > 0 and (script[i - 1].isalnum() or script[i - 1] == "_"):
        return None  # part of an identifier such as a$b
    end = i + 1
    while end < len(script) and (script[end].isalnum() or script[end] == "_"):
        end += 1
    if end < len(script) and script[end] == "$" and not script[i + 1:end][:1].isdigit():
        return script[i:end + 1]
    return None


def _has_code(statement: str) -> bool:
    lines = [line.split("--", 1)[0].strip() for line in statement.splitlines()]
    return any(lines)


ALL_BLOCKS = {path: extract(path) for path in DOC_FILES}
RUN_BLOCKS = [b for blocks, _ in ALL_BLOCKS.values() for b in blocks if b.language in RUNNABLE]


# -- running the blocks of one file ---------------------------------------------------


class BlockFailed(Exception):
    """A block of the same file that this one builds on failed."""


@dataclass
class Track:
    """The python (or the sql) blocks of one file, run in order on one database."""

    blocks: list[Block]
    server: Any
    template: str
    database: str = ""
    done: int = 0
    failed: Block | None = None
    namespace: dict[str, Any] = field(default_factory=dict)
    conn: psycopg.Connection[Any] | None = None
    roles: list[str] = field(default_factory=list)
    threads_before: set[threading.Thread] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)  # of the sql statement running

    def dsn(self) -> str:
        if not self.database:
            self.database = pgtest.scratch_name("doc")
            pgtest.create_database(self.server, self.database, template=self.template)
            self.threads_before = set(threading.enumerate())
        return str(self.server.dsn(self.database))

    def run_up_to(self, block: Block) -> None:
        """Run the blocks before ``block`` that have not run yet, then ``block``."""
        index = self.blocks.index(block)
        if index < self.done:  # ran already in this session: start the file over
            self.close()
        while self.done <= index:
            current = self.blocks[self.done]
            if self.failed is not None:
                raise BlockFailed(f"not run: {self.failed.test_id} (line {self.failed.line}), "
                                  "which this block builds on, failed")
            try:
                self._run(current)
            except BaseException as exc:
                self.failed = current
                if current is not block:
                    raise BlockFailed(f"{current.test_id} (line {current.line}), which this "
                                      f"block builds on, failed: {exc!r}") from exc
                raise
            self.done += 1

    def _run(self, block: Block) -> None:
        if block.language == "python":
            if not self.namespace:
                self.namespace = {"dsn": self.dsn()}
            # Padded so that tracebacks name the line of the Markdown file.
            source = "\n" * (block.line - 1) + block.code
            output = io.StringIO()
            try:
                with contextlib.redirect_stdout(output):
                    exec(compile(source, str(block.path), "exec"), self.namespace)
            finally:
                print(output.getvalue(), end="")  # pytest shows it when the test fails
            if block.prints is not None:
                assert output.getvalue() == block.prints, (
                    f"{block.test_id} (line {block.line}) printed\n{output.getvalue()}"
                    f"where the page says it prints\n{block.prints}")
        else:
            if self.conn is None:
                self.conn = psycopg.connect(self.dsn(), autocommit=True)
                self.conn.add_notice_handler(self._notice)
            for statement in split_sql(block.code):
                self.roles += CREATE_ROLE.findall(statement)
                self.warnings.clear()
                with self.conn.cursor() as cur:
                    try:
                        cur.execute(statement.encode())
                    except psycopg.Error as exc:
                        raise AssertionError(
                            f"{block.test_id} (line {block.line}) failed at:\n{statement}\n"
                            f"{type(exc).__name__}: {exc}") from exc
                    while True:  # read every result, as psql would
                        if cur.description is not None:
                            cur.fetchall()
                        if not cur.nextset():
                            break
                if self.warnings:
                    raise AssertionError(
                        f"{block.test_id} (line {block.line}) made the server warn at:\n"
                        f"{statement}\n" + "\n".join(self.warnings))

    def _notice(self, diag: psycopg.errors.Diagnostic) -> None:
        if diag.severity_nonlocalized == "WARNING":
            self.warnings.append(f"WARNING: {diag.message_primary}")

    def leftover_threads(self, timeout: float = 10.0) -> list[str]:
        """Names of pgque threads (workers, tickers, their helpers) started by this
        file's examples that are still running after ``timeout`` seconds. A
        client's producer pool is not counted: it lives as long as the client."""
        deadline = time.monotonic() + timeout
        while True:
            left = [t.name for t in threading.enumerate()
                    if t not in self.threads_before and t.is_alive()
                    and t.name.startswith("pgque")
                    and not t.name.startswith("pgque-producers")]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def close(self) -> None:
        """Stop whatever an example left running, close connections, drop the database
        and the roles the examples made; the track can then start over."""
        for value in self.namespace.values():
            try:
                if isinstance(value, (pgque.Worker, pgque.Ticker)):
                    value.stop(5)
                elif isinstance(value, pgque.Client):
                    value.close()
                    value.conn.close()
                elif isinstance(value, psycopg.Connection):
                    value.close()
            except Exception:  # cleaning up after a failed example: best effort
                pass
        if self.conn is not None:
            self.conn.close()
        if self.database:
            pgtest.drop_database(self.server, self.database)
        if self.roles:
            with pgtest.admin(self.server) as conn:
                for role in self.roles:
                    conn.execute(f"drop role if exists {role}".encode())
        self.namespace, self.conn, self.database, self.roles = {}, None, "", []
        self.done, self.failed = 0, None


@pytest.fixture(scope="session")
def tracks(pg_server: Any, superuser_template: str) -> Iterator[dict[tuple[Path, str], Track]]:
    """One Track per (file, language). Each is closed after its last block ran, or
    at the end of the run (when a block failed, or only some blocks were selected)."""
    made: dict[tuple[Path, str], Track] = {}
    for path, (blocks, _) in ALL_BLOCKS.items():
        for language in RUNNABLE:
            mine = [b for b in blocks if b.language == language]
            if mine:
                # The examples install as the superuser, as a reader trying them would.
                made[path, language] = Track(mine, pg_server, superuser_template)
    yield made
    for track in made.values():
        track.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.test_id for b in RUN_BLOCKS])
def test_doc_block(block: Block, tracks: dict[tuple[Path, str], Track]) -> None:
    track = tracks[block.path, block.language]
    try:
        track.run_up_to(block)
    except BlockFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    if block is not track.blocks[-1]:
        return
    try:
        if block.language == "python":
            left = track.leftover_threads()
            assert not left, (f"the examples of {block.name} left threads running: {left}; "
                              "stop workers and tickers in the example that starts them")
    finally:
        track.close()  # the file is done: free its database and connections now


def test_api_reference_is_complete(conn: psycopg.Connection[Any]) -> None:
    """docs/api.md names every public Python name, Client method and SQL routine."""
    text = (ROOT / "docs" / "api.md").read_text("utf-8")
    missing = [name for name in pgque.__all__ if f"`{name}" not in text]
    missing += [f"Client.{name}" for name in dir(pgque.Client)
                if not name.startswith("_")
                and f"`{name}{'' if isinstance(getattr(pgque.Client, name), property) else '('}"
                not in text]
    rows = conn.execute(
        "select distinct p.proname from pg_proc p"
        " where p.pronamespace = 'pgque'::regnamespace and p.proname !~ '^_'"
        " union all select c.relname from pg_class c"
        " where c.relnamespace = 'pgque'::regnamespace and c.relkind = 'v'"
        " and c.relname !~ '^_'").fetchall()
    missing += [f"pgque.{name}" for (name,) in rows
                if f"`{name}(" not in text and f"view `{name}`" not in text]
    assert missing == [], "add these to docs/api.md"


def test_testing_page_names_the_whole_of_pgque_testing() -> None:
    """docs/testing.md names every public name of pgque.testing, its fixtures and
    the methods of PgServer."""
    import pgque.testing
    from pgque.testing import _plugin

    text = (ROOT / "docs" / "testing.md").read_text("utf-8")
    names = [*pgque.testing.__all__, *_plugin.__all__]
    missing = [name for name in names
               if not name.startswith("pytest_") and f"`{name}" not in text]
    missing += [f"PgServer.{name}" for name in dir(pgque.testing.PgServer)
                if not name.startswith("_") and f"`{name}" not in text]
    assert missing == [], "add these to docs/testing.md"


def test_benchmark_figures_are_those_of_the_recorded_runs() -> None:
    """docs/benchmarks.md shows every suite in bench/results/, from the run recorded
    there: when the results are regenerated, the page must be updated with them."""
    text = (ROOT / "docs" / "benchmarks.md").read_text("utf-8")
    results = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert results, "no benchmark results recorded"
    for result in results:
        data = json.loads(result.read_text("utf-8"))
        heading = f"## Suite `{data['suite']}`"
        assert heading in text, f"docs/benchmarks.md has no section {heading!r}"
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        where = f"docs/benchmarks.md, suite {data['suite']}"
        assert "Not measured yet" not in section, f"{where}: results exist now"
        assert data["git"]["commit"] in section, f"{where}: not the run of {result.name}"
        if data.get("unit") == "events/s":
            for measurement in data["measurements"]:
                median = f"{round(measurement['median']):,}"
                assert median in section, f"{where}: {measurement['name']} median {median}"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(path: Path) -> set[str]:
    tokens = MarkdownIt("commonmark").parse(path.read_text("utf-8"))
    return {_slug(tokens[i + 1].content) for i, token in enumerate(tokens)
            if token.type == "heading_open"}


def test_links_between_pages_resolve() -> None:
    """Every relative link points at a file that exists, and at a heading of it."""
    broken, checked = [], 0
    for path in DOC_FILES:
        tokens = MarkdownIt("commonmark").parse(path.read_text("utf-8"))
        links = [str(child.attrs["href"]) for token in tokens if token.type == "inline"
                 for child in token.children or () if child.type == "link_open"]
        for href in links:
            if re.match(r"[a-z]+:", href):
                continue  # an external address
            checked += 1
            target, _, anchor = href.partition("#")
            file = (path.parent / target).resolve() if target else path
            if not file.exists():
                broken.append(f"{path.name}: {href} (no such file)")
            elif anchor and anchor not in _headings(file):
                broken.append(f"{path.name}: {href} (no such heading)")
    assert broken == []
    assert checked >= 20


# -- the extractor itself ---------------------------------------------------------------


def test_every_code_block_has_a_known_language() -> None:
    problems = [p for _, found in ALL_BLOCKS.values() for p in found]
    assert problems == []


def test_the_examples_were_found() -> None:
    """Guards against a parser bug that would make test_doc_block pass vacuously."""
    by_file: dict[str, dict[str, int]] = {}
    for block in RUN_BLOCKS:
        counts = by_file.setdefault(block.name, {"python": 0, "sql": 0})
        counts[block.language] += 1
    assert by_file.get("README.md", {}).get("python", 0) >= 2
    assert by_file.get("README.md", {}).get("sql", 0) >= 1
    for name in ("docs/concepts.md", "docs/guarantees.md", "docs/operations.md",
                 "docs/api.md", "docs/testing.md"):
        assert sum(by_file.get(name, {}).values()) >= 1, f"no runnable example in {name}"
    assert sum(1 for b in RUN_BLOCKS if b.language == "python") >= 12
    assert sum(1 for b in RUN_BLOCKS if b.language == "sql") >= 6
    # Every block has code, and its line points at that code in the file.
    for block in RUN_BLOCKS:
        assert block.code.strip(), block.test_id
        lines = block.path.read_text("utf-8").splitlines()
        first = block.code.splitlines()[0]
        assert lines[block.line - 1].strip() == first.strip(), block.test_id


def test_extract_handles_lists_long_fences_and_tildes() -> None:
    text = "\n".join([
        "# t",
        "",
        "1. step",
        "",
        "   ```python",
        "   x = 1",
        "   ```",
        "",
        "````text",
        "```python",
        "not code",
        "```",
        "````",
        "",
        "~~~sql",
        "select 1;",
        "~~~",
        "",
        "```",
        "untagged",
        "```",
        "",
        "```py",
        "y = 2",
        "```",
        "",
        "    indented",
        "",
        "```python",
        "print(1)",
        "```",
        "",
        "It prints:",
        "",
        "```text",
        "1",
        "```",
    ])
    blocks, problems = extract(ROOT / "x.md", text)
    assert [(b.language, b.code, b.line, b.number, b.prints) for b in blocks] == [
        ("python", "x = 1\n", 6, 1, None),
        ("text", "```python\nnot code\n```\n", 10, 0, None),
        ("sql", "select 1;\n", 16, 2, None),
        ("python", "print(1)\n", 30, 3, "1\n"),
        ("text", "1\n", 36, 0, None),
    ]
    assert len(problems) == 3
    assert "''" in problems[0] and "'py'" in problems[1] and "indented" in problems[2]


def test_split_sql() -> None:
    script = """
        -- a comment; with a semicolon
        select 'a;b', "odd;name", $$ ; $$, $fn$ select 1; $fn$;
        /* block; /* nested; */ comment */ select 2;
        do $body$ begin perform 1; end $body$;
        select 'it''s; fine' as x ;
        -- only a comment at the end;
    """
    assert split_sql(script) == [
        """-- a comment; with a semicolon
        select 'a;b', "odd;name", $$ ; $$, $fn$ select 1; $fn$""",
        "/* block; /* nested; */ comment */ select 2",
        "do $body$ begin perform 1; end $body$",
        "select 'it''s; fine' as x",
    ]
    assert split_sql("select $1::int, a$b$c from t") == ["select $1::int, a$b$c from t"]


def test_documented_sql_argument_names_work_in_named_notation(client: pgque.Client) -> None:
    """docs/api.md gives every SQL function's arguments by name and says that in
    named notation they carry a p_ prefix (`p_exist_ok => true`): every
    documented argument name, so prefixed, is the function's."""
    conn = client.conn
    api = (ROOT / "docs" / "api.md").read_text("utf-8")
    assert "p_exist_ok => true" in api
    assert scalar(conn, "select pgque.create_queue('q', p_exist_ok => true)") > 0
    assert scalar(conn, "select count(*) from pgque.dead_letters('q', p_after_id => 0)") == 0
    sql = api[api.index("## SQL"):]
    checked = 0
    for name, args in re.findall(r"^\| `(\w+)\(([^)]*)\)", sql, re.M):
        documented = {f"p_{a.split()[0]}" for a in args.split(",")
                      if a.strip() and not a.strip().startswith("out ")}
        real = {n for (names,) in conn.execute(
                    "select proargnames from pg_proc where pronamespace = 'pgque'::regnamespace "
                    "and proname = %s", (name,)) for n in (names or [])}
        assert documented <= real, (name, documented - real)
        checked += 1
    assert checked > 40


def test_readme_does_not_deny_the_upgrade_path() -> None:
    """README.md states no "no migration path": upgrades in place exist
    (operations.md "Upgrades")."""
    readme = (ROOT / "README.md").read_text("utf-8")
    assert "no migration path" not in readme
    assert "This is 0.1" not in readme


def _exported_names() -> set[str]:
    """The metric names pgque can serve: the workers' instruments, as
    prometheus_client writes them, and pgque.metrics()'s (its literals, and its
    slot and consumer figures under either prefix)."""
    from pgque.metrics import INSTRUMENTS

    names = {"pgque_up", "pgque_scrape_duration_seconds"}
    for instrument in INSTRUMENTS.values():
        base = instrument.prometheus_name
        names |= ({base + "_total"} if instrument.kind == "counter" else {base}
                  if instrument.kind == "updown" else
                  {base + "_bucket", base + "_sum", base + "_count"})
    source = (ROOT / "pgque" / "sql" / "code" / "info" / "metrics.sql").read_text()
    body = source[source.index("$$"):]
    names |= set(re.findall(r"'(pgque_[a-z_]+[a-z])'", body))
    figures = re.findall(r"^\s*\('([a-z_]+)', (?:case when )?f\.", body, re.MULTILINE)
    assert len(figures) >= 10, "the slot figures were not found in metrics.sql"
    names |= {prefix + figure for prefix in ("pgque_slot_", "pgque_consumer_")
              for figure in figures}
    return names


def test_the_dashboard_and_alerts_name_only_metrics_pgque_serves() -> None:
    """docs/monitoring's Grafana dashboard (valid JSON, every panel with a
    query) and Prometheus rules use only metric names pgque serves."""
    exported = _exported_names()
    folder = ROOT / "docs" / "monitoring"
    dashboard = json.loads((folder / "pgque-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= len(dashboard["panels"]) >= 10
    rules = (folder / "pgque-alerts.yml").read_text()
    alerts = re.findall(r"^\s+- alert: (\w+)\n\s+(?:#.*\n\s+)*expr: (.+)$", rules, re.MULTILINE)
    assert len(alerts) == rules.count("- alert:") >= 8
    used = set(re.findall(r"\bpgque_[a-z_]+\b", " ".join(exprs + [e for _, e in alerts])))
    assert used and used <= exported, sorted(used - exported)
