"""``make demo``: pgque end to end on a throwaway PostgreSQL.

Starts an embedded PostgreSQL (unless ``--dsn`` names a server), installs the
engine, and plays a small multi-tenant storage workload: producers emit
FileCreated / FileOverwritten / FileDeleted events keyed by tenant, two
consumers each read the whole log, one handler fails now and then and its
events come back as retries, and one event fails for good into dead letters.
Prints what it did and checks it; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from typing import Any

import pgque
from pgque.localpg import LocalPostgres, find_bindir

QUEUE = "storage-events"
TENANTS = [f"tenant-{n}" for n in range(40)]
KINDS = ["FileCreated", "FileOverwritten", "FileDeleted"]


def say(text: str) -> None:
    print(text, flush=True)


def produce(client: pgque.Client, count: int, rng: random.Random) -> dict[str, list[int]]:
    """Send count events in batches of 100, one transaction each; returns ids per tenant."""
    sent: dict[str, list[int]] = defaultdict(list)
    for start in range(0, count, 100):
        events = []
        for n in range(start, min(start + 100, count)):
            tenant = rng.choice(TENANTS)
            events.append(pgque.Event(rng.choice(KINDS), {"path": f"/{tenant}/f{n}.txt",
                                                          "size": rng.randint(1, 10**6)}, tenant))
        for event, ev_id in zip(events, client.send_batch(QUEUE, events), strict=True):
            assert event.partition_key is not None
            sent[event.partition_key].append(ev_id)
        client.tick(QUEUE)
    return sent


def consume(client: pgque.Client, consumer: str, flaky: set[int],
            doomed: int | None) -> list[pgque.Message[Any]]:
    """Receive until nothing is left; returns what was handled.

    Events in flaky fail on their first delivery only; doomed always fails.
    """
    handled: list[pgque.Message[Any]] = []
    idle_rounds = 0
    while idle_rounds < 2:
        batch = client.receive(QUEUE, consumer, max_events=500)
        if batch is None:
            # Nothing ready: run maintenance (brings due retries back) and tick.
            moved = sum(n for _, step, n in client.maintenance(QUEUE) if step == "retry")
            client.tick(QUEUE)
            idle_rounds = 0 if moved else idle_rounds + 1
            continue
        failed = [m for m in batch
                  if m.id == doomed or (m.id in flaky and m.retry_count == 0)]
        handled.extend(m for m in batch if m not in failed)
        if failed:
            client.nack(batch, failed, reason="simulated handler failure")
        client.ack(batch)
    return handled


def run(dsn: str, events: int) -> bool:
    rng = random.Random(7)
    ok = True
    with pgque.connect(dsn) as client:
        say(f"installed pgque {client.install()}")
        client.create_queue(QUEUE, exist_ok=True, max_retries=2)
        for consumer in ("indexer", "billing"):
            client.subscribe(QUEUE, consumer)
        say(f"queue {QUEUE!r} with consumers 'indexer' and 'billing'")

        started = time.perf_counter()
        sent = produce(client, events, rng)
        all_ids = sorted(i for ids in sent.values() for i in ids)
        say(f"sent {len(all_ids)} events for {len(sent)} tenants "
            f"in {time.perf_counter() - started:.2f}s")

        # The indexer fails once on 2% of events (they come back as retries);
        # one event always fails and ends in dead letters.
        flaky = set(rng.sample(all_ids, len(all_ids) // 50))
        doomed = all_ids[len(all_ids) // 2]
        started = time.perf_counter()
        indexed = consume(client, "indexer", flaky, doomed)
        retried = [m for m in indexed if m.retry_count > 0]
        billed = consume(client, "billing", set(), None)
        elapsed = time.perf_counter() - started
        say(f"consumed in {elapsed:.2f}s: indexer {len(indexed)} events "
            f"({len(retried)} after a retry), billing {len(billed)} events")

        letters = client.dead_letters(QUEUE)
        for letter in letters:
            say(f"dead letter: event {letter.event_id} of {letter.partition_key} for "
                f"{letter.consumer} after {letter.retry_count} retries: {letter.reason}")

        checks = {
            "billing received every event exactly once":
                sorted(m.id for m in billed) == all_ids,
            "indexer handled every event but one":
                sorted(m.id for m in indexed) == [i for i in all_ids if i != doomed],
            "events of each tenant reached billing in send order":
                all([m.id for m in billed if m.partition_key == t] == ids
                    for t, ids in sent.items()),
            "every flaky event was handled on its retry":
                {m.id for m in retried} == flaky - {doomed},
            "the always-failing event is a dead letter":
                [d.event_id for d in letters] == [doomed],
        }
        for name, passed in checks.items():
            say(f"  [{'ok' if passed else 'FAILED'}] {name}")
            ok = ok and passed
        client.unsubscribe(QUEUE, "indexer")
        client.unsubscribe(QUEUE, "billing")
        client.drop_queue(QUEUE)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgque.demo",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dsn", help="use this server instead of an embedded one")
    parser.add_argument("--events", type=int, default=5000)
    args = parser.parse_args(argv)
    if args.dsn:
        return 0 if run(args.dsn, args.events) else 1
    say("starting an embedded PostgreSQL ...")
    with LocalPostgres(find_bindir("embedded")) as server:
        say(f"PostgreSQL {server.major_version} running at {server.dsn()}")
        ok = run(server.dsn(), args.events)
    say("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
