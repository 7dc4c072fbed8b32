"""The demo: small runs against the test server, transactional and plain, pass
every check and leave nothing behind; and the checks themselves (pure, over
records) catch what they should: an event never handled, a pair out of send
order, overlapping handlers of one tenant, a retry that never came, a missing
dead letter, an effect applied twice or never, an idle worker.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers import scalar

from pgque.demo import (
    CHECK_DEAD_LETTER,
    CHECK_EFFECTS,
    CHECK_EXCLUSIVE,
    CHECK_HANDLED,
    CHECK_ORDER,
    CHECK_RETRIES,
    CHECK_SPREAD,
    CHECK_STOPPED,
    CHECK_TITLES,
    CHECK_VERIFIED,
    DOOMED_REASON,
    Effects,
    Handling,
    Letter,
    Sent,
    verify,
)

# -- the demo itself ----------------------------------------------------------------------------


def run_demo(dsn: str, *args: str) -> str:
    """Run the demo as a subprocess against ``dsn``; returns its output after
    asserting that it exited 0 and reported every check as passed (the effects'
    only when transactional)."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, "-m", "pgque.demo", "--dsn", dsn, "--timeout", "90", *args],
        capture_output=True, text=True, encoding="utf-8", env=env, timeout=240, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr}"
    titles = [t for t in CHECK_TITLES
              if t != CHECK_EFFECTS or "--no-transactional" not in args]
    for title in titles:
        lines = [line for line in out.splitlines() if f" {title} " in line]
        assert lines, f"check {title!r} missing from the report:\n{out}"
        assert all("✔" in line and "✘" not in line for line in lines), lines
    assert CHECK_EFFECTS in titles or f" {CHECK_EFFECTS} " not in out
    assert "✘" not in out
    assert f"all {len(titles)} checks passed" in out
    return out


def roles(conn: psycopg.Connection[Any]) -> list[str]:
    return [r for (r,) in conn.execute(
        "select rolname from pg_roles where rolname like 'pgque%%' order by 1")]


@pytest.mark.slow
@pytest.mark.superuser_install  # it installs again as the superuser
def test_demo_passes_every_check_and_leaves_nothing_behind(dsn: str) -> None:
    # The default run: transactional, with the rolling restart and the cut session.
    out = run_demo(dsn, "--events", "2000")
    assert "transactional handlers" in out
    assert "cut the session of demo-worker-" in out or "no session was cut" in out
    with psycopg.connect(dsn, autocommit=True) as conn:
        # pgque was installed before the demo, so it stays; the demo's queue and
        # scratch schema go.
        assert scalar(conn, "select to_regnamespace('pgque') is not null")
        assert scalar(conn, "select count(*) from pgque.queue") == 0
        assert scalar(conn, "select count(*) from pgque.consumer_group") == 0
        assert scalar(conn, "select count(*) from pg_namespace "
                            "where starts_with(nspname, 'pgque_demo_')") == 0


@pytest.mark.slow
def test_demo_uninstalls_pgque_where_it_installed_it(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        before = roles(conn)
    out = run_demo(empty_dsn, "--events", "1000", "--no-restart", "--no-transactional")
    assert "plain handlers" in out and "cut the session" not in out
    assert "uninstalled pgque" in out
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert not scalar(conn, "select to_regnamespace('pgque') is not null")
        assert scalar(conn, "select count(*) from pg_namespace "
                            "where starts_with(nspname, 'pgque_demo_')") == 0
        assert roles(conn) == before  # roles that existed (other databases use them) stay


@pytest.mark.slow
@pytest.mark.superuser_install  # it installs again as the superuser
def test_demo_with_the_pause_policy_holds_strict_order(dsn: str) -> None:
    out = run_demo(dsn, "--events", "2000", "--no-restart", "--policy", "pause",
                   "--flaky", "0.03")
    assert "failure policy pause" in out
    assert "in strict send order, failures included" in out


# -- the checks -------------------------------------------------------------------------------

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
MS = timedelta(milliseconds=1)
SLOT_OF = {"t0": 0, "t1": 1, "t2": 0, "t3": 1}
WORKER_OF_SLOT = {0: 1, 1: 2}
FLAKY = (0, 3)  # (producer, seq) of the event that fails once
DOOMED = (1, 5)  # (producer, seq) of the event that always fails


def clean_run() -> tuple[list[Sent], list[Handling], list[Letter]]:
    """Two producers, four tenants on two slots, two workers; one event fails once
    and one always. Events are handled one after another in send order (10 ms
    apart, 5 ms each); the retries come at the end. Each event's file has a
    size of its own."""
    sent: list[Sent] = []
    for seq in range(10):
        for producer in (0, 1):
            fate = ("flaky" if (producer, seq) == FLAKY
                    else "doomed" if (producer, seq) == DOOMED else "ok")
            tenant = f"t{(seq + producer) % 4}"
            sent.append(Sent(100 + len(sent), producer, seq, tenant, fate, 1000 + len(sent)))
    handlings: list[Handling] = []
    clock = T0

    def handle(event: Sent, attempt: int, ok: bool) -> None:
        nonlocal clock
        handlings.append(Handling(event.event_id, event.tenant, event.producer, event.seq,
                                  WORKER_OF_SLOT[SLOT_OF[event.tenant]], 4000, attempt, ok,
                                  clock, clock + 5 * MS))
        clock += 10 * MS

    for event in sent:
        handle(event, 0, event.fate == "ok")
    for event in sent:
        if event.fate == "flaky":
            handle(event, 1, True)
        elif event.fate == "doomed":
            handle(event, 1, False)
            handle(event, 2, False)
    doomed = next(s for s in sent if s.fate == "doomed")
    letters = [Letter(doomed.event_id, doomed.tenant, 2,
                      f"SimulatedFailure: event {doomed.event_id} {DOOMED_REASON}")]
    return sent, handlings, letters


def clean_effects(sent: list[Sent], letters: list[Letter]) -> tuple[dict[int, int],
                                                                    dict[str, int]]:
    """What transactional handlers commit on a clean run: every event's index
    entry once, and its size metered to its tenant; nothing of the dead letters."""
    dead = {x.event_id for x in letters}
    entries = {s.event_id: 1 for s in sent if s.event_id not in dead}
    metered: dict[str, int] = {}
    for s in sent:
        if s.event_id not in dead:
            metered[s.tenant] = metered.get(s.tenant, 0) + s.size
    return entries, metered


def failing(sent: list[Sent], handlings: list[Handling], letters: list[Letter],
            workers: tuple[int, ...] = (1, 2), slot_of: dict[str, int] | None = None,
            effects: Effects | None = None) -> set[str]:
    """The titles of the checks that fail on these records."""
    checks = verify(sent, handlings, letters, max_retries=2, workers=workers,
                    slot_of=slot_of or SLOT_OF, effects=effects)
    return {c.title for c in checks if not c.passed}


def test_a_clean_run_passes_every_check() -> None:
    sent, handlings, letters = clean_run()
    checks = verify(sent, handlings, letters, max_retries=2, workers=(1, 2), slot_of=SLOT_OF,
                    effects=Effects(*clean_effects(sent, letters)))
    # (The workers' exit codes and pgque verify are the scenario's checks.)
    assert [c.title for c in checks] == [t for t in CHECK_TITLES
                                         if t not in (CHECK_STOPPED, CHECK_VERIFIED)]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert "19 events applied once each, 1 dead letters not at all" in checks[5].detail
    assert "4 failed calls rolled back, 0 successful calls uncommitted" in checks[5].detail
    # A plain run (no effects): no effects check.
    plain = verify(sent, handlings, letters, max_retries=2, workers=(1, 2), slot_of=SLOT_OF)
    assert [c.title for c in plain] == [t for t in CHECK_TITLES
                                        if t not in (CHECK_EFFECTS, CHECK_STOPPED, CHECK_VERIFIED)]


def test_an_event_never_handled_fails_the_first_check() -> None:
    sent, handlings, letters = clean_run()
    lost = sent[7].event_id
    assert failing(sent, [h for h in handlings if h.event_id != lost], letters) == {CHECK_HANDLED}


def test_a_run_cut_short_fails_the_first_check() -> None:
    sent, handlings, letters = clean_run()
    checks = verify(sent, handlings, letters, max_retries=2, workers=(1, 2), slot_of=SLOT_OF,
                    planned=len(sent) + 100)
    assert {c.title for c in checks if not c.passed} == {CHECK_HANDLED}
    assert "only 20 of 120 events were sent" in checks[0].detail


def test_a_duplicate_delivery_is_allowed_and_counted() -> None:
    sent, handlings, letters = clean_run()
    again = dataclasses.replace(handlings[-1], event_id=sent[-1].event_id, tenant=sent[-1].tenant,
                                worker=WORKER_OF_SLOT[SLOT_OF[sent[-1].tenant]], attempt=0,
                                ok=True, started=T0 + timedelta(seconds=9),
                                ended=T0 + timedelta(seconds=9) + MS)
    checks = verify(sent, [*handlings, again], letters, max_retries=2, workers=(1, 2),
                    slot_of=SLOT_OF)
    assert all(c.passed for c in checks)
    assert "1 duplicate deliveries" in checks[0].detail


def test_a_pair_out_of_send_order_fails_the_order_check() -> None:
    sent, handlings, letters = clean_run()
    # Two consecutive events of producer 0 for one tenant: swap their handling times.
    stream = [s for s in sent if s.producer == 0 and s.tenant == "t1" and s.fate == "ok"]
    a, b = stream[0].event_id, stream[1].event_id
    ha = next(h for h in handlings if h.event_id == a)
    hb = next(h for h in handlings if h.event_id == b)
    swapped = [dataclasses.replace(h, started=hb.started, ended=hb.ended) if h is ha
               else dataclasses.replace(h, started=ha.started, ended=ha.ended) if h is hb
               else h for h in handlings]
    assert failing(sent, swapped, letters) == {CHECK_ORDER}


def test_under_pause_a_later_event_started_before_a_failed_one_was_done_fails() -> None:
    """The clean run handles the flaky event's retry at the end, after its tenant's
    later events: fine under skip, an order break under pause. Moved up to right
    after its failure, the same records pass the strict check."""
    sent, handlings, letters = clean_run()
    assert failing(sent, handlings, letters) == set()
    checks = verify(sent, handlings, letters, max_retries=2, workers=(1, 2),
                    slot_of=SLOT_OF, policy="pause")
    assert {c.title for c in checks if not c.passed} == {CHECK_ORDER}
    # Pause-shaped records: each failed event's retries right after its failure,
    # the rest of its stream after that.
    paused: list[Handling] = []
    clock = T0
    for event in sent:
        for h in [h for h in handlings if h.event_id == event.event_id]:
            paused.append(dataclasses.replace(h, started=clock, ended=clock + 5 * MS))
            clock += 10 * MS
    checks = verify(sent, paused, letters, max_retries=2, workers=(1, 2), slot_of=SLOT_OF,
                    policy="pause")
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert "strict send order" in next(c for c in checks if c.title == CHECK_ORDER).detail


def test_overlapping_handlers_of_one_tenant_fail_the_exclusivity_check() -> None:
    sent, handlings, letters = clean_run()
    # The second handling of tenant t2 starts while the first one still runs,
    # on the other worker (order is kept: it still starts after the first).
    first, second = [h for h in handlings if h.tenant == "t2"][:2]
    overlapping = [dataclasses.replace(h, worker=2, started=first.started + MS,
                                       ended=first.started + 3 * MS) if h is second else h
                   for h in handlings]
    assert failing(sent, overlapping, letters) == {CHECK_EXCLUSIVE}


def test_an_overlap_with_an_earlier_long_call_is_caught() -> None:
    sent, handlings, letters = clean_run()
    # The first call of t0 runs long, past its successor's successor.
    calls = [h for h in handlings if h.tenant == "t0"]
    long_call = dataclasses.replace(calls[0], ended=calls[2].started + MS)
    mutated = [long_call if h is calls[0] else h for h in handlings]
    assert failing(sent, mutated, letters) == {CHECK_EXCLUSIVE}


def test_a_retry_that_never_came_fails_the_retry_check() -> None:
    sent, handlings, letters = clean_run()
    flaky = next(s for s in sent if s.fate == "flaky").event_id
    without_retry = [h for h in handlings if not (h.event_id == flaky and h.attempt == 1)]
    assert failing(sent, without_retry, letters) == {CHECK_HANDLED, CHECK_RETRIES}


def test_an_unexpected_failure_fails_the_retry_check() -> None:
    sent, handlings, letters = clean_run()
    victim = next(h for h in handlings if h.attempt == 0 and h.ok)
    retried = dataclasses.replace(victim, attempt=1, started=T0 + timedelta(seconds=5),
                                  ended=T0 + timedelta(seconds=5) + MS)
    mutated = [dataclasses.replace(h, ok=False) if h is victim else h for h in handlings]
    assert failing(sent, [*mutated, retried], letters) == {CHECK_RETRIES}


def test_a_missing_or_wrong_dead_letter_fails_its_check() -> None:
    sent, handlings, letters = clean_run()
    assert failing(sent, handlings, []) == {CHECK_DEAD_LETTER}
    wrong_reason = [dataclasses.replace(letters[0], reason="KeyError: 'path'")]
    assert failing(sent, handlings, wrong_reason) == {CHECK_DEAD_LETTER}
    stray = Letter(sent[0].event_id, sent[0].tenant, 2, DOOMED_REASON)
    assert failing(sent, handlings, [*letters, stray]) == {CHECK_DEAD_LETTER}
    # Given up after one retry when the queue allows two.
    doomed = letters[0].event_id
    early = [h for h in handlings if not (h.event_id == doomed and h.attempt == 2)]
    assert failing(sent, early, letters) == {CHECK_DEAD_LETTER}


def test_an_idle_worker_fails_the_spread_check() -> None:
    sent, handlings, letters = clean_run()
    four_slots = {"t0": 0, "t1": 1, "t2": 2, "t3": 3}
    assert failing(sent, handlings, letters, workers=(1, 2, 3),
                   slot_of=four_slots) == {CHECK_SPREAD}
    # With more workers than slots (three for two here) some must idle: no failure.
    assert failing(sent, handlings, letters, workers=(1, 2, 3)) == set()
    # Events handled by a worker that is not one of the run's.
    assert failing(sent, handlings, letters, workers=(1,)) == {CHECK_SPREAD}


def test_an_effect_applied_twice_fails_the_effects_check() -> None:
    sent, handlings, letters = clean_run()
    entries, metered = clean_effects(sent, letters)
    twice = sent[4]
    # The index entry and the meter both show it; either alone is caught too.
    both = Effects({**entries, twice.event_id: 2},
                   {**metered, twice.tenant: metered[twice.tenant] + twice.size})
    assert failing(sent, handlings, letters, effects=both) == {CHECK_EFFECTS}
    checks = verify(sent, handlings, letters, max_retries=2, workers=(1, 2), slot_of=SLOT_OF,
                    effects=both)
    assert f"1 applied more than once: #{twice.event_id}" in checks[5].detail
    assert f"1 tenants metered wrong; e.g. {twice.tenant}" in checks[5].detail
    entry_only = Effects({**entries, twice.event_id: 2}, metered)
    assert failing(sent, handlings, letters, effects=entry_only) == {CHECK_EFFECTS}
    meter_only = Effects(entries, {**metered, twice.tenant: metered[twice.tenant] + twice.size})
    assert failing(sent, handlings, letters, effects=meter_only) == {CHECK_EFFECTS}


def test_an_effect_never_applied_fails_the_effects_check() -> None:
    sent, handlings, letters = clean_run()
    entries, metered = clean_effects(sent, letters)
    # The flaky event's retry was handled, but its effect did not commit.
    lost = next(s for s in sent if s.fate == "flaky")
    gone = Effects({e: n for e, n in entries.items() if e != lost.event_id},
                   {**metered, lost.tenant: metered[lost.tenant] - lost.size})
    assert failing(sent, handlings, letters, effects=gone) == {CHECK_EFFECTS}
    checks = verify(sent, handlings, letters, max_retries=2, workers=(1, 2), slot_of=SLOT_OF,
                    effects=gone)
    assert f"1 never applied: #{lost.event_id}" in checks[5].detail


def test_a_failed_calls_effect_left_behind_fails_the_effects_check() -> None:
    sent, handlings, letters = clean_run()
    entries, metered = clean_effects(sent, letters)
    # The doomed event's writes were not rolled back with its savepoint.
    doomed = next(s for s in sent if s.fate == "doomed")
    kept = Effects({**entries, doomed.event_id: 1},
                   {**metered, doomed.tenant: metered.get(doomed.tenant, 0) + doomed.size})
    assert failing(sent, handlings, letters, effects=kept) == {CHECK_EFFECTS}
    # An effect of an event that was never sent.
    stray = Effects({**entries, 999: 1}, metered)
    assert failing(sent, handlings, letters, effects=stray) == {CHECK_EFFECTS}


def test_a_call_made_again_after_a_lost_session_is_not_a_duplicate_effect() -> None:
    sent, handlings, letters = clean_run()
    # An event handled successfully twice (its first transaction was lost with its
    # session), its effect committed once: a duplicate delivery, not a duplicate effect.
    again = dataclasses.replace(handlings[-1], event_id=sent[-1].event_id, tenant=sent[-1].tenant,
                                worker=WORKER_OF_SLOT[SLOT_OF[sent[-1].tenant]], attempt=0,
                                ok=True, started=T0 + timedelta(seconds=9),
                                ended=T0 + timedelta(seconds=9) + MS)
    effects = Effects(*clean_effects(sent, letters))
    checks = verify(sent, [*handlings, again], letters, max_retries=2, workers=(1, 2),
                    slot_of=SLOT_OF, effects=effects)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert "1 duplicate deliveries" in checks[0].detail
    assert "1 successful calls uncommitted (a lost session) and made again" in checks[5].detail
