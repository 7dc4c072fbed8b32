"""The demo's command line: ``python -m pgque.demo``, ``make demo``, ``pgque demo``.

Without ``--dsn`` the demo runs on a throwaway embedded PostgreSQL; with it, on
that server (see :class:`~pgque.demo.scenario.Demo` for what it leaves there:
nothing). The exit code is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from types import FrameType

from rich.console import Console

from pgque.demo.checks import verdict
from pgque.demo.scenario import Demo, Options
from pgque.testing.localpg import LocalPostgres, find_bindir

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None) -> Options:
    """Parse the command line into :class:`Options`."""
    parser = argparse.ArgumentParser(
        prog="python -m pgque.demo",
        description="pgque's motivating workload (a multi-tenant storage service, partitioned "
                    "by tenant), end to end, with its guarantees checked.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dsn", help="use this server instead of an embedded one")
    parser.add_argument("--events", type=int, default=20_000, help="events to send")
    parser.add_argument("--tenants", type=int, default=300, help="tenants (partition keys)")
    parser.add_argument("--producers", type=int, default=2, help="producer threads")
    parser.add_argument("--slots", type=int, default=8, help="slots of the consumer group")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--flaky", type=float, default=0.01,
                        help="share of events that fail their first attempt")
    parser.add_argument("--work-ms", type=float, default=0.0,
                        help="simulated work per event, in milliseconds")
    parser.add_argument("--max-retries", type=int, default=2, help="the queue's max_retries")
    parser.add_argument("--retry-after", type=float, default=0.2,
                        help="seconds before a failed event comes back")
    parser.add_argument("--policy", choices=["skip", "pause"], default="skip",
                        help="the group's failure policy: skip (a failed event comes back "
                             "later, its tenant goes on) or pause (its tenant waits for it: "
                             "strict per-tenant order, checked)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for every event to be handled")
    parser.add_argument("--seed", type=int, default=1, help="seed of the workload")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="halfway, replace worker 1 by a new one (a rolling restart)")
    parser.add_argument("--transactional", action=argparse.BooleanOptionalAction, default=True,
                        help="transactional handlers: each event's effect commits with the "
                             "ack; at three quarters a lane's session is cut mid-batch, and "
                             "every effect is checked to be applied exactly once (without: "
                             "plain handlers, at least once)")
    args = parser.parse_args(argv)
    if min(args.producers, args.workers, args.tenants) < 1 or args.events < 2 * args.producers:
        parser.error("need a producer, a worker, a tenant and two events per producer")
    if not 0 <= args.flaky < 1:
        parser.error("--flaky is a share: at least 0, below 1")
    return Options(args.dsn, args.events, args.tenants, args.producers, args.slots, args.workers,
                   args.flaky, args.work_ms, args.max_retries, args.retry_after, args.timeout,
                   args.seed, args.restart, args.transactional, args.policy)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 when every check passed)."""
    options = parse_args(argv)
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, width=120)  # logs and pipes: fewer wrapped lines
    console.rule("[bold]pgque demo[/]: a multi-tenant storage service, partitioned by tenant")
    started = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so the workers, the queue and the server are cleaned up.
    # (The demo is a script, not a lifecycle.Service: its steps wait in many places, and
    # unwinding by exception runs every cleanup on the way out.)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    try:
        if options.dsn:
            checks = Demo(options.dsn, options, console).run()
        else:
            server = LocalPostgres(find_bindir("embedded"))
            try:
                with console.status("starting an embedded PostgreSQL"):
                    server.start()
                console.print(f"[bold cyan]▸[/] Embedded PostgreSQL {server.major_version} "
                              f"running at {server.dsn()}", highlight=False)
                checks = Demo(server.dsn(), options, console).run()
            finally:
                server.close()
                console.print("[bold cyan]▸[/] Embedded PostgreSQL stopped and deleted")
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]")
        return 130
    except Exception:  # an exit code for the CLI rather than a raise; cleanup ran already
        console.print_exception(max_frames=8)
        console.print("[bold red]demo failed[/]")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    console.print(f"{verdict(checks)} [dim](the demo took {time.monotonic() - started:.1f} s)[/]")
    return 0 if checks and all(c.passed for c in checks) else 1
