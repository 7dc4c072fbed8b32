"""Bad input gets a specific exception and changes nothing."""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import drain

import pgque
import pgque.errors
from pgque._dsn import redact
from pgque.codec import decode_payload

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


@pytest.fixture
def client(dsn: str) -> Any:
    with pgque.connect(dsn) as c:
        c.create_queue("q")
        c.subscribe("q", "c")
        yield c


def state(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """Everything a failed call must leave as it was."""
    return (
        conn.execute("select count(*) from pgque.event_1").fetchone(),
        conn.execute("select * from pgque.subscription order by sub_id").fetchall(),
        conn.execute("select * from pgque.cursor order by cur_sub, cur_seq").fetchall(),
        conn.execute("select queue_name, current_table from pgque.queue_info").fetchall(),
        conn.execute("select count(*) from pgque.retry_queue").fetchone(),
        conn.execute("select count(*) from pgque.dead_letter").fetchone(),
        conn.execute("select count(*) from pgque.tick").fetchone(),
    )


CASES: list[tuple[str, type[pgque.PgqueError], Callable[[pgque.Client], Any]]] = [
    ("send to unknown queue", pgque.QueueNotFound, lambda c: c.send("nope", "e", 1)),
    ("send_batch to unknown queue", pgque.QueueNotFound,
     lambda c: c.send_batch("nope", [("e", 1)])),
    ("receive unknown queue", pgque.QueueNotFound, lambda c: c.receive("nope", "c")),
    ("receive unknown consumer", pgque.ConsumerNotFound, lambda c: c.receive("q", "nobody")),
    ("subscribe unknown queue", pgque.QueueNotFound, lambda c: c.subscribe("nope", "c")),
    ("non-JSON bytes payload", pgque.PayloadError, lambda c: c.send("q", "e", b"{not json")),
    ("non-JSON in a batch", pgque.PayloadError,
     lambda c: c.send_batch("q", [("e", 1), ("e", b"nope")])),
    ("unencodable payload", pgque.PayloadError, lambda c: c.send("q", "e", object())),
    ("oversized partition key", pgque.PartitionKeyTooLong,
     lambda c: c.send("q", "e", 1, partition_key="k" * 513)),
    ("oversized key in a batch", pgque.PartitionKeyTooLong,
     lambda c: c.send_batch("q", [("e", 1, "k"), ("e", 2, "x" * 600)])),
    ("queue name with a space", pgque.InvalidName, lambda c: c.create_queue("bad name")),
    ("empty queue name", pgque.InvalidName, lambda c: c.create_queue("")),
    ("queue name too long", pgque.InvalidName, lambda c: c.create_queue("q" * 101)),
    ("quote in queue name", pgque.InvalidName, lambda c: c.create_queue("q'; drop table x;--")),
    ("reserved # in consumer", pgque.InvalidName, lambda c: c.subscribe("q", "c#0/4")),
    ("existing queue", pgque.QueueExists, lambda c: c.create_queue("q")),
    ("unknown setting", pgque.InvalidConfig, lambda c: c.create_queue("q2", colour=3)),
    ("negative interval", pgque.InvalidConfig, lambda c: c.create_queue("q2", ticker_max_lag=-1)),
    ("too few event tables", pgque.InvalidConfig, lambda c: c.create_queue("q2", event_tables=1)),
    ("event_tables after creation", pgque.InvalidConfig,
     lambda c: c.set_queue_config("q", event_tables=4)),
    ("drop queue with consumers", pgque.QueueInUse, lambda c: c.drop_queue("q")),
    ("max_events below 1", pgque.InvalidArgument, lambda c: c.receive("q", "c", max_events=0)),
    ("replay unknown dead letter", pgque.DeadLetterNotFound,
     lambda c: c.replay_dead_letter("q", 12345)),
]


@pytest.mark.parametrize(("case", "error", "call"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(
        client: pgque.Client, conn: psycopg.Connection[Any], case: str,
        error: type[pgque.PgqueError], call: Callable[[pgque.Client], Any]) -> None:
    client.send("q", "e", 0)
    before = state(conn)
    with pytest.raises(error) as info:
        call(client)
    assert info.value.sqlstate in (error.sqlstate, None)
    assert state(conn) == before


def test_acking_a_finished_batch(client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    assert client.ack(batch) is True
    before = state(conn)
    with pytest.raises(pgque.BatchNotActive):
        client.ack(batch)
    with pytest.raises(pgque.BatchNotActive):
        client.nack(batch, batch.messages)
    assert state(conn) == before


def test_plain_api_refuses_slot_subscriptions(client: pgque.Client,
                                              conn: psycopg.Connection[Any]) -> None:
    # A slot subscription can only be made by the partition layer; forge one here
    # to check the plain calls keep their hands off it.
    sub_id = conn.execute("insert into pgque.subscription (sub_queue, sub_consumer) "
                          "values (1, 'g#0/2') returning sub_id").fetchone()
    assert sub_id is not None
    conn.execute("insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_part) "
                 "select %s, 1, max(tick_id), (pgque._cursor_parts()).part from pgque.tick",
                 (sub_id[0],))
    with pytest.raises(pgque.SlotSubscriptionError):
        client.receive("q", "g#0/2")


def test_errors_inside_callers_transaction_leave_it_usable_after_rollback(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        c = pgque.Client(conn)
        c.create_queue("q")
        c.subscribe("q", "c")
        conn.commit()
        with pytest.raises(pgque.QueueNotFound):
            c.send("missing", "e", 1)
        conn.rollback()
        c.send("q", "e", 1)
        conn.commit()
        assert len(drain(c, "q", "c")) == 1


HUGE = "q" * 1_000_000

LONG_NAME_CASES: list[tuple[str, type[pgque.PgqueError], Callable[[pgque.Client], Any]]] = [
    ("send", pgque.QueueNotFound, lambda c: c.send(HUGE, "e", 1)),
    ("send_batch", pgque.QueueNotFound, lambda c: c.send_batch(HUGE, [("e", 1)])),
    ("receive, queue", pgque.QueueNotFound, lambda c: c.receive(HUGE, "c")),
    ("receive, consumer", pgque.ConsumerNotFound, lambda c: c.receive("q", HUGE)),
    ("receive_partitioned", pgque.ConsumerNotFound,
     lambda c: c.receive_partitioned("q", HUGE, slot=0, slots=1)),
    ("create_queue", pgque.InvalidName, lambda c: c.create_queue(HUGE)),
    ("subscribe", pgque.InvalidName, lambda c: c.subscribe("q", HUGE)),
    ("setting", pgque.InvalidConfig, lambda c: c.create_queue("q2", **{HUGE: 1})),
    ("setting value", pgque.InvalidConfig, lambda c: c.create_queue("q2", ticker_max_lag=HUGE)),
    ("drop_queue", pgque.QueueNotFound, lambda c: c.drop_queue(HUGE)),
]


@pytest.mark.parametrize(("what", "error", "call"), LONG_NAME_CASES,
                         ids=[case[0] for case in LONG_NAME_CASES])
def test_long_names_are_cut_in_messages(client: pgque.Client, what: str,
                                        error: type[pgque.PgqueError],
                                        call: Callable[[pgque.Client], Any]) -> None:
    """A 1 MB name must not put 1 MB into every error message (and server log line)."""
    with pytest.raises(error) as caught:
        call(client)
    assert len(str(caught.value)) < 1000
    assert len(str(caught.value.__cause__)) < 1000
    assert "..." in str(caught.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused(client: pgque.Client, bad: float) -> None:
    """JSON has no NaN or Infinity: refused, not stored as null."""
    before = state(client.conn)
    with pytest.raises(pgque.PayloadError):
        client.send("q", "e", {"x": [1.5, {"y": bad}]})
    with pytest.raises(pgque.PayloadError):
        client.send("q", "e", bad)
    with pytest.raises(pgque.PayloadError):
        client.send_batch("q", [("e", 1), ("e", {"z": bad})])
    # A batch searches its payloads for null once: the bad one is found among
    # payloads that hold null themselves, raw JSON included.
    with pytest.raises(pgque.PayloadError):
        client.send_batch("q", [("e", None), ("e", b'{"a": null}'), ("e", {"z": [None, bad]}),
                                ("e", [None])])
    assert state(client.conn) == before
    assert client.send("q", "e", {"x": None, "y": 1.5}) > 0  # null itself is fine
    sent = client.send_batch("q", [("e", None), ("e", b'{"a": null}'), ("e", [None, 2.5])])
    assert len(sent) == 3


def nested_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def nested_dict(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("payload", [nested_list(100_000), nested_dict(100_000),
                                     b"[" * 100_000 + b"]" * 100_000],
                         ids=["list", "dict", "raw bytes"])
def test_deeply_nested_payloads_are_refused(client: pgque.Client, payload: Any) -> None:
    """Neither RecursionError nor the server's stack depth error (54001): PayloadError."""
    before = state(client.conn)
    with pytest.raises(pgque.PayloadError):
        client.send("q", "e", payload)
    with pytest.raises(pgque.PayloadError):
        client.send_batch("q", [("e", 1), ("e", payload)])
    assert state(client.conn) == before


def test_a_payload_too_deep_to_decode_is_a_payload_error(client: pgque.Client) -> None:
    """The server accepts JSON deeper than Python can decode: accessing the payload says so."""
    deep = "[" * 5000 + "]" * 5000
    client.conn.execute("select pgque.send('q', 'e', %s::text)", (deep,))
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    [message] = batch.messages
    assert message.data is not None and len(message.data) == 10_000
    with pytest.raises(pgque.PayloadError):
        message.payload  # noqa: B018
    with pytest.raises(pgque.PayloadError):
        decode_payload(deep, list)
    client.ack(batch)


PASSWORD = "hunter2-pw"
LEAKY_DSNS = [
    f"postgresql://u:{PASSWORD}@[bad/db",  # libpq echoes a malformed URI whole
    f"postgresql://u:{PASSWORD}@127.0.0.1:1/db?connect_timeout=1",
    f"host=127.0.0.1 port=1 user=u password={PASSWORD} dbname=x connect_timeout=1",
    f"host=127.0.0.1 port=1 password='{PASSWORD}' user",  # malformed key=value
    f"postgresql://u@[bad/db?password={PASSWORD}",
]


@pytest.mark.parametrize("dsn", LEAKY_DSNS)
def test_connect_errors_never_show_the_password(dsn: str) -> None:
    for connect in (pgque.connect, pgque.open_connection):
        with pytest.raises(pgque.ConnectError) as info:
            connect(dsn, timeout=0.5)
        shown = "".join(traceback.format_exception(info.value))
        assert PASSWORD not in shown
        assert PASSWORD not in str(info.value)


@pytest.mark.parametrize(("text", "expected"), [
    ("postgresql://u:pw@h/db", "postgresql://u:***@h/db"),
    ("postgres://u:p%40w@h:5/db?x=1", "postgres://u:***@h:5/db?x=1"),
    ("host=h password=pw user=u", "host=h password=*** user=u"),
    ("host=h password = 'p w\\'x' user=u", "host=h password = *** user=u"),
    ("postgresql://u@h/db?sslmode=require&password=pw&x=1",
     "postgresql://u@h/db?sslmode=require&password=***&x=1"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
])
def test_redact_hides_passwords(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_redact_hides_the_dsns_password_wherever_it_is_quoted() -> None:
    assert redact('missing "=" after "pw-x" in connection info string',
                  "host=h password=pw-x") == 'missing "=" after "***" in connection info string'


def test_the_error_catalogue_is_one_source() -> None:
    """pgque/errors.py is the catalogue: every code the SQL (or the install) raises
    has its class, every class's code is raised, and the docs' table is the
    catalogue, class for class."""
    root = Path(pgque.__file__).resolve().parent
    sources = [p.read_text("utf-8") for p in (root / "sql").rglob("*.sql")]
    sources.append((root / "_script.py").read_text("utf-8"))
    raised = {code for text in sources
              for code in re.findall(r"errcode\s*=\s*'(PQ\d{3})'", text)}
    classes = [getattr(pgque.errors, name) for name in pgque.errors.__all__]
    errors = [cls for cls in classes if isinstance(cls, type) and issubclass(cls, Exception)]
    coded = {cls.sqlstate: cls for cls in errors if cls.sqlstate}
    assert raised == {code for code in coded if code.startswith("PQ")}
    assert all(code in pgque.errors._BY_SQLSTATE for code in coded)  # mapped by code
    api = (root.parent / "docs" / "api.md").read_text("utf-8")
    errors_at = api.index("### Errors")
    section = api[errors_at:api.index("\n#", errors_at + 1)]  # to the next heading
    documented = {(name, code.strip().replace("(none)", ""))
                  for name, code in re.findall(r"^\| `(\w+)` \|([^|]*)\|", section, re.M)}
    assert documented == {(cls.__name__, cls.sqlstate or "") for cls in errors}
