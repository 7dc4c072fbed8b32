"""Worker processes for the suites that measure pgque.Worker, and their CPU time.

:class:`WorkerProcess` starts ``python -m bench.worker_process`` (one real OS
process, one interpreter), stops it with SIGTERM (the Worker finishes its
batches in flight and releases its slots) and reads back what it handled.
:func:`cpu_seconds` reads a process's CPU time from ``/proc``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pgque
from bench.measure import BenchError

__all__ = ["WorkerProcess", "WorkerResult", "cpu_seconds", "machine_cpu", "wait_for_group"]

_REPO_ROOT = Path(__file__).resolve().parent.parent
_STOP_TIMEOUT = 60.0  # seconds: a stopping worker finishes its batches in flight first
_STDERR_TAIL = 2_000  # characters of a failed worker's stderr quoted in the error
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class WorkerResult:
    """What a worker process reports at exit (see bench.worker_process)."""

    pid: int
    handled: int
    failed: int
    ids: list[int]
    started: list[float] = field(default_factory=list)


class WorkerProcess:
    """One ``bench.worker_process`` child; its output file lives in a private temp dir."""

    def __init__(self, dsn: str, queue: str, consumer: str, *args: str,
                 module: str = "bench.worker_process") -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="pgque-bench-worker-")
        self._out = Path(self._dir.name) / "result.json"
        # stderr to a file, not a pipe: nobody reads it while the worker runs,
        # and a full pipe would block the worker's logging.
        self._stderr: IO[bytes] = open(Path(self._dir.name) / "stderr", "w+b")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, dsn, queue, consumer,
             str(self._out), *args],
            cwd=_REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._stderr)
        self._stop_sent = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def check_alive(self) -> None:
        """Raise BenchError (with its stderr) if the process has already exited."""
        if self._proc.poll() is not None:
            raise BenchError(f"worker process {self.pid} exited early with status "
                             f"{self._proc.returncode}: {self._stderr_tail()}")

    def request_stop(self) -> None:
        """Send SIGTERM without waiting: stop several workers at once, then stop() each."""
        # Once only: the Worker restores the default handler when it returns, so
        # a second SIGTERM would kill the process while it writes its result.
        if not self._stop_sent and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            self._stop_sent = True

    def stop(self) -> WorkerResult:
        """SIGTERM, wait for a clean exit, and return what the worker handled."""
        try:
            self.request_stop()
            try:
                status = self._proc.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise BenchError(f"worker process {self.pid} did not stop within "
                                 f"{_STOP_TIMEOUT:.0f} s of SIGTERM") from None
            if status != 0 or not self._out.exists():
                raise BenchError(f"worker process {self.pid} exited with status {status}: "
                                 f"{self._stderr_tail()}")
            data: dict[str, Any] = json.loads(self._out.read_text(encoding="utf-8"))
            return WorkerResult(pid=data["pid"], handled=data["handled"], failed=data["failed"],
                                ids=data["ids"], started=data.get("started", []))
        finally:
            self.close()

    def close(self) -> None:
        """Make sure the process is gone (killed if it still runs) and clean up."""
        if self._proc.poll() is None:
            self._proc.kill()  # only reached on an error path: the run is failing anyway
            self._proc.wait()
        self._stderr.close()
        self._dir.cleanup()

    def _stderr_tail(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read().decode("utf-8", "replace").strip()
        return text[-_STDERR_TAIL:] or "(no output)"


def wait_for_group(client: pgque.Client, queue: str, consumer: str,
                   workers: list[WorkerProcess], timeout: float = 60.0) -> None:
    """Block until every worker has joined the group and the slots are spread evenly.

    Evenly means what the Workers converge to: every slot owned, ``members``
    equal to the number of workers, and each of them owning its fair share
    (differing by at most one). Until then slots would still move during the run.
    """
    deadline = time.monotonic() + timeout
    while True:
        for worker in workers:
            worker.check_alive()
        status = client.group_status(queue, consumer)
        owners = _owner_processes(client, [s.owner_pid for s in status.slots])
        counts = {owner: owners.count(owner) for owner in set(owners)}
        if (status.members == len(workers) and None not in counts
                and len(counts) == len(workers)
                and max(counts.values()) - min(counts.values()) <= 1):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{len(workers)} workers did not share the slots of "
                             f"{queue}/{consumer} within {timeout:.0f} s: {status}")
        time.sleep(0.05)


def _owner_processes(client: pgque.Client, backend_pids: list[int | None]) -> list[str | None]:
    """The worker process behind each slot owner's backend pid (None: no owner).

    A Worker holds its slots on several lane sessions, one backend each; the
    sessions of one process share its name (``bench-worker-<pid>``, see
    bench.worker_process) up to the ``-lane<k>`` suffix."""
    rows = client.conn.execute(
        "select pid, application_name from pg_stat_activity where pid = any(%s)",
        ([pid for pid in backend_pids if pid is not None],)).fetchall()
    names = {pid: re.sub(r"-lane\d+$", "", name) for pid, name in rows}
    return [None if pid is None else names.get(pid, f"backend {pid}") for pid in backend_pids]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads included.

    ``/proc/<pid>/stat`` (not ``task/<tid>/stat``) sums the whole thread group;
    the unit is the kernel's clock tick (10 ms with the usual USER_HZ of 100).
    """
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        text = stat.read()
    # The command name (field 2) may hold spaces or parentheses: split after it.
    fields = text[text.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of the line
    return (utime + stime) / _CLOCK_TICKS


def machine_cpu() -> tuple[float, float]:
    """The whole machine's busy and total CPU seconds so far (all cores, from /proc/stat).

    Busy is everything but idle and iowait; the share of two readings' deltas
    says whether a run was CPU-bound (near 100%) or waiting on something else.
    """
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    total = sum(fields[:8])
    busy = total - fields[3] - fields[4]
    return busy / _CLOCK_TICKS, total / _CLOCK_TICKS
