"""A lock wait granted just as its lock_timeout fires, made to happen on demand.

PostgreSQL arms a lock wait's timeout (``enable_timeouts``) once the backend is
queued, and disarms it (``disable_timeouts``) after it wakes with the lock. A
timeout that fires between the two leaves its cancel pending although the lock
was granted; PostgreSQL raises it (55P03) at the next check for interrupts,
wherever that is. On a loaded machine that happens about once in tens of
thousands of waits. Here gdb, attached to the waiting backend, stops it at the
first, lets the lock holder end, and holds it at the second long enough for the
timer to fire. Needs gdb and the right to trace the server's processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Runs inside gdb (its Python): the two breakpoints, and files as the signals
# between it and the test (gdb's own output is not ours to parse).
_GDB_SCRIPT = """
import gdb, os, time
signals = os.environ["LATE_GRANT_DIR"]
for name in ("SIGALRM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGHUP", "SIGTERM"):
    gdb.execute(f"handle {name} nostop noprint pass")
gdb.execute("set pagination off")

def mark(name):
    open(os.path.join(signals, name), "w").close()

class Disarmed(gdb.Breakpoint):
    def stop(self):
        time.sleep(0.3)  # the timer (1 or 100 ms) fires now, its lock already granted
        self.enabled = False
        mark("held")
        gdb.post_event(lambda: gdb.execute("detach"))
        return False

class Armed(gdb.Breakpoint):
    def stop(self):
        mark("queued")
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(signals, "released")) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.enabled = False
        Disarmed("disable_timeouts")
        return False

Armed("enable_timeouts")
mark("attached")
gdb.execute("continue")
"""


def cannot_trace(backend_pid: int) -> str | None:
    """Why gdb cannot stop backend_pid here (the tests that need it skip), or None:
    no gdb, a server elsewhere (PGQUE_TEST_DSN), or a kernel that lets only root
    trace a process that is not its child (Yama's ptrace_scope)."""
    if shutil.which("gdb") is None:
        return "needs gdb (make system-deps)"
    if not Path(f"/proc/{backend_pid}").exists():
        return "the server's processes are not on this machine"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.exists() and scope.read_text().strip() != "0":
        return "only root may trace the server's processes here (kernel.yama.ptrace_scope)"
    return None


def _wait_for(path: Path, alive: Callable[[], bool], what: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not alive():
            return False
        if time.monotonic() > deadline:
            raise AssertionError(f"gdb: {what} not reached in {timeout:.0f} s")
        time.sleep(0.01)
    return True


@contextmanager
def late_grant(backend_pid: int) -> Iterator[Callable[[Callable[[], object], Callable[[], None]],
                                                     bool]]:
    """Attach gdb to backend_pid; yields ``race(call, release)``: runs ``call`` (a
    statement on that backend) on a thread, and once the backend is queued for a
    lock with a timeout, runs ``release`` (the holder ends), then lets the timer
    fire before the backend disarms it. Returns whether the backend waited at all."""
    with tempfile.TemporaryDirectory(prefix="pgque-late-grant-") as tmp:
        signals = Path(tmp)
        script = signals / "late_grant.py"
        script.write_text(_GDB_SCRIPT)
        log = open(signals / "gdb.log", "w")  # noqa: SIM115 (closed below)
        gdb = subprocess.Popen(["gdb", "-q", "-batch", "-p", str(backend_pid), "-x", str(script)],
                               stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "LATE_GRANT_DIR": tmp})
        try:
            if not _wait_for(signals / "attached", lambda: gdb.poll() is None, "attach"):
                raise AssertionError(f"gdb failed: {(signals / 'gdb.log').read_text()}")

            def race(call: Callable[[], object], release: Callable[[], None]) -> bool:
                thread = threading.Thread(target=call)
                thread.start()
                waited = _wait_for(signals / "queued", thread.is_alive, "the lock wait")
                if waited:
                    release()
                    (signals / "released").touch()
                    _wait_for(signals / "held", lambda: gdb.poll() is None, "the timer")
                thread.join(60)
                assert not thread.is_alive(), "the call did not return"
                return waited

            yield race
        finally:
            try:
                gdb.wait(2)  # (it has detached once the timer was let fire; it may linger)
            except subprocess.TimeoutExpired:
                gdb.terminate()  # gdb detaches from the backend (and removes its breakpoints)
                try:
                    gdb.wait(10)
                except subprocess.TimeoutExpired:
                    gdb.kill()
                    gdb.wait()
            log.close()
