"""The records of a demo run and the checks over them.

The workers record every handler call (:class:`Handling`, times from the
database clock), the producers what they sent (:class:`Sent`), and the queue
keeps its dead letters (:class:`Letter`). In a transactional run the handlers
also apply each event's effect in the transaction that acks it; what they
applied is read back as :class:`Effects`. :func:`verify` holds them against the
guarantees and returns one :class:`Check` per line of the report. It is pure,
so tests/test_demo.py can feed it records made up to break each guarantee.

The handling records are written over a connection of their own, outside any
transaction of the Worker's: they tell of handler calls, which are at least
once, and a transactional handler's call is recorded even when its transaction
is later lost with its session (its batch comes back and the call is made
again: a duplicate delivery). Only :class:`Effects` tell what committed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "CHECK_DEAD_LETTER",
    "CHECK_EFFECTS",
    "CHECK_EXCLUSIVE",
    "CHECK_HANDLED",
    "CHECK_ORDER",
    "CHECK_RETRIES",
    "CHECK_SPREAD",
    "CHECK_STOPPED",
    "CHECK_THROUGHPUT",
    "CHECK_TITLES",
    "CHECK_VERIFIED",
    "DOOMED_REASON",
    "HANDLING_COLUMNS",
    "Check",
    "Effects",
    "Handling",
    "Letter",
    "Sent",
    "verdict",
    "verify",
]

# What the handler says when the doomed event fails; its dead letter must say it too.
DOOMED_REASON = "is doomed: it fails on every attempt"

# The titles of the checks, in report order (tests look for them).
CHECK_HANDLED = "every event handled"
CHECK_ORDER = "per-tenant order held"
CHECK_EXCLUSIVE = "one handler per tenant at a time"
CHECK_RETRIES = "failed events retried and handled"
CHECK_DEAD_LETTER = "doomed event in dead letters"
CHECK_EFFECTS = "effects applied exactly once"  # transactional runs only
CHECK_SPREAD = "slots spread over workers"
CHECK_THROUGHPUT = "throughput"
CHECK_STOPPED = "workers stopped cleanly"
CHECK_VERIFIED = "pgque verify found no violation"  # the workers' own record, checked by pgque
CHECK_TITLES = (CHECK_HANDLED, CHECK_ORDER, CHECK_EXCLUSIVE, CHECK_RETRIES, CHECK_DEAD_LETTER,
                CHECK_EFFECTS, CHECK_SPREAD, CHECK_THROUGHPUT, CHECK_STOPPED, CHECK_VERIFIED)


# -- records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """One event as a producer sent it.

    ``seq`` is its position in its producer's send order; ``fate`` says how the
    handler treats it: ``"ok"``, ``"flaky"`` (fails its first attempt) or
    ``"doomed"`` (fails every attempt); ``size``, the file's size in bytes
    (what a transactional handler meters).
    """

    event_id: int
    producer: int
    seq: int
    tenant: str
    fate: str = "ok"
    size: int = 0


@dataclass(frozen=True)
class Handling:
    """One handler call, as a worker recorded it (times from the database clock)."""

    event_id: int
    tenant: str
    producer: int
    seq: int
    worker: int  # the worker's number, 1..workers
    pid: int
    attempt: int  # the message's retry_count: 0 on the first delivery
    ok: bool
    started: datetime
    ended: datetime


@dataclass(frozen=True)
class Letter:
    """A dead letter of the demo queue."""

    event_id: int
    tenant: str | None
    retry_count: int
    reason: str | None


@dataclass(frozen=True)
class Effects:
    """What a transactional run's handlers committed: the index entries (one row
    per application of an event's effect, with no key to refuse a second one),
    counted by event id, and the bytes metered per tenant (a running sum that a
    second application would inflate)."""

    entries: Mapping[int, int]
    metered: Mapping[str, int]


@dataclass(frozen=True)
class Check:
    """One line of the verification report."""

    title: str
    passed: bool
    detail: str

# Columns of the handling table: the fields of Handling, in the order the workers
# copy rows in.
HANDLING_COLUMNS = tuple(f.name for f in dataclasses.fields(Handling))


# -- checks ------------------------------------------------------------------------------------


def verify(sent: Sequence[Sent], handlings: Sequence[Handling], letters: Sequence[Letter], *,
           max_retries: int, workers: Sequence[int], slot_of: Mapping[str, int],
           planned: int | None = None, effects: Effects | None = None,
           policy: str = "skip") -> list[Check]:
    """Check a run's records against the guarantees; one :class:`Check` per title
    of :data:`CHECK_TITLES` except the workers' exit codes (the caller knows those)
    and, unless ``effects`` are given (a transactional run), the effects.

    ``workers`` are the numbers of the workers that ran (each should have handled
    events); ``slot_of`` maps each tenant to its slot; ``planned``, how many events
    the producers were to send (fewer were sent when the run was cut short);
    ``policy``, the group's failure policy: under ``"pause"`` the order is checked
    strictly, failures included.
    """
    by_event: dict[int, list[Handling]] = defaultdict(list)
    for handling in sorted(handlings, key=lambda h: (h.started, h.ended)):
        by_event[handling.event_id].append(handling)
    return [
        _check_handled(sent, handlings, by_event, planned),
        _check_strict_order(sent, by_event) if policy == "pause" else _check_order(sent, by_event),
        _check_exclusive(handlings),
        _check_retries(sent, by_event, policy),
        _check_dead_letter(sent, by_event, letters, max_retries),
        *([_check_effects(sent, handlings, letters, effects)] if effects is not None else []),
        _check_spread(handlings, workers, slot_of),
        _check_throughput(by_event),
    ]


def _ids(events: Sequence[int], limit: int = 3) -> str:
    shown = ", ".join(f"#{e}" for e in events[:limit])
    return shown + (f" and {len(events) - limit} more" if len(events) > limit else "")


def _check_handled(sent: Sequence[Sent], handlings: Sequence[Handling],
                   by_event: Mapping[int, list[Handling]], planned: int | None) -> Check:
    # The doomed event counts as handled once attempted: its fate is checked below.
    missing = [s.event_id for s in sent
               if not any(h.ok or s.fate == "doomed" for h in by_event.get(s.event_id, ()))]
    known = {s.event_id for s in sent}
    unknown = sorted(set(by_event) - known)
    # A duplicate is the same delivery (event and attempt) handled again: at-least-once.
    deliveries = Counter((h.event_id, h.attempt) for h in handlings)
    duplicates = sum(n - 1 for n in deliveries.values())
    succeeded = sum(1 for s in sent if any(h.ok for h in by_event.get(s.event_id, ())))
    doomed = sum(1 for s in sent if s.fate == "doomed")
    problems = []
    if planned is not None and len(sent) < planned:
        problems.append(f"only {len(sent):,} of {planned:,} events were sent")
    if missing:
        problems.append(f"{len(missing)} never handled: {_ids(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} handled but never sent: {_ids(unknown)}")
    detail = (f"{succeeded:,} of {len(sent):,} events handled successfully, "
              f"{doomed} doomed; {len(handlings):,} handler calls, "
              f"{duplicates} duplicate deliveries")
    return Check(CHECK_HANDLED, not problems, "; ".join([*problems, detail]))


def _check_order(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]]) -> Check:
    # The first handling of an event is its first attempt, which comes in send
    # order; retries come later by design, so only first handlings are compared.
    streams: dict[tuple[int, str], list[Sent]] = defaultdict(list)
    for s in sorted(sent, key=lambda s: (s.producer, s.seq)):
        streams[(s.producer, s.tenant)].append(s)
    broken: list[str] = []
    compared = 0
    for (producer, tenant), events in streams.items():
        firsts = [(s, by_event[s.event_id][0]) for s in events if by_event.get(s.event_id)]
        for (a, ha), (b, hb) in itertools.pairwise(firsts):
            compared += 1
            if not ha.started < hb.started:
                broken.append(f"producer {producer}, {tenant}: #{b.event_id} (sent {b.seq}) "
                              f"first handled before #{a.event_id} (sent {a.seq})")
    if broken:
        return Check(CHECK_ORDER, False,
                     f"{len(broken)} out of order; e.g. " + "; ".join(broken[:2]))
    return Check(CHECK_ORDER, True,
                 f"{len(streams):,} (producer, tenant) streams: {compared:,} consecutive pairs "
                 f"first handled in send order (retries aside)")


def _check_strict_order(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]]) -> Check:
    """Under the pause policy, failures included: no call of an event starts before
    its (producer, tenant)'s previous event was done, that is, handled (its first
    successful call ended) or, when it always fails, given up (its last call ended)."""
    streams: dict[tuple[int, str], list[Sent]] = defaultdict(list)
    for s in sorted(sent, key=lambda s: (s.producer, s.seq)):
        streams[(s.producer, s.tenant)].append(s)
    broken: list[str] = []
    compared = 0
    for (producer, tenant), events in streams.items():
        for a, b in itertools.pairwise(events):
            calls_a, calls_b = by_event.get(a.event_id, []), by_event.get(b.event_id, [])
            if not calls_a or not calls_b:
                continue  # the first check reports it
            ok = [h.ended for h in calls_a if h.ok]
            done = min(ok) if ok else max(h.ended for h in calls_a)
            compared += 1
            if calls_b[0].started < done:
                broken.append(f"producer {producer}, {tenant}: #{b.event_id} (sent {b.seq}) "
                              f"started before #{a.event_id} (sent {a.seq}) was done")
    if broken:
        return Check(CHECK_ORDER, False,
                     f"{len(broken)} out of order; e.g. " + "; ".join(broken[:2]))
    return Check(CHECK_ORDER, True,
                 f"{len(streams):,} (producer, tenant) streams: {compared:,} consecutive pairs "
                 f"in strict send order, failures included (pause policy)")


def _check_exclusive(handlings: Sequence[Handling]) -> Check:
    by_tenant: dict[str, list[Handling]] = defaultdict(list)
    for h in handlings:
        by_tenant[h.tenant].append(h)
    overlaps: list[str] = []
    moved = 0
    for tenant, calls in by_tenant.items():
        calls.sort(key=lambda h: (h.started, h.ended))
        moved += len({h.worker for h in calls}) > 1
        # Compare with the latest end so far, not only the previous call: a long
        # call may overlap several later ones.
        latest = calls[0]
        for h in calls[1:]:
            if h.started < latest.ended:
                overlaps.append(f"{tenant}: worker {latest.worker} #{latest.event_id} "
                                f"and worker {h.worker} #{h.event_id}")
            if h.ended > latest.ended:
                latest = h
    if overlaps:
        return Check(CHECK_EXCLUSIVE, False,
                     f"{len(overlaps)} overlapping handler calls; e.g. " + "; ".join(overlaps[:2]))
    return Check(CHECK_EXCLUSIVE, True,
                 f"{len(handlings):,} handler calls of {len(by_tenant)} tenants never overlapped "
                 f"in time; {moved} tenants changed workers during the run")


def _check_retries(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]],
                   policy: str = "skip") -> Check:
    flaky = [s for s in sent if s.fate == "flaky"]
    not_retried: list[int] = []
    waits: list[float] = []
    for s in flaky:
        calls = by_event.get(s.event_id, [])
        first_fail = next((h for h in calls if h.attempt == 0 and not h.ok), None)
        retry_ok = next((h for h in calls if h.attempt > 0 and h.ok), None)
        if first_fail is None or retry_ok is None:
            not_retried.append(s.event_id)
        else:
            waits.append((retry_ok.started - first_fail.ended).total_seconds())
    # Only flaky first attempts and doomed ones may fail: anything else is a handler bug.
    fates = {s.event_id: s.fate for s in sent}
    unexpected = sorted({h.event_id for calls in by_event.values() for h in calls if not h.ok
                         and not (fates.get(h.event_id) == "doomed"
                                  or (fates.get(h.event_id) == "flaky" and h.attempt == 0))})
    problems = []
    if not flaky:
        problems.append("no event was meant to fail once: nothing was tested")
    if not_retried:
        problems.append(f"{len(not_retried)} not handled on a retry: {_ids(not_retried)}")
    if unexpected:
        problems.append(f"{len(unexpected)} failed unexpectedly: {_ids(unexpected)}")
    if problems:
        return Check(CHECK_RETRIES, False, "; ".join(problems))
    where = ("before their tenant's later events" if policy == "pause"
             else "behind their slot's backlog")
    return Check(CHECK_RETRIES, True,
                 f"{len(flaky)} events failed their first attempt; all came back, {where}, "
                 f"and were handled {statistics.median(waits):.2f} s later (median), "
                 f"{max(waits):.2f} s at most")


def _check_dead_letter(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]],
                       letters: Sequence[Letter], max_retries: int) -> Check:
    doomed = [s for s in sent if s.fate == "doomed"]
    if len(doomed) != 1:
        return Check(CHECK_DEAD_LETTER, False, f"expected one doomed event, {len(doomed)} sent")
    event = doomed[0]
    calls = by_event.get(event.event_id, [])
    # A set: a redelivered attempt is a legal duplicate, counted by the first check.
    attempts = sorted({h.attempt for h in calls})
    expected = list(range(max_retries + 1))
    mine = [x for x in letters if x.event_id == event.event_id]
    others = [x.event_id for x in letters if x.event_id != event.event_id]
    problems = []
    if attempts != expected:
        problems.append(f"attempts {attempts}, expected {expected}")
    if any(h.ok for h in calls):
        problems.append("it was handled successfully")
    if len(mine) != 1:
        problems.append(f"{len(mine)} dead letters for it, expected 1")
    elif DOOMED_REASON not in (mine[0].reason or ""):
        problems.append(f"reason {mine[0].reason!r}")
    elif mine[0].retry_count != max_retries:
        problems.append(f"retry count {mine[0].retry_count}, expected {max_retries}")
    if others:
        problems.append(f"other dead letters: {_ids(others)}")
    if problems:
        return Check(CHECK_DEAD_LETTER, False,
                     f"event #{event.event_id} ({event.tenant}): " + "; ".join(problems))
    return Check(CHECK_DEAD_LETTER, True,
                 f"event #{event.event_id} ({event.tenant}) failed {len(calls)} times "
                 f"(max_retries {max_retries}), dead letter reason: {mine[0].reason!r}")


def _check_effects(sent: Sequence[Sent], handlings: Sequence[Handling],
                   letters: Sequence[Letter], effects: Effects) -> Check:
    # Expected from what was sent alone: every event's effect once, except the
    # dead letters' (each of their attempts failed, and its writes rolled back).
    dead = {x.event_id for x in letters}
    due = [s for s in sent if s.event_id not in dead]
    expected: Counter[str] = Counter()
    for s in due:
        expected[s.tenant] += s.size
    entries = effects.entries
    duplicated = sorted(e for e, n in entries.items() if n > 1)
    lost = [s.event_id for s in due if not entries.get(s.event_id)]
    undue = sorted(e for e in entries if e in dead)
    known = {s.event_id for s in sent}
    unknown = sorted(e for e in entries if e not in known)
    off = sorted(t for t in expected.keys() | effects.metered.keys()
                 if effects.metered.get(t, 0) != expected[t])
    problems = []
    if duplicated:
        problems.append(f"{len(duplicated)} applied more than once: {_ids(duplicated)}")
    if lost:
        problems.append(f"{len(lost)} never applied: {_ids(lost)}")
    if undue:
        problems.append(f"{len(undue)} dead letters applied: {_ids(undue)}")
    if unknown:
        problems.append(f"{len(unknown)} applied but never sent: {_ids(unknown)}")
    if off:
        t = off[0]
        problems.append(f"{len(off)} tenants metered wrong; e.g. {t}: "
                        f"{effects.metered.get(t, 0):,} bytes, expected {expected[t]:,}")
    if problems:
        return Check(CHECK_EFFECTS, False, "; ".join(problems))
    # Every failed call rolled its effect back (its savepoint); a successful call
    # beyond an event's first is one whose transaction was lost with its session.
    failed = sum(1 for h in handlings if not h.ok)
    successes = Counter(h.event_id for h in handlings if h.ok)
    repeated = sum(n - 1 for n in successes.values())
    return Check(CHECK_EFFECTS, True,
                 f"{len(due):,} events applied once each, {len(dead)} dead letters not at all; "
                 f"{sum(expected.values()):,} bytes metered over {len(expected)} tenants, as "
                 f"sent; {failed} failed calls rolled back, {repeated} successful calls "
                 f"uncommitted (a lost session) and made again")


def _check_spread(handlings: Sequence[Handling], workers: Sequence[int],
                  slot_of: Mapping[str, int]) -> Check:
    events: Counter[int] = Counter()
    slots: dict[int, set[int]] = defaultdict(set)
    for h in handlings:
        if h.ok:
            events[h.worker] += 1
            slots[h.worker].add(slot_of[h.tenant])
    idle = [w for w in workers if not events[w]]
    # With more workers than slots some must idle; otherwise every worker should work.
    spare = max(0, len(workers) - len(set(slot_of.values())))
    strangers = sorted(set(events) - set(workers))
    detail = "; ".join(f"w{w}: slots {','.join(map(str, sorted(slots[w]))) or '-'} "
                       f"({events[w]:,} events)" for w in sorted({*workers, *events}))
    problems = []
    if len(idle) > spare:
        problems.append(f"workers {', '.join(map(str, idle))} handled nothing")
    if strangers:
        problems.append(f"unknown workers {', '.join(map(str, strangers))} handled events")
    if problems:
        return Check(CHECK_SPREAD, False, "; ".join([*problems, detail]))
    busy = len(workers) - len(idle)
    return Check(CHECK_SPREAD, True, f"{busy} of {len(workers)} workers handled events: {detail}")


def _check_throughput(by_event: Mapping[int, list[Handling]]) -> Check:
    # Measured over first attempts: the retries' tail is retry_after plus
    # maintenance, a setting rather than a speed.
    firsts = [hs[0] for hs in by_event.values() if hs]
    if not firsts:
        return Check(CHECK_THROUGHPUT, False, "nothing was handled")
    span = (max(h.ended for h in firsts) - min(h.started for h in firsts)).total_seconds()
    rate = len(firsts) / span if span > 0 else math.inf
    calls = [h for hs in by_event.values() for h in hs]
    busy = statistics.median((h.ended - h.started).total_seconds() * 1000 for h in calls)
    return Check(CHECK_THROUGHPUT, True,
                 f"{len(firsts):,} events first handled in {span:.1f} s: {rate:,.0f} events/s "
                 f"over {len({h.worker for h in calls})} workers; handler call median "
                 f"{busy:.2f} ms")

def verdict(checks: Sequence[Check]) -> str:
    """The last line of the demo, as rich markup."""
    failed = [c.title for c in checks if not c.passed]
    if failed:
        return f"[bold red]✘ {len(failed)} of {len(checks)} checks failed:[/] " + ", ".join(failed)
    return f"[bold green]✔ all {len(checks)} checks passed[/]"
