"""``make demo``: pgque's motivating workload, end to end, with its guarantees checked.

A multi-tenant storage service emits file events keyed by tenant, from two
producers; a consumer group of 8 slots is handled by 4 worker processes, one of
which is replaced halfway (a rolling restart). The handlers are transactional
(unless ``--no-transactional``): each applies its event's effect, an index
entry and the file's bytes added to the tenant's meter, in the transaction
that acks it, and at three quarters a lane's session is cut mid-batch, as a
crash would. Every handler call is recorded, and at the end the records are
checked: every event handled, per-tenant order held, never two handlers of one
tenant at once, failed events retried, the doomed one dead-lettered, every
effect applied exactly once (none of a failed call, none twice after the cut),
the work spread, the workers stopped cleanly.

The modules, by role:

* :mod:`~pgque.demo.workload`: what the producers send, and sending it;
* :mod:`~pgque.demo.workers`: the worker processes, and the rolling restart;
* :mod:`~pgque.demo.checks`: the records of a run and the checks over them (pure);
* :mod:`~pgque.demo.scenario`: one run, from setup to report and cleanup;
* :mod:`~pgque.demo.command`: the command line (``python -m pgque.demo --help``).
"""

from pgque.demo.checks import (
    CHECK_DEAD_LETTER,
    CHECK_EFFECTS,
    CHECK_EXCLUSIVE,
    CHECK_HANDLED,
    CHECK_ORDER,
    CHECK_RETRIES,
    CHECK_SPREAD,
    CHECK_STOPPED,
    CHECK_THROUGHPUT,
    CHECK_TITLES,
    CHECK_VERIFIED,
    DOOMED_REASON,
    Check,
    Effects,
    Handling,
    Letter,
    Sent,
    verify,
)
from pgque.demo.command import main

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
    "Check",
    "Effects",
    "Handling",
    "Letter",
    "Sent",
    "main",
    "verify",
]
