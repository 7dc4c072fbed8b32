"""The ``pgque`` command line, run as a subprocess against the test server."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from helpers import (
    BAD_DSN,
    TESTS_DIR,
    assert_one_line_error,
    cli_env,
    cli_process,
    drain,
    ok,
    run_cli,
    scalar,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque
from pgque import cli
from pgque.testing import Deployment


def tail_consumers(client: pgque.Client) -> list[str]:
    return [c.consumer_name for c in client.consumer_info()
            if c.consumer_name.startswith("tail-")]


class Output:
    """What a background CLI process writes, read line by line as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self._stdout: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(proc.stdout, self._stdout.put), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, self.stderr.append),
                             daemon=True)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str], put: Any) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def line(self, timeout: float = 30) -> str:
        """The next line of stdout."""
        try:
            return self._stdout.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line on stdout within {timeout}s; stderr: "
                                 f"{self.stderr}") from None

    def wait_stderr(self, text: str, count: int = 1, timeout: float = 30) -> None:
        """Wait until ``count`` lines of stderr contain ``text``."""
        wait_for(lambda: sum(text in line for line in self.stderr) >= count, timeout=timeout,
                 what=f"{text!r} on stderr ({count}x); stderr so far: {self.stderr}")

    def rest(self) -> tuple[list[str], str]:
        """The remaining stdout lines and the whole stderr, once the process ended."""
        for reader in self._readers:
            reader.join(10)
        lines = []
        while not self._stdout.empty():
            lines.append(self._stdout.get())
        return lines, "\n".join(self.stderr)


def _shut(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    sock.close()


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of the test server. ``cut()`` resets its
    connections and closes new ones at once (a server that is down);
    ``blackhole()`` keeps every socket open and forwards nothing (a network that
    drops packets); ``restore()`` forwards again, for new connections."""

    def __init__(self, dsn: str) -> None:
        params = conninfo_to_dict(dsn)
        self._server = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.dsn = make_conninfo(dsn, host="127.0.0.1", port=self._listener.getsockname()[1])
        self.mode = "forward"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="test-proxy", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                near, _ = self._listener.accept()
            except TimeoutError:
                continue
            near.settimeout(None)
            if self.mode == "cut":
                near.close()
                continue
            with self._lock:
                self._sockets.append(near)
            if self.mode == "blackhole":
                continue  # accepted, and never answered
            far = socket.create_connection(self._server)
            with self._lock:
                self._sockets.append(far)
            for source, target in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self.mode == "forward":
                    target.sendall(data)
        except OSError:
            pass
        if self.mode == "forward":
            _shut(target)

    def _reset(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shut(sock)

    def cut(self) -> None:
        self.mode = "cut"
        self._reset()

    def blackhole(self) -> None:
        self.mode = "blackhole"

    def restore(self) -> None:
        self.mode = "forward"

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._acceptor.join(10)
        self._listener.close()
        self._reset()


@pytest.fixture
def reader_dsn(dsn: str) -> Iterator[str]:
    """The DSN of a login role whose only pgque role is pgque_reader."""
    name = f"pgque_test_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {name} login")
        su.execute(f"grant pgque_reader to {name}")
    try:
        yield make_conninfo(dsn, user=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as su:
            su.execute(f"drop role if exists {name}")


def table_rows(text: str, title: str) -> list[dict[str, str]]:
    """The rows of the table titled ``title`` in rich output, as {column: cell}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    header = next(i for i in range(start, len(lines)) if "┃" in lines[i])
    columns = [cell.strip() for cell in lines[header].strip().strip("┃").split("┃")]
    rows = []
    for line in lines[header + 1:]:
        if line.startswith("└"):
            break
        if "│" in line:
            cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
            rows.append(dict(zip(columns, cells, strict=True)))
    return rows


def slot_keys(conn: psycopg.Connection[Any], slot: int, slots: int, count: int) -> list[str]:
    """``count`` partition keys that route to ``slot`` of ``slots``."""
    rows = conn.execute("select k from (select 'key-' || n as k from generate_series(1, 1000) n) "
                        "keys where pgque.slot_of(k, %s) = %s limit %s",
                        (slots, slot, count)).fetchall()
    assert len(rows) == count
    return [r[0] for r in rows]


# -- install, queues -----------------------------------------------------------------------


def test_install_is_idempotent_and_prints_the_version(empty_dsn: str) -> None:
    first = run_cli("install", "--dsn", empty_dsn)
    second = run_cli("install", "--dsn", empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        version = scalar(conn, "select pgque.version()")
    assert ok(first) == f"pgque {version} installed\n"
    assert ok(second) == f"pgque {version} was installed already: nothing changed\n"
    # Running the script again is no news: its "already exists, skipping" is not shown.
    assert first.stderr == second.stderr == ""


@pytest.mark.superuser_install  # it installs again as the superuser
def test_install_says_when_it_only_granted(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Run again once a role has appeared (made by a superuser after an owner
    that may not create roles installed; here: its grant revoked), the install
    changes only the grants, and says so."""
    conn.execute("revoke usage on schema pgque from pgque_writer, pgque_reader")
    version = pgque.__version__
    assert ok(run_cli("install", "--dsn", dsn)) == (
        f"pgque {version} was installed already: only granted its privileges to "
        "pgque_reader and pgque_writer, which had none\n")
    assert scalar(conn, "select has_schema_privilege('pgque_reader', 'pgque', 'usage')")
    assert ok(run_cli("install", "--dsn", dsn)) == (
        f"pgque {version} was installed already: nothing changed\n")


def test_install_prints_the_servers_notices(dsn: str) -> None:
    """What the server says while installing reaches the user, e.g. that a role the
    installer may not create was skipped. Roles are cluster-wide (and exist by now),
    so the notice here comes from an event trigger of the database instead."""
    suffix = uuid.uuid4().hex[:8]
    owner, database = f"pgque_owner_{suffix}", f"owned_{suffix}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {owner} login nosuperuser nocreaterole nocreatedb")
        su.execute(f"create database {database} owner {owner}")
        try:
            owner_dsn = make_conninfo(dsn, user=owner, dbname=database)
            with psycopg.connect(make_conninfo(dsn, dbname=database), autocommit=True) as db:
                db.execute("create function say_ddl() returns event_trigger language plpgsql "
                           "as $$ begin raise notice 'saw %', tg_tag; "
                           "raise warning 'and warned'; end $$")
                db.execute("create event trigger say_ddl on ddl_command_end "
                           "when tag in ('CREATE SCHEMA') execute function say_ddl()")
            result = run_cli("install", "--dsn", owner_dsn)
            ok(result)
            assert result.stderr.splitlines() == ["notice: saw CREATE SCHEMA",
                                                  "warning: and warned"]
        finally:
            su.execute(f"drop database if exists {database} with (force)")
            su.execute(f"drop role if exists {owner}")


def test_install_print_writes_the_script_without_a_database() -> None:
    assert ok(run_cli("install", "--print")) == pgque.install_script() + "\n"


@pytest.mark.parametrize("module", ["click", "rich"])
def test_without_the_cli_extra_the_command_says_what_to_install(module: str) -> None:
    """click and rich come with the cli extra: without one, the command (the console
    script calls cli.main) ends in one line that names the extra."""
    code = f"import sys; sys.modules[{module!r}] = None; from pgque.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=cli_env())
    line = assert_one_line_error(result, 1)
    assert module in line and "pip install 'pgque[cli]'" in line


def test_the_library_imports_neither_click_nor_rich() -> None:
    """What the cli extra brings is the command's alone."""
    code = ("import sys, pgque, pgque.testing; "
            "print(sorted({m.partition('.')[0] for m in sys.modules} & {'click', 'rich'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=cli_env())
    assert ok(result) == "[]\n"


def test_uninstall_asks_unless_yes(dsn: str, conn: psycopg.Connection[Any]) -> None:
    def installed() -> bool:
        return bool(scalar(conn, "select to_regnamespace('pgque') is not null"))

    declined = run_cli("uninstall", "--dsn", dsn, input="n\n")
    assert declined.returncode == 1 and "aborted" in declined.stderr
    assert installed()
    assert ok(run_cli("uninstall", "--dsn", dsn, input="y\n")) == "pgque uninstalled\n"
    assert not installed()
    assert ok(run_cli("uninstall", "--yes", "--dsn", dsn)) == "pgque is not installed\n"


def test_queue_create_list_and_config(dsn: str) -> None:
    ok(run_cli("queue", "create", "orders", "--max-retries", "3", "--ticker-max-lag", "0.5",
               "--rotation-period", "10 minutes", "--event-tables", "4", "--dsn", dsn))
    ok(run_cli("queue", "create", "audit", "--dsn", dsn))
    queues = json.loads(ok(run_cli("queue", "list", "--json", "--dsn", dsn)))
    assert [q["queue_name"] for q in queues] == ["audit", "orders"]
    orders = queues[1]
    assert orders["max_retries"] == 3
    assert orders["ticker_max_lag"] == 0.5  # an interval comes out as seconds
    assert orders["rotation_period"] == 600.0
    assert orders["event_tables"] == 4
    assert "orders" in ok(run_cli("queue", "list", "--dsn", dsn))

    line = assert_one_line_error(run_cli("queue", "create", "orders", "--dsn", dsn), 1)
    assert "already exists" in line
    ok(run_cli("queue", "create", "orders", "--exist-ok", "--dsn", dsn))

    config = json.loads(ok(run_cli("queue", "config", "orders", "--set", "max_retries=7",
                                   "--set", "ticker-idle-period=2 minutes", "--json",
                                   "--dsn", dsn)))
    assert config["max_retries"] == 7 and config["ticker_idle_period"] == 120.0
    assert json.loads(ok(run_cli("queue", "config", "orders", "--json", "--dsn", dsn))) == config

    ok(run_cli("queue", "drop", "audit", "--dsn", dsn))
    queues = json.loads(ok(run_cli("queue", "list", "--json", "--dsn", dsn)))
    assert [q["queue_name"] for q in queues] == ["orders"]


# -- send ------------------------------------------------------------------------------------


def test_send_reads_json_lines_from_stdin(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe("q", "check")
    lines = '{"n": 1}\n\n[1, 2]\n"text"\n'
    out = ok(run_cli("send", "q", "Thing", "--key", "tenant-1", "--dsn", dsn, input=lines))
    assert out == "sent 3 events to q\n"
    received = drain(client, "q", "check")
    assert [(m.type, m.partition_key, m.payload) for m in received] == [
        ("Thing", "tenant-1", {"n": 1}), ("Thing", "tenant-1", [1, 2]),
        ("Thing", "tenant-1", "text")]

    event_id = int(ok(run_cli("send", "q", "One", '{"x": true}', "--dsn", dsn)))
    [message] = drain(client, "q", "check")
    assert (message.id, message.type, message.partition_key, message.payload) == (
        event_id, "One", None, {"x": True})


def test_send_stdin_with_malformed_line_sends_nothing(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe("q", "check")
    result = run_cli("send", "q", "Thing", "--dsn", dsn, input='{"n": 1}\n[2]\n{"n": 3\n4\n')
    line = assert_one_line_error(result, 1)
    assert "line 3" in line
    assert drain(client, "q", "check") == []
    assert client.queue_info()[0].event_seq == 0  # not even sent and rolled back


# -- tail ------------------------------------------------------------------------------------


def test_tail_prints_matching_event_as_json_then_unsubscribes(client: pgque.Client,
                                                              dsn: str) -> None:
    client.create_queue("q")
    with cli_process("tail", "q", "--limit", "1", "--json", "--key", "wanted",
                     "--dsn", dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        client.send("q", "Other", {"n": 1}, partition_key="unwanted")
        wanted = client.send("q", "Wanted", {"n": 2, "s": "x"}, partition_key="wanted")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    [line] = out.splitlines()
    event = json.loads(line)
    assert (event["id"], event["type"], event["key"], event["payload"]) == (
        wanted, "Wanted", "wanted", {"n": 2, "s": "x"})
    assert event["retry_count"] == 0 and "T" in event["time"]  # ISO 8601
    assert tail_consumers(client) == []


def test_tail_rich_line_shows_id_type_key_and_payload(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    with cli_process("tail", "q", "--limit", "1", "--dsn", dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        event_id = client.send("q", "FileCreated", {"path": "/a [b].txt"}, partition_key="t-1")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    [line] = out.splitlines()
    assert line.startswith(f"{event_id} ")
    assert "FileCreated" in line and "key=t-1" in line and '{"path":"/a [b].txt"}' in line


def test_tail_marks_an_event_that_came_from_a_delay(client: pgque.Client, dsn: str) -> None:
    """`pgque send --deliver-after` delays it (the time on stderr); tail shows it,
    once it entered the log, with delayed=<the id send printed>, as JSON too."""
    client.create_queue("q")
    with cli_process("tail", "q", "--limit", "2", "--dsn", dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        sent = run_cli("send", "q", "Reminder", '{"n": 1}', "--key", "k", "--deliver-after",
                       "0.5", "--dsn", dsn)
        assert sent.returncode == 0, sent.stderr
        delayed_id = int(sent.stdout)
        assert "delayed: enters the log at" in sent.stderr
        plain = client.send("q", "Plain", {"n": 2}, partition_key="k")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    first, second = out.splitlines()
    assert first.startswith(f"{plain} ") and "delayed=" not in first
    assert f"delayed={delayed_id}" in second and "Reminder" in second
    # pgque status: the delayed events waiting and the next due time.
    ok(run_cli("send", "q", "Later", "{}", "--deliver-after", "3600", "--dsn", dsn))
    status = json.loads(ok(run_cli("status", "--json", "--dsn", dsn)))
    (queue,) = [q for q in status["queues"] if q["queue_name"] == "q"]
    assert queue["delayed_events"] == 1 and queue["next_delivery"] is not None
    again = run_cli("send", "q", "Reminder", '{"n": 1}', "--idempotency-key", "r-1",
                    "--dsn", dsn)
    dup = run_cli("send", "q", "Reminder", '{"n": 1}', "--idempotency-key", "r-1",
                  "--dsn", dsn)
    assert again.returncode == dup.returncode == 0
    assert dup.stdout == again.stdout and "duplicate" in dup.stderr
    assert "duplicate" not in again.stderr


def test_tail_from_now_skips_events_not_yet_ticked(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    # Without --from-now, an event sent since the last tick is shown.
    earlier = client.send("q", "Earlier", 1)
    out = ok(run_cli("tail", "q", "--limit", "1", "--json", "--dsn", dsn))
    assert json.loads(out)["id"] == earlier
    # With it, the same situation is skipped: only what comes after the start is shown.
    client.send("q", "Skipped", 2)
    with cli_process("tail", "q", "--from-now", "--limit", "1", "--json",
                     "--dsn", dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        later = client.send("q", "Later", 3)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == [later]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_tail_unsubscribes_when_interrupted(client: pgque.Client, dsn: str,
                                            signum: signal.Signals) -> None:
    client.create_queue("q")
    with cli_process("tail", "q", "--dsn", dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert tail_consumers(client) == []


def test_tail_as_reader_shows_what_a_running_ticker_ticks(client: pgque.Client, dsn: str,
                                                          reader_dsn: str) -> None:
    """A reader may not tick: tail relies on the ticker of someone else."""
    client.create_queue("q")
    with pgque.Ticker(dsn), cli_process("tail", "q", "--limit", "2", "--json",
                                        "--dsn", reader_dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        ids = [client.send("q", "e", n) for n in range(2)]
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == ids
    assert "may not tick" in err
    assert tail_consumers(client) == []


def test_tail_from_now_as_reader_waits_for_someone_elses_tick(client: pgque.Client,
                                                              reader_dsn: str) -> None:
    client.create_queue("q")
    client.send("q", "Skipped", 1)  # sent before the tail starts, not ticked yet
    with cli_process("tail", "q", "--from-now", "--limit", "1", "--json",
                     "--dsn", reader_dsn) as proc:
        # The tail may not tick, so it subscribes only after a tick made here.
        wait_for(lambda: client.tick("q") and tail_consumers(client), timeout=30,
                 what="the tail's consumer")
        later = client.send("q", "Later", 2)
        client.tick("q")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == [later]
    assert tail_consumers(client) == []


def test_tail_reconnects_and_stops_at_once_while_the_server_is_down(client: pgque.Client,
                                                                    dsn: str) -> None:
    client.create_queue("q")
    with Proxy(dsn) as proxy, cli_process("tail", "q", "--json", "--connect-timeout", "1",
                                          "--dsn", proxy.dsn) as proc:
        output = Output(proc)
        [consumer] = wait_for(lambda: tail_consumers(client), timeout=30,
                              what="the tail's consumer")
        first = client.send("q", "e", 1)
        assert json.loads(output.line())["id"] == first
        proxy.cut()
        output.wait_stderr("connection lost")
        second = client.send("q", "e", 2)  # while the tail is away
        proxy.restore()
        output.wait_stderr("reconnected")
        assert json.loads(output.line())["id"] == second  # and the first not again

        proxy.cut()
        output.wait_stderr("connection lost", count=2)
        time.sleep(1.5)  # in its reconnect attempts and the pauses between them
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - stopped
        lines, err = output.rest()
    assert lines == []
    # Stopped at once; then at most --connect-timeout trying to unsubscribe, which
    # fails (the server is out of reach) and says how to remove the consumer.
    assert elapsed < 2.5, err
    assert proc.returncode == 1, err
    assert f"pgque.unsubscribe('q', '{consumer}')" in err.splitlines()[-1], err
    assert tail_consumers(client) == [consumer]


def test_tail_stops_at_once_while_the_server_does_not_answer(client: pgque.Client,
                                                             dsn: str) -> None:
    client.create_queue("q")
    with Proxy(dsn) as proxy, cli_process("tail", "q", "--connect-timeout", "1",
                                          "--dsn", proxy.dsn) as proc:
        [consumer] = wait_for(lambda: tail_consumers(client), timeout=30,
                              what="the tail's consumer")
        proxy.blackhole()
        time.sleep(1)  # its next poll is sent and never answered
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        elapsed = time.monotonic() - stopped
    assert elapsed < 2.5, err
    assert proc.returncode == 1 and consumer in err, err


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_ends_the_wait_to_remove_the_consumer(client: pgque.Client, dsn: str,
                                                              second: signal.Signals) -> None:
    """Removing the consumer waits up to --connect-timeout for a server that does not
    answer; a second signal ends the wait at once, and the tail says how to remove it."""
    client.create_queue("q")
    with Proxy(dsn) as proxy, cli_process("tail", "q", "--connect-timeout", "30",
                                          "--dsn", proxy.dsn) as proc:
        output = Output(proc)
        [consumer] = wait_for(lambda: tail_consumers(client), timeout=30,
                              what="the tail's consumer")
        proxy.blackhole()
        proc.send_signal(signal.SIGINT)
        output.wait_stderr("Ctrl-C again to leave it")
        stopped = time.monotonic()
        proc.send_signal(second)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - stopped
        _, err = output.rest()
    assert elapsed < 2.5, err
    assert proc.returncode == 1, err
    last = err.splitlines()[-1]
    assert "(interrupted)" in last and f"pgque.unsubscribe('q', '{consumer}')" in last, err
    assert tail_consumers(client) == [consumer]


# -- worker and ticker ------------------------------------------------------------------------


def test_worker_runs_handler_from_module_path(client: pgque.Client, dsn: str,
                                              conn: psycopg.Connection[Any]) -> None:
    conn.execute("create table cli_handled (ev_id bigint primary key, type text, key text, "
                 "payload jsonb, pid int)")
    client.create_queue("q")

    def owners() -> list[int | None]:
        return [s.owner_pid for s in client.partition_slot_status("q")]

    with socket.socket() as probe:  # a port free a moment ago, for its metrics
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with cli_process("worker", "cli_handlers:record", "--queue", "q", "--consumer", "g",
                     "--slots", "4", "--concurrency", "2", "--log-level", "warning",
                     "--metrics-port", str(port),
                     PGQUE_DSN=dsn, PYTHONPATH=TESTS_DIR) as proc:
        wait_for(lambda: len(owners()) == 4 and None not in owners(), timeout=30,
                 what="the worker to own every slot")
        events = [("Job", {"n": n}, f"tenant-{n % 5}") for n in range(30)]
        ids = client.send_batch("q", events)
        wait_for(lambda: scalar(conn, "select count(*) from cli_handled") == len(ids),
                 timeout=30, what="every event handled")
        # --metrics-port: the worker's own count, scraped.
        wait_for(lambda: _scraped(port, "pgque_worker_events_total") == len(ids), timeout=30,
                 what="the handled events in the worker's metrics")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        pid = proc.pid
    assert proc.returncode == 0, err
    rows = conn.execute("select ev_id, type, key, payload, pid from cli_handled "
                        "order by ev_id").fetchall()
    assert rows == [(i, t, k, p, pid) for i, (t, p, k) in zip(ids, events, strict=True)]
    assert owners() == [None] * 4  # every slot released on the way out


def _scraped(port: int, sample: str) -> float:
    """The sum of a sample's values in the metrics served on the port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == sample)


def test_worker_exits_with_the_error_when_its_queue_goes_away(client: pgque.Client,
                                                              dsn: str) -> None:
    """An error that retrying cannot heal ends the worker with a one-line message and
    a non-zero exit, instead of a reconnect loop."""
    client.create_queue("q")
    with cli_process("worker", "cli_handlers:record", "--queue", "q", "--consumer", "g",
                     "--slots", "2", "--log-level", "warning", "--no-ticker",
                     PGQUE_DSN=dsn, PYTHONPATH=TESTS_DIR) as proc:
        wait_for(lambda: all(s.owner_pid for s in client.partition_slot_status("q")),
                 timeout=30, what="the worker to own its slots")
        client.drop_queue("q", force=True)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert "Traceback" not in err  # the worker's log lines, then the error
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "'q' does not exist" in last, err


def test_ticker_ticks_until_sigterm(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    with cli_process("ticker", "--log-level", "warning", "--dsn", dsn) as proc:
        event_id = client.send("q", "e", 1)
        # Nobody but the ticker ticks here: the event is delivered only if it runs.
        batch = wait_for(lambda: client.receive("q", "c"), timeout=30, what="a tick")
        assert [m.id for m in batch] == [event_id]
        client.ack(batch)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


# -- status -----------------------------------------------------------------------------------


def status(capsys: pytest.CaptureFixture[str], dsn: str, *args: str) -> str:
    """The stdout of ``pgque status ARGS``, run in this process: no interpreter to
    start for each look."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", "--dsn", dsn, *args])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, (exited.value.code, out, err)
    return out


def status_json(capsys: pytest.CaptureFixture[str], dsn: str, *args: str) -> Any:
    return json.loads(status(capsys, dsn, "--json", *args))


def table_headers(text: str) -> list[list[str]]:
    """The column headers of every table in rich output."""
    return [[cell.strip() for cell in line.strip().strip("┃").split("┃")]
            for line in text.splitlines() if "┃" in line]


def test_status_json_shows_owners_and_pending_per_slot(client: pgque.Client, dsn: str,
                                                       conn: psycopg.Connection[Any],
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    client.create_queue("q")
    client.subscribe("q", "audit")
    client.subscribe_slots("q", "g", slots=2)
    keys = slot_keys(conn, 1, 2, 3)
    client.send_batch("q", [("e", {"n": n}, key) for n, key in enumerate(keys)])

    with pgque.connect(dsn, application_name="billing-7") as owner:
        assert owner.claim_slot("q", "g", 0)
        owner_pid = owner.conn.info.backend_pid
        document = json.loads(ok(run_cli("status", "q", "--json", "--dsn", dsn)))
        text = status(capsys, dsn)
    assert set(document) == {"ticker", "queues", "consumers", "groups", "slots", "generated"}
    assert [q["queue_name"] for q in document["queues"]] == ["q"]
    consumers = {c["consumer_name"]: c for c in document["consumers"]}
    assert set(consumers) == {"audit", "g#0/2", "g#1/2"}
    assert consumers["audit"]["pending_events"] == 3
    slot0, slot1 = document["slots"]
    assert (slot0["consumer_name"], slot0["slot"], slot1["slot"]) == ("g", 0, 1)
    assert slot0["owner_pid"] == owner_pid
    assert (slot0["owner_name"], slot1["owner_name"], slot1["owner_pid"]) == ("billing-7",
                                                                             None, None)
    assert (slot0["pending_events"], slot1["pending_events"]) == (0, 3)
    assert isinstance(slot1["oldest_unconsumed_age"], float)  # seconds, not a string
    assert slot1["oldest_unconsumed_age"] >= 0
    assert slot1["stalled"] is False

    # People see the owner's name (the application name its session set), not its pid.
    rows = table_rows(text, "consumer group slots")
    assert [(r["slot"], r["owner"]) for r in rows] == [("0/2", "billing-7"), ("1/2", "unowned")]
    assert str(owner_pid) not in text
    assert "STALLED" not in text
    headers = table_headers(text)  # summary, queues, consumers, groups, slots
    assert len(headers) == 5 and all(all(header) for header in headers), headers


def test_status_keys_lists_each_groups_keys_with_the_most_waiting(
        client: pgque.Client, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    client.send_batch("q", [("e", {}, key) for key in ["<b>hot</b>"] * 4 + ["warm"] * 2 + [None]])
    text = status(capsys, dsn, "q", "--keys", "2")
    rows = table_rows(text, "keys waiting")
    assert [(r["group"], r["key"], r["pending"]) for r in rows] == [
        ("g", "<b>hot</b>", "4"), ("g", "warm", "2")]  # a key shown as sent, not as markup
    document = json.loads(status(capsys, dsn, "q", "--keys", "5", "--json"))
    assert [(k["consumer_name"], k["partition_key"], k["slot"], k["pending"])
            for k in document["keys"]] == [
        ("g", "<b>hot</b>", client.conn.execute("select pgque.slot_of('<b>hot</b>', 2)")
         .fetchone()[0], 4),  # type: ignore[index]
        ("g", "warm", client.conn.execute("select pgque.slot_of('warm', 2)")
         .fetchone()[0], 2),  # type: ignore[index]
        ("g", None, 0, 1)]
    assert "keys waiting" not in status(capsys, dsn, "q")  # only when asked


def test_status_names_the_workers_and_shows_members_and_epochs(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    client.send_batch("q", [("e", {}, key) for slot in (0, 1) for key in slot_keys(conn, slot,
                                                                                   2, 1)])
    client.tick("q")
    with pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=lambda m: None,
                      ticker=False, name="billing-7") as worker:
        assert worker.wait(lambda: worker.handled == 2, timeout=30)  # epochs come with batches
        document = status_json(capsys, dsn)
        text = status(capsys, dsn)

    slots = document["slots"]
    assert all(s["owner_name"].startswith("billing-7-lane") for s in slots), slots
    epochs = [s["epoch"] for s in slots]
    assert all(isinstance(e, int) for e in epochs), epochs
    [group] = document["groups"]
    assert group == {"queue_name": "q", "consumer_name": "g", "slots": 2, "members": 1,
                     "owned_slots": 2, "newest_epoch": max(epochs), "failure_policy": "skip",
                     "max_attempts": None, "pause_timeout": None, "max_retries": None,
                     "blocked_keys": 0,
                     "dead_letters": 0}
    [row] = table_rows(text, "consumer groups")
    assert (row["group"], row["members"], row["owned"], row["newest epoch"]) == (
        "g", "1", "2/2", str(max(epochs)))
    rows = table_rows(text, "consumer group slots")
    assert [r["owner"] for r in rows] == [s["owner_name"] for s in slots]
    assert [r["epoch"] for r in rows] == [str(e) for e in epochs]
    # Every column of every table says what it is.
    headers = table_headers(text)
    assert len(headers) == 4 and all(all(header) for header in headers), headers


def test_status_stalled_after_defaults_to_the_queues_tick_settings(
        client: pgque.Client, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    client.create_queue("q", ticker_idle_period=3600)
    client.create_queue("brisk", ticker_idle_period=1)
    client.subscribe_slots("q", "g", slots=1)
    client.send("q", "e", {}, partition_key="k")  # nobody ticks: it waits for a tick

    # By default: twice the queue's ticker_idle_period, at least 10 seconds.
    document = status_json(capsys, dsn)
    brisk, q = document["queues"]
    assert (brisk["stalled_after"], q["stalled_after"]) == (10.0, 7200.0)
    assert not brisk["stalled"] and not q["stalled"]
    [slot] = document["slots"]
    assert (slot["stalled_after"], slot["stalled"]) == (7200.0, False)

    # Given: the event waits for a tick longer than that, in an unowned slot.
    document = status_json(capsys, dsn, "--stalled-after", "0")
    brisk, q = document["queues"]
    assert (q["stalled_after"], q["stalled"], brisk["stalled"]) == (0.0, True, False)
    [slot] = document["slots"]
    assert (slot["stalled_after"], slot["stalled"]) == (0.0, True)
    text = status(capsys, dsn, "--stalled-after", "0")
    assert [(r["queue"], r["state"]) for r in table_rows(text, "queues")] == [
        ("brisk", "ok"), ("q", "STALLED")]
    assert [r["state"] for r in table_rows(text, "consumer group slots")] == ["STALLED"]
    [summary] = table_rows(text, "summary")
    assert (summary["queues"], summary["stalled queues"], summary["slots"],
            summary["stalled slots"]) == ("2", "1", "1", "1")

    # Ticked, the queue is fine; the slot still waits for a worker.
    client.tick("q")
    document = status_json(capsys, dsn, "--stalled-after", "0")
    assert [q["stalled"] for q in document["queues"]] == [False, False]
    assert [s["stalled"] for s in document["slots"]] == [True]
    document = status_json(capsys, dsn, "--stalled-after", "5 minutes")
    assert [s["stalled_after"] for s in document["slots"]] == [300.0]
    assert [s["stalled"] for s in document["slots"]] == [False]


def test_status_refuses_a_negative_stalled_after(dsn: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", "--dsn", dsn, "--stalled-after", "-1"])
    out, err = capsys.readouterr()
    assert (exited.value.code, out) == (1, "")
    assert err.startswith("error: ") and "stalled_after" in err and len(err.splitlines()) == 1


def test_status_says_which_ticker_is_active(client: pgque.Client, dsn: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    client.create_queue("q")
    document = status_json(capsys, dsn)
    assert document["ticker"] == {"active_pid": None, "active_name": None}
    [summary] = table_rows(status(capsys, dsn), "summary")
    assert summary["ticker"] == "none active"
    with pgque.Ticker(dsn, name="ops-ticker") as ticker:
        assert ticker.wait_active(timeout=10)
        document = status_json(capsys, dsn)
        [summary] = table_rows(status(capsys, dsn), "summary")
        assert document["ticker"] == {"active_pid": ticker.backend_pid,
                                      "active_name": "ops-ticker"}
    assert summary["ticker"] == "ops-ticker"


def test_status_counts_dead_letters_per_slot(client: pgque.Client, dsn: str,
                                            conn: psycopg.Connection[Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    client.create_queue("q", max_retries=0)
    client.subscribe_slots("q", "g", slots=2)
    [key] = slot_keys(conn, 1, 2, 1)
    client.send("q", "Bad", {"n": 1}, partition_key=key)
    client.tick("q")
    assert client.claim_slot("q", "g", 1)
    batch = client.receive_partitioned("q", "g", slot=1, slots=2)
    assert batch is not None
    assert client.nack(batch, batch.messages, reason="broken") == 1  # a dead letter at once
    client.ack(batch)

    rows = table_rows(status(capsys, dsn), "consumer group slots")
    assert [(r["slot"], r["dead letters"]) for r in rows] == [("0/2", "0"), ("1/2", "1")]
    document = status_json(capsys, dsn, "q")
    assert [s["dead_letters"] for s in document["slots"]] == [0, 1]


def test_status_of_unknown_queue_fails(dsn: str) -> None:
    assert "nosuch" in assert_one_line_error(run_cli("status", "nosuch", "--dsn", dsn), 1)


def test_status_of_a_team_counts_what_the_team_may_see(pgque_deployment: Deployment,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """In the recommended deployment (a non-superuser installed pgque): a team's
    worker runs without ticking, and everyone sees that nothing ticks; each team
    sees, and counts, only its own consumers; the owners' names reach every role."""
    dep = pgque_deployment
    billing, shipping = dep.teams
    with pgque.connect(dep.dsn(dep.owner)) as owner:
        owner.create_queue("orders")
        owner.create_queue("invoices")
        for privilege in ("send", "consume"):
            owner.grant_queue("invoices", billing, privilege)
    for team, subscribe in ((billing, lambda c: (c.subscribe_slots("orders", "charge", slots=2),
                                                 c.subscribe("invoices", "book"))),
                            (shipping, lambda c: c.subscribe("orders", "audit"))):
        with pgque.connect(dep.dsn(dep.login(team))) as client:
            client.conn.execute(f"set role {team}")
            subscribe(client)
    as_owner, as_billing, as_shipping = (
        dep.dsn(dep.owner), dep.dsn(dep.login(billing)), dep.dsn(dep.login(shipping)))

    # The billing worker logs in as a reader: it may not tick, and runs without.
    with pgque.Worker(as_billing, queue="orders", consumer="charge", slots=2,
                      handler=lambda m: None, name="billing-charge") as worker:
        wait_for(lambda: all(s["owner_name"] for s in status_json(capsys, as_owner)["slots"]),
                 timeout=30, what="the worker to own both slots")
        with pgque.connect(dep.dsn(dep.producer)) as producer:
            producer.send("orders", "OrderPlaced", {"order": 1}, partition_key="c-1")
        seen = {who: status_json(capsys, dsn, "--stalled-after", "0")
                for who, dsn in (("owner", as_owner), ("billing", as_billing),
                                 ("shipping", as_shipping))}
        shipping_text = status(capsys, as_shipping, "--stalled-after", "0")
        assert worker.error is None

    for document in seen.values():
        assert document["ticker"] == {"active_pid": None, "active_name": None}
        orders = next(q for q in document["queues"] if q["queue_name"] == "orders")
        assert orders["stalled"] is True  # an event waits, and nothing ticks

    def counts(who: str) -> dict[str, int]:
        return {q["queue_name"]: q["consumers"] for q in seen[who]["queues"]}

    # Subscriptions: audit, charge's two slots, book.
    assert counts("owner") == {"invoices": 1, "orders": 3}
    assert counts("billing") == {"invoices": 1, "orders": 2}
    assert counts("shipping") == {"orders": 1}
    assert [c["consumer_name"] for c in seen["shipping"]["consumers"]] == ["audit"]
    assert seen["shipping"]["groups"] == seen["shipping"]["slots"] == []
    for who in ("owner", "billing"):
        [group] = seen[who]["groups"]
        assert (group["consumer_name"], group["members"], group["owned_slots"]) == (
            "charge", 1, 2)
        assert all(s["owner_name"].startswith("billing-charge-lane")
                   for s in seen[who]["slots"]), seen[who]["slots"]
    [summary] = table_rows(shipping_text, "summary")
    assert summary == {"queues": "1", "stalled queues": "1", "consumers": "1", "groups": "0",
                       "slots": "0", "owned slots": "0", "stalled slots": "0",
                       "ticker": "none active",
                       # Nothing ran maintenance since charge was subscribed.
                       "generated code": "lagging: batch reader of orders, slot indexes of orders"}


# -- dead letters ------------------------------------------------------------------------------


def test_dlq_list_show_replay_purge(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    ids = client.send_batch("q", [("Bad", {"n": 1}, "k1"), ("Bad", {"n": 2}, "k2")])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    assert client.nack(batch, batch.messages, reason="broken") == 2  # straight to dead letters
    client.ack(batch)

    letters = json.loads(ok(run_cli("dlq", "list", "q", "--json", "--dsn", dsn)))
    assert [(d["event_id"], d["consumer"], d["payload"], d["partition_key"], d["reason"])
            for d in letters] == [(ids[0], "c", {"n": 1}, "k1", "broken"),
                                  (ids[1], "c", {"n": 2}, "k2", "broken")]
    first, second = (d["id"] for d in letters)
    shown = json.loads(ok(run_cli("dlq", "show", "q", str(second), "--json", "--dsn", dsn)))
    assert shown == letters[1]

    out = ok(run_cli("dlq", "replay", "q", str(first), "--dsn", dsn))
    assert out == f"dead letter {first} replayed as event {ids[0]}\n"
    assert [d.id for d in client.dead_letters("q")] == [second]
    [again] = drain(client, "q", "c")  # back in the log for its consumer
    assert (again.id, again.payload) == (ids[0], {"n": 1})

    missing = assert_one_line_error(run_cli("dlq", "replay", "q", str(first), "--dsn", dsn), 1)
    assert str(first) in missing
    assert ok(run_cli("dlq", "purge", "q", "--yes", "--dsn", dsn)) == "purged 1 dead letter\n"
    assert client.dead_letters("q") == []


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "stdin", "code", "says"), [
    pytest.param(["queue", "list", "--dsn", BAD_DSN, "--connect-timeout", "1"], None, 1,
                 "cannot connect", id="bad-dsn"),
    pytest.param(["queue", "list", "--dsn", "not a dsn"], None, 1, "invalid DSN",
                 id="malformed-dsn"),
    pytest.param(["queue", "list"], None, 2, "PGQUE_DSN", id="no-dsn"),
    pytest.param(["send", "nosuch", "t", "{}", "--dsn", "{dsn}"], None, 1, "'nosuch'",
                 id="unknown-queue"),
    pytest.param(["send", "q", "t", "--dsn", "{dsn}"], "1\n2\n{oops\n", 1, "line 3",
                 id="malformed-stdin"),
    pytest.param(["send", "q", "t", "{oops", "--dsn", "{dsn}"], None, 2, "PAYLOAD",
                 id="malformed-payload"),
    pytest.param(["queue", "create", "q", "--dsn", "{dsn}"], None, 1, "already exists",
                 id="queue-exists"),
    pytest.param(["queue", "config", "q", "--set", "colour=blue", "--dsn", "{dsn}"], None, 1,
                 "colour", id="unknown-setting"),
    pytest.param(["worker", "no_such_module_xyz:handle", "--queue", "q", "--consumer", "g",
                  "--slots", "2", "--dsn", "{dsn}"], None, 2, "no_such_module_xyz",
                 id="handler-not-importable"),
    pytest.param(["worker", "cli_handlers:missing", "--queue", "q", "--consumer", "g",
                  "--slots", "2", "--dsn", "{dsn}"], None, 2, "no attribute",
                 id="handler-missing"),
    pytest.param(["worker", "cli_handlers:NOT_CALLABLE", "--queue", "q", "--consumer", "g",
                  "--slots", "2", "--dsn", "{dsn}"], None, 2, "not callable",
                 id="handler-not-callable"),
    pytest.param(["worker", "cli_handlers:record", "--queue", "nosuch", "--consumer", "g",
                  "--slots", "2", "--dsn", "{dsn}"], None, 1, "'nosuch'",
                 id="worker-unknown-queue"),
    pytest.param(["queue", "create"], None, 2, "NAME", id="missing-argument"),
    pytest.param(["frobnicate"], None, 2, "frobnicate", id="unknown-command"),
])
def test_errors_are_one_line_without_traceback(client: pgque.Client, dsn: str, args: list[str],
                                                stdin: str | None, code: int,
                                                says: str) -> None:
    client.create_queue("q")
    started = time.monotonic()
    result = run_cli(*(a.replace("{dsn}", dsn) for a in args), input=stdin,
                     PYTHONPATH=TESTS_DIR)
    assert says in assert_one_line_error(result, code)
    assert time.monotonic() - started < 20  # a bad DSN fails fast, not after a long wait
    assert client.queue_info()[0].event_seq == 0  # nothing was sent


def test_not_installed_is_one_line(empty_dsn: str) -> None:
    line = assert_one_line_error(run_cli("queue", "list", "--dsn", empty_dsn), 1)
    assert "pgque install" in line


def test_debug_shows_the_traceback(dsn: str) -> None:
    result = run_cli("--debug", "send", "nosuch", "t", "1", "--dsn", dsn)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "QueueNotFound" in result.stderr
    result = run_cli("send", "nosuch", "t", "1", "--dsn", dsn, PGQUE_DEBUG="1")
    assert result.returncode == 1 and "Traceback" in result.stderr


# -- entry points ------------------------------------------------------------------------------


def test_version() -> None:
    assert ok(run_cli("--version")) == f"pgque {pgque.__version__}\n"


def test_installed_console_script(dsn: str) -> None:
    script = Path(sys.executable).with_name("pgque")
    if not script.exists():
        pytest.skip(f"no console script at {script} (package not installed in this venv)")
    result = subprocess.run([str(script), "queue", "list", "--json"], capture_output=True,
                            text=True, timeout=60, env=cli_env(PGQUE_DSN=dsn))
    assert json.loads(ok(result)) == []


def _send_awkward_events(client: pgque.Client) -> None:
    """A NULL type, a payload nested deeper than Python can parse, and control characters."""
    client.conn.execute("select pgque.send('q', null, '{\"n\": 1}'::text)")
    client.conn.execute("select pgque.send('q', 'deep', %s::text)", ("[" * 5000 + "]" * 5000,))
    client.send("q", "T\x1b[31mred\x07", {"s": "a\x1b]0;title\x07\rb"}, partition_key="k\x1b[2J")


@pytest.mark.parametrize("as_json", [False, True], ids=["rich", "json"])
def test_tail_survives_null_types_deep_payloads_and_escapes_control_characters(
        client: pgque.Client, dsn: str, as_json: bool) -> None:
    client.create_queue("q")
    with cli_process("tail", "q", "--limit", "3", *(["--json"] if as_json else []),
                     "--dsn", dsn) as proc:
        wait_for(lambda: tail_consumers(client), timeout=30, what="the tail's consumer")
        _send_awkward_events(client)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert all(len(line) < 2000 for line in lines)  # the deep payload is cut
    if as_json:
        events = [json.loads(line) for line in lines]
        assert events[0]["type"] is None and events[0]["payload"] == {"n": 1}
        assert events[2]["type"] == "T\x1b[31mred\x07"  # JSON escapes it: no raw ESC in out
        assert events[2]["payload"] == {"s": "a\x1b]0;title\x07\rb"}
    else:
        assert "\\x1b[31mred\\x07" in lines[2] and "key=k\\x1b[2J" in lines[2]
        assert '{"n":1}' in lines[0]
        assert "[[[[" in lines[1]


def test_dlq_list_escapes_control_characters(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    client.send("q", "T\x1b[31mred", {"n": 1}, partition_key="k\x07")
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages, reason="bad\x1b[2J\rthing")
    client.ack(batch)
    out = ok(run_cli("dlq", "list", "q", "--dsn", dsn, COLUMNS="300"))
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "T\\x1b[31mred" in out and "k\\x07" in out and "bad\\x1b[2J\\x0dthing" in out
    shown = ok(run_cli("dlq", "show", "q", "1", "--dsn", dsn, COLUMNS="300"))
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("bad_dsn", [
    "postgresql://u:hunter2-pw@[bad/db",
    "host=127.0.0.1 port=1 user=u password=hunter2-pw dbname=x",
    "host=127.0.0.1 password=hunter2-pw user",
    # libpq quotes what follows an unquoted blank, or takes it for the host.
    "host=127.0.0.1 port=1 user=u password=hunter2-pw s3cret-pw dbname=x",
    "postgresql://u:hunter2-pw@s3cret-pw@127.0.0.1:1/db",
])
def test_status_never_prints_the_dsns_password(bad_dsn: str, debug: bool) -> None:
    """Run for real (tests/test_dsn_secrets.py runs many more DSNs in-process)."""
    result = run_cli(*(["--debug"] if debug else []), "status", "--dsn", bad_dsn,
                     "--connect-timeout", "1")
    assert result.returncode == 1
    assert ("Traceback" in result.stderr) == debug
    shown = result.stdout + result.stderr
    assert "hunter2-pw" not in shown and "s3cret-pw" not in shown, shown
    # The same from the environment (an unreachable server is retried until the timeout).
    result = run_cli("status", "--connect-timeout", "1", PGQUE_DSN=bad_dsn,
                     PGQUE_DEBUG="1" if debug else "0")
    shown = result.stdout + result.stderr
    assert result.returncode == 1
    assert "hunter2-pw" not in shown and "s3cret-pw" not in shown, shown


def test_status_answers_while_a_queue_with_a_group_is_being_dropped(
        capsys: pytest.CaptureFixture[str], client: pgque.Client, dsn: str) -> None:
    """While a drop_queue holds the queue's tables, the slot view cannot count a
    slot's backlog (it waits 100 ms, then says so with a null); the client's
    SlotStatus took only an int, and `pgque status` (table and JSON) failed
    with a ValidationError (found by the review of 26898a4)."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    client.send("q", "e", 1, partition_key="k")
    client.tick("q")
    client.create_queue("other")
    client.subscribe_slots("other", "g", slots=2)
    client.send("other", "e", 1, partition_key="k")
    client.tick("other")
    with psycopg.connect(dsn) as holder:
        holder.execute("select pgque.drop_queue('q', true)")  # open: holds q's tables
        slots = client.partition_slot_status()
        pending = {(s.queue_name, s.slot): s.pending_events for s in slots}
        assert pending[("q", 0)] is None and pending[("q", 1)] is None
        assert sum(pending[("other", k)] or 0 for k in (0, 1)) == 1
        table = status(capsys, dsn)
        assert "other" in table
        document = status_json(capsys, dsn)
        assert {s["queue_name"] for s in document["slots"]} == {"q", "other"}
        holder.rollback()
