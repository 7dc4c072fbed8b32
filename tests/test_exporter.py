"""The database-side metrics (pgque.metrics(), pgque/exporter.py, ``pgque exporter``)
in the recommended deployment: a non-superuser owner installed pgque, a team's
login runs the group, a producer login sends, an outsider has no pgque role.
Every test scrapes the HTTP endpoint and reads it back with prometheus_client's
parser."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import assert_one_line_error, cli_env, scalar, slot_keys, wait_for
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

import pgque
from pgque import cli
from pgque.exporter import Exporter, ProblemWithDatabase, exposition, families
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"
SLOTS = 4

Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


def scrape(exporter: Exporter) -> Samples:
    """Every sample of one HTTP scrape: name -> labels -> value."""
    with urllib.request.urlopen(exporter.url, timeout=30) as response:
        body = response.read().decode()
    found: Samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            found.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return found


def value(samples: Samples, metric: str, **labels: str | int) -> float | None:
    """The sample of metric with exactly these labels, or None."""
    key = frozenset((k, str(v)) for k, v in labels.items())
    return samples.get(metric, {}).get(key)


def slot_values(samples: Samples, name: str, queue: str = QUEUE,
                group: str = GROUP) -> dict[int, float]:
    return {int(dict(labels)["slot"]): v for labels, v in samples.get(name, {}).items()
            if dict(labels).get("queue") == queue and dict(labels).get("group") == group}


@pytest.fixture
def team(pgque_deployment: Deployment) -> Iterator[pgque.Client]:
    """Billing's login, with its team's group of 4 slots on orders (max_retries 1)."""
    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue(QUEUE, max_retries=1)
    billing = deployment.teams[0]
    with pgque.connect(deployment.dsn(deployment.login(billing)),
                       application_name="billing-lane") as client:
        client.conn.execute(f"set role {billing}")
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
        client.conn.execute("reset role")
        yield client


def test_a_scrape_shows_sends_backlog_owners_retries_and_dead_letters(
        pgque_deployment: Deployment, team: pgque.Client) -> None:
    deployment = pgque_deployment
    slot = 1
    keys = slot_keys(team.conn, slot, SLOTS, 2)
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        producer.send_batch(QUEUE, [("Order", {"n": n}, keys[n % 2]) for n in range(6)])
        producer.send_batch(QUEUE, [("Order", {"n": n}, None) for n in range(4)])
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.tick(QUEUE)
    with Exporter(deployment.dsn(deployment.login(deployment.teams[0])), port=0) as exporter:
        before = scrape(exporter)
        assert value(before, "pgque_up") == 1
        assert value(before, "pgque_queue_events_total", queue=QUEUE) == 10
        assert value(before, "pgque_queue_events_since_last_tick", queue=QUEUE) == 0
        # Every slot is behind by the queue's 10 events (all keys) and by one tick.
        assert slot_values(before, "pgque_slot_behind_events") == dict.fromkeys(range(SLOTS), 10)
        assert slot_values(before, "pgque_slot_ticks_behind") == dict.fromkeys(range(SLOTS), 1)
        assert slot_values(before, "pgque_slot_owned") == dict.fromkeys(range(SLOTS), 0)
        assert "pgque_slot_owner_info" not in before
        assert value(before, "pgque_group_slots", queue=QUEUE, group=GROUP) == SLOTS
        assert all(v >= 0 for v in slot_values(before, "pgque_slot_lag_seconds").values())
        assert len(before["pgque_queue_table_size_bytes"]) == 3  # event tables 0..2

        # The slot's owner drains it; one event fails for a retry, one for good.
        assert team.claim_slot(QUEUE, GROUP, slot)
        batch = team.receive_partitioned(QUEUE, GROUP, slot=slot, slots=SLOTS)
        assert batch is not None and len(batch.messages) == 6
        team.ack(batch, nack=batch.messages[:2], dead=batch.messages[1:2], retry_after=3600)
        while (more := team.receive_partitioned(QUEUE, GROUP, slot=slot, slots=SLOTS)):
            team.ack(more)
        after = scrape(exporter)
        assert slot_values(after, "pgque_slot_behind_events") == {0: 10, 1: 0, 2: 10, 3: 10}
        assert slot_values(after, "pgque_slot_ticks_behind") == {0: 1, 1: 0, 2: 1, 3: 1}
        assert slot_values(after, "pgque_slot_lag_seconds")[slot] == 0
        assert slot_values(after, "pgque_slot_owned") == {0: 0, 1: 1, 2: 0, 3: 0}
        assert slot_values(after, "pgque_slot_retries_waiting") == {0: 0, 1: 1, 2: 0, 3: 0}
        assert slot_values(after, "pgque_slot_dead_letters") == {0: 0, 1: 1, 2: 0, 3: 0}
        epoch = scalar(team.conn, "select epoch from pgque.partition_slot_status where slot = 1")
        assert slot_values(after, "pgque_slot_epoch") == {slot: epoch}
        assert after["pgque_slot_owner_info"] == {frozenset({
            ("queue", QUEUE), ("group", GROUP), ("slot", str(slot)), ("owner", "billing-lane"),
            ("pid", str(team.pinned_pid))}): 1}
        assert value(after, "pgque_group_members", queue=QUEUE, group=GROUP) == 0
        assert slot_values(after, "pgque_slot_stalled") == dict.fromkeys(range(SLOTS), 0)
        assert value(after, "pgque_scrape_duration_seconds") is not None


def test_the_ticker_and_a_stalled_slot(pgque_deployment: Deployment,
                                       team: pgque.Client) -> None:
    """The active ticker by name; a slot whose first unconsumed tick is older than
    the queue's threshold is stalled while nobody owns it, as is a queue whose
    events wait for a tick that nobody makes."""
    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        producer.send(QUEUE, "Order", {"n": 1}, partition_key="k")
    with pgque.connect(deployment.dsn(deployment.ticker),
                       application_name="the-ticker") as ticker, \
            Exporter(deployment.dsn(deployment.owner), port=0) as exporter:
        ticker.tick(QUEUE)
        assert value(scrape(exporter), "pgque_active_ticker") == 0
        assert scalar(ticker.conn, "select pgque.claim_ticker()")
        samples = scrape(exporter)
        assert value(samples, "pgque_active_ticker") == 1
        assert value(samples, "pgque_active_ticker_info", pid=ticker.conn.info.backend_pid,
                     name="the-ticker") == 1
        assert 0 <= value(samples, "pgque_newest_tick_age_seconds") < 60  # type: ignore[operator]
        # An hour ago, as far as the ticks say; then one more event, not ticked.
        with psycopg.connect(deployment.superuser_dsn(), autocommit=True) as su:
            su.execute("update pgque.tick set tick_time = tick_time - interval '1 hour'")
        with pgque.connect(deployment.dsn(deployment.producer)) as producer:
            producer.send(QUEUE, "Order", {"n": 2}, partition_key="k")
        assert team.claim_slot(QUEUE, GROUP, 0)
        samples = scrape(exporter)
    assert value(samples, "pgque_queue_stalled", queue=QUEUE) == 1
    assert value(samples, "pgque_queue_events_since_last_tick", queue=QUEUE) == 1
    lag = slot_values(samples, "pgque_slot_lag_seconds")
    assert all(v > 3500 for v in lag.values()), lag
    # Slot 0 is owned and moved a moment ago; the others nobody owns.
    assert slot_values(samples, "pgque_slot_stalled") == {0: 0, 1: 1, 2: 1, 3: 1}


def test_a_role_sees_what_it_may_use_and_an_outsider_gets_nothing(
        pgque_deployment: Deployment, team: pgque.Client) -> None:
    deployment = pgque_deployment
    billing, shipping = deployment.teams
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue("invoices")
        for privilege in ("send", "consume"):
            owner.grant_queue("invoices", billing, privilege)
    with pgque.connect(deployment.dsn(deployment.login(shipping))) as client:
        client.conn.execute(f"set role {shipping}")
        client.subscribe(QUEUE, "audit")
    with Exporter(deployment.dsn(deployment.login(shipping)), port=0) as exporter:
        samples = scrape(exporter)
    assert {dict(k)["queue"] for k in samples["pgque_queue_events_total"]} == {QUEUE}
    assert "pgque_slot_behind_events" not in samples  # billing's group
    assert "pgque_group_slots" not in samples
    assert value(samples, "pgque_consumer_behind_events", queue=QUEUE, consumer="audit") == 0
    with Exporter(deployment.dsn(deployment.owner), port=0) as exporter:
        samples = scrape(exporter)
    assert {dict(k)["queue"] for k in samples["pgque_queue_events_total"]} == {
        QUEUE, "invoices"}
    assert len(slot_values(samples, "pgque_slot_behind_events")) == SLOTS

    outsider = deployment.dsn(deployment.outsider)
    with psycopg.connect(outsider) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("select * from pgque.metrics()")
    with Exporter(outsider, port=0) as exporter:
        with pytest.raises(ProblemWithDatabase, match="pgque_reader"):
            exporter.check()
        samples = scrape(exporter)  # served all the same, saying it failed
    assert value(samples, "pgque_up") == 0
    assert set(samples) == {"pgque_up", "pgque_scrape_duration_seconds"}


def test_a_scrape_after_the_session_died_says_so_and_the_next_connects_again(
        pgque_deployment: Deployment, team: pgque.Client) -> None:
    with Exporter(pgque_deployment.dsn(pgque_deployment.owner), port=0) as exporter:
        assert value(scrape(exporter), "pgque_up") == 1
        with psycopg.connect(pgque_deployment.superuser_dsn(), autocommit=True) as su:
            assert scalar(su, "select count(pg_terminate_backend(pid, 5000)) from pg_stat_activity"
                              " where application_name = 'pgque-exporter'") == 1
        assert value(scrape(exporter), "pgque_up") == 0
        assert value(scrape(exporter), "pgque_up") == 1


def test_the_text_written_is_what_the_collector_gives(
        pgque_deployment: Deployment, team: pgque.Client) -> None:
    """The exporter writes the rows itself (prometheus_client's writer was slower
    than the query); registered in a registry, the collector's families say the
    same. Label values are escaped by the database and read back as they were."""
    assert team.claim_slot(QUEUE, GROUP, 2)
    odd = 'a "b"\\c\nd'
    with psycopg.connect(pgque_deployment.superuser_dsn()) as su:
        label = scalar(su, "select pgque._label('owner', %s)", (odd,))
    with Exporter(pgque_deployment.dsn(pgque_deployment.owner), port=0) as exporter:
        rows = [*exporter.collector.rows(),
                ("pgque_slot_owner_info", f'queue="q",group="g",slot="0",{label},pid="1"', 1.0),
                ("pgque_queue_events_total", 'queue="q"', float("inf"))]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(exporter.collector)
        assert "pgque_up 1.0" in generate_latest(registry).decode()

    def parsed(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
        return {f.name: [(s.name, s.labels, s.value) for s in f.samples]
                for f in text_string_to_metric_families(text)}

    ours = parsed(exposition(rows))
    theirs = parsed(generate_latest(_Fixed(rows)).decode())  # type: ignore[arg-type]
    assert ours == theirs
    assert [labels["owner"] for _, labels, _ in ours["pgque_slot_owner_info"]] == [
        "billing-lane", odd]
    assert ours["pgque_queue_events"][-1][2] == float("inf")


class _Fixed:
    """A registry of fixed rows, for prometheus_client's own writer."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def collect(self) -> Any:
        return families(self.rows)


def test_the_command_serves_until_sigterm_and_refuses_a_role_without_rights(
        pgque_deployment: Deployment, team: pgque.Client,
        capsys: pytest.CaptureFixture[str]) -> None:
    deployment = pgque_deployment
    with subprocess.Popen(
            [sys.executable, "-m", "pgque.cli", "exporter", "--port", "0",
             "--dsn", deployment.dsn(deployment.owner)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=cli_env()) as proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert "serving http://127.0.0.1:" in line, line
            url = line.split("serving ", 1)[1].strip()
            body = wait_for(lambda: urllib.request.urlopen(url, timeout=30).read().decode(),
                            timeout=30, what="a scrape")
            assert f'pgque_slot_owned{{queue="{QUEUE}",group="{GROUP}",slot="0"}} 0.0' in body
            proc.terminate()
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    with pytest.raises(SystemExit) as exited:
        cli.main(["exporter", "--port", "0", "--dsn", deployment.dsn(deployment.outsider)])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pgque_reader" in err and len(err.splitlines()) == 1


def test_without_the_prometheus_extra_the_command_says_what_to_install() -> None:
    code = ("import sys; sys.modules['prometheus_client'] = None; from pgque.cli import main; "
            "main(['exporter', '--dsn', 'host=/nonexistent'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=cli_env())
    assert "pip install 'pgque[prometheus]'" in assert_one_line_error(result, 1)


def test_the_library_does_not_import_prometheus_client() -> None:
    code = "import sys, pgque; print('prometheus_client' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=cli_env())
    assert result.stdout == "False\n", result.stderr


def test_while_a_drop_queue_holds_the_queue_nothing_reads_as_a_reset_or_waits(
        pgque_deployment: Deployment, team: pgque.Client) -> None:
    """A drop_queue not committed yet holds the queue's sequence and tables: a
    scrape leaves the queue's event counter out (a 0 would look like a counter
    reset, and rate() would count the whole sequence again), and slot_skew
    gives up with 55P03 instead of waiting for the drop's transaction."""
    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        producer.send(QUEUE, "Order", {}, partition_key="k")
    with Exporter(deployment.dsn(deployment.owner), port=0) as exporter:
        before = value(scrape(exporter), "pgque_queue_events_total", queue=QUEUE)
        assert before is not None and before >= 1
        with psycopg.connect(deployment.superuser_dsn()) as dropper:  # its transaction stays open
            dropper.execute("select pgque.drop_queue(%s, true)", (QUEUE,))
            samples = scrape(exporter)
            assert value(samples, "pgque_up") == 1
            assert value(samples, "pgque_queue_events_total", queue=QUEUE) is None
            assert not slot_values(samples, "pgque_slot_behind_events")
            with psycopg.connect(deployment.dsn(deployment.owner), autocommit=True) as other, \
                    pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("select * from pgque.slot_skew(%s, %s)", (QUEUE, GROUP))
            dropper.rollback()
        assert value(scrape(exporter), "pgque_queue_events_total", queue=QUEUE) == before


def test_a_failed_scrape_is_logged_in_one_line(pgque_deployment: Deployment, team: pgque.Client,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with Exporter(pgque_deployment.dsn(pgque_deployment.owner), port=0) as exporter, \
            psycopg.connect(pgque_deployment.superuser_dsn()) as locker:
        locker.execute("lock table pgque.subscription in access exclusive mode")
        with caplog.at_level("WARNING", logger="pgque"):
            assert value(scrape(exporter), "pgque_up") == 0
        locker.rollback()
    failed = [r.getMessage() for r in caplog.records if "scrape failed" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0], failed
    assert "LockNotAvailable" in failed[0]
