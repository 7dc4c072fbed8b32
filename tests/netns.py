"""Real packet loss between a client and PostgreSQL: a network namespace on veth links.

A :class:`NetnsLink` is a network namespace joined to the host by two veth
pairs, each with its own link-local /30 (``169.254.A.B``: host end ``.1``,
namespace end ``.2``); no other address, route or rule of the host is touched
(the host gets one nftables table of its own, only while a link is cut):

* the *data* link, which :meth:`~NetnsLink.blackhole` cuts: nftables
  ``netdev`` ingress hooks on both of its ends drop every frame (no FIN, no
  RST, no ICMP, no ACK: a real kernel TCP stack at each end, no proxy), and
  :meth:`~NetnsLink.heal` lets frames through again. Static neighbour entries
  make ARP unnecessary, so a cut link stays silent instead of turning into
  "no route to host";
* the *control* link, never cut. Inside the namespace, TCP to
  ``127.0.0.1:<port>`` of a :class:`LinkServer` is sent there (DNAT in the
  namespace), so the server's ordinary 127.0.0.1 DSN works unchanged inside
  the namespace and survives every cut: for bookkeeping connections (the fault
  suite's records, a ticker that must not be hit).

:meth:`~NetnsLink.dsn` turns a server DSN into its data-link twin;
:meth:`~NetnsLink.popen` starts a process inside the namespace (``ip netns
exec``); :meth:`~NetnsLink.inside` moves the calling thread in, so sockets it
creates (a psycopg connection) live in the namespace; :meth:`~NetnsLink.cut`
aborts every TCP connection on the data link at both ends (``ss -K``);
:meth:`~NetnsLink.arm_answer_trip` cuts the host-to-namespace direction the
moment the host sends data to given namespace ports (a latch in nftables, to
catch a server answering). tests/faults.py's ``NetnsNetwork`` wraps these.

netem (``tc qdisc ... netem loss 100%``) would cut as well, but many kernels
(this VM's included) are built without sch_netem; nftables is in almost every
kernel, and ``make system-deps`` installs its ``nft`` program.

:class:`LinkServer` is a throwaway PostgreSQL (a :class:`pgtest.PgServer`)
listening on 127.0.0.1 and on the host end of both links, trusting the
namespace's addresses. The test run's own server listens on 127.0.0.1 only,
which a namespace cannot reach.

:func:`unavailable` says why this cannot work here (not root, no ``ip``/``nft``/
``ss``, no veth or nftables in the kernel), for a skip.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pgtest
from psycopg.conninfo import make_conninfo

__all__ = ["LinkServer", "NetnsLink", "NetnsUnavailable", "unavailable"]

CLONE_NEWNET = 0x40000000
_LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
_CMD_TIMEOUT = 20
_TOOLS = ("ip", "nft", "ss")


class NetnsUnavailable(RuntimeError):
    """Namespaces, veth or nftables cannot be used here (a reason to skip)."""


def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}", f"/usr/bin/{name}")
         if os.access(p, os.X_OK)), None)


def _run(argv: Sequence[str], *, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


_probe_lock = threading.Lock()
_probe_result: list[str | None] = []


def unavailable() -> str | None:
    """Why a NetnsLink cannot be built here, or None when it can. Probed once
    per process: it builds a link, cuts and heals it."""
    with _probe_lock:
        if not _probe_result:
            _probe_result.append(_probe())
        return _probe_result[0]


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces and nftables need root"
    for tool in _TOOLS:
        if _tool(tool) is None:
            return f"no `{tool}` program (`make system-deps` installs nftables)"
    try:
        with NetnsLink() as link:
            link.forward_loopback(5432)
            link.blackhole()
            link.heal()
            try:
                link.arm_answer_trip([5432])
            except Exception as exc:
                return ("nftables cannot latch a cut from the packet path (a dynamic set "
                        f"updated in a netdev ingress chain): {exc}")
            link.heal()
    except Exception as exc:
        return f"cannot build a network namespace with a cuttable veth link: {exc}"
    return None


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


class _Veth:
    """One veth pair: host end and namespace end, each with a /30 address."""

    def __init__(self, host_if: str, ns_if: str) -> None:
        self.host_if = host_if
        self.ns_if = ns_if
        self.host_address = ""
        self.ns_address = ""


class NetnsLink:
    """A network namespace with a data link and a control link to the host;
    see the module docstring. Use as a context manager, or :meth:`open` and
    :meth:`close` (also called at exit)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.name = f"pgque-{tag}"  # for ip netns
        self.data = _Veth(f"pq{tag}h0", f"pq{tag}n0")  # interface names: 15 characters at most
        self.control = _Veth(f"pq{tag}h1", f"pq{tag}n1")
        self.cut_table = f"pgque_cut_{tag}"
        self.trip_table = f"pgque_trip_{tag}"
        self.nat_table = "pgque_loopback"
        self.is_cut = False
        self._ip = _tool("ip") or "ip"
        self._nft = _tool("nft") or "nft"
        self._ss = _tool("ss") or "ss"
        self._opened = False
        self._forwarded: set[int] = set()
        self._procs: list[subprocess.Popen[Any]] = []
        self._owner_pid = os.getpid()

    @property
    def host_address(self) -> str:
        """The host end of the data link: where the namespace's clients connect."""
        return self.data.host_address

    @property
    def ns_address(self) -> str:
        """The namespace end of the data link: its clients' address, as the server sees it."""
        return self.data.ns_address

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> None:
        """Create the namespace, both veth pairs, addresses and neighbour entries."""
        if self._opened:
            return
        self._opened = True
        atexit.register(self._close_at_exit)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill what runs in the namespace, drop the rules, the namespace and
        (with it) the veth pairs. Safe to call more than once."""
        if not self._opened:
            return
        self._opened = False
        atexit.unregister(self._close_at_exit)
        self.stop()
        for pid in _run([self._ip, "netns", "pids", self.name], check=False).split():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid), signal.SIGKILL)  # grandchildren, threads' leftovers
        _run([self._nft, "delete", "table", "netdev", self.cut_table], check=False)
        for veth in (self.data, self.control):
            _run([self._ip, "link", "del", veth.host_if], check=False)
        _run([self._ip, "netns", "del", self.name], check=False)

    def stop(self) -> None:
        """Heal and kill the processes started with :meth:`popen`; the namespace
        stays for the next user (the fault suite's ``Network.stop``)."""
        self.heal()
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self._procs.clear()

    def __enter__(self) -> NetnsLink:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<NetnsLink {self.name} data {self.data.ns_address}->{self.data.host_address}"
                f" control {self.control.ns_address}->{self.control.host_address}"
                f"{' CUT' if self.is_cut else ''}>")

    def _close_at_exit(self) -> None:
        if os.getpid() == self._owner_pid:
            self.close()

    # -- faults ------------------------------------------------------------------

    def blackhole(self) -> None:
        """Drop every frame that arrives at either end of the data link, from now on."""
        rules = """\
table netdev {table} {{
    chain cut {{
        type filter hook ingress device "{dev}" priority -500; policy drop;
    }}
}}
"""
        _run([self._nft, "-f", "-"],
             input=rules.format(table=self.cut_table, dev=self.data.host_if))
        self._in_ns([self._nft, "-f", "-"],
                    input=rules.format(table=self.cut_table, dev=self.data.ns_if))
        self.is_cut = True

    def heal(self) -> None:
        """Let frames through the data link again (TCP retransmits what is outstanding);
        also disarms :meth:`arm_answer_trip`."""
        if not self._opened:
            return
        _run([self._nft, "delete", "table", "netdev", self.cut_table], check=False)
        self._in_ns([self._nft, "delete", "table", "netdev", self.cut_table], check=False)
        self._in_ns([self._nft, "delete", "table", "netdev", self.trip_table], check=False)
        self.is_cut = False

    def arm_answer_trip(self, ports: Sequence[int]) -> None:
        """Cut the host-to-namespace direction of the data link at the moment the
        host sends data (not a bare ACK) to one of the namespace's TCP ``ports``:
        that segment and every later frame to the namespace are dropped (a
        dynamic nftables set latches, at the namespace end's ingress). The other
        direction stays up until :meth:`blackhole`; :meth:`tripped` says whether
        it happened. For a cut that catches the server answering a request."""
        port_list = ", ".join(str(p) for p in sorted(set(ports)))
        rules = f"""\
table netdev {self.trip_table} {{
    set tripped {{ type ipv4_addr; flags dynamic; size 4; }}
    chain trip {{
        type filter hook ingress device "{self.data.ns_if}" priority -510; policy accept;
        ip daddr @tripped drop
        ip saddr {self.data.host_address} tcp dport {{ {port_list} }} ip length > 52 \
            update @tripped {{ ip daddr }} drop
    }}
}}
"""
        self._in_ns([self._nft, "-f", "-"], input=rules)

    def tripped(self) -> bool:
        """Whether the trip of :meth:`arm_answer_trip` has fired."""
        out = self._in_ns([self._nft, "list", "set", "netdev", self.trip_table, "tripped"],
                          check=False)
        return self.data.ns_address in out

    def cut(self) -> int:
        """Abort every TCP connection on the data link, at both ends (``ss -K``:
        each end sends a RST, which a blackhole drops). Returns how many
        connections the namespace had."""
        ns_side = self._in_ns([self._ss, "-K", "-t", "-n", "-H", "dst", self.data.host_address])
        _run([self._ss, "-K", "-t", "-n", "-H", "src", self.data.host_address,
              "dst", self.data.ns_address], check=False)
        return len([line for line in ns_side.splitlines() if line.strip()])

    # -- addressing ----------------------------------------------------------------

    def dsn(self, dsn: str) -> str:
        """``dsn`` with its host replaced by the data link's host end (same port)."""
        return make_conninfo(dsn, host=self.data.host_address)

    def forward_loopback(self, port: int) -> None:
        """Inside the namespace, send TCP to 127.0.0.1:``port`` over the control
        link to the same port of the host's control address."""
        self._forwarded.add(port)
        ports = ", ".join(str(p) for p in sorted(self._forwarded))
        dev, host, peer = self.control.ns_if, self.control.host_address, self.control.ns_address
        rules = f"""\
table ip {self.nat_table}
delete table ip {self.nat_table}
table ip {self.nat_table} {{
    chain out {{
        type nat hook output priority -100;
        ip daddr 127.0.0.1 tcp dport {{ {ports} }} dnat to {host}
    }}
    chain post {{
        type nat hook postrouting priority 100;
        oifname "{dev}" ip saddr 127.0.0.0/8 snat to {peer}
    }}
}}
"""
        self._in_ns([self._nft, "-f", "-"], input=rules)

    # -- running things inside -------------------------------------------------------

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(argv, **kwargs)`` inside the namespace (``ip netns
        exec`` execs the program: the Popen's pid is its pid); killed by stop()."""
        proc = subprocess.Popen([self._ip, "netns", "exec", self.name, *argv], **kwargs)
        self._procs.append(proc)
        return proc

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Move the calling thread into the namespace for the block: the sockets
        it creates meanwhile (a psycopg connection) stay in the namespace."""
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)

    # -- internals --------------------------------------------------------------------

    def _in_ns(self, argv: Sequence[str], **kwargs: Any) -> str:
        return _run([self._ip, "netns", "exec", self.name, *argv], **kwargs)

    def _create(self) -> None:
        ip, ns = self._ip, self.name
        _run([ip, "netns", "add", ns])
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        self._in_ns(["sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                     "echo 1 > /proc/sys/net/ipv4/conf/all/route_localnet"])
        taken = self._taken_networks()
        macs = {}
        for veth in (self.data, self.control):
            subnet = self._pick_subnet(taken)
            taken.append(subnet)
            host, peer = (str(a) for a in subnet.hosts())
            veth.host_address, veth.ns_address = host, peer
            _run([ip, "link", "add", veth.host_if, "type", "veth", "peer", "name", veth.ns_if,
                  "netns", ns])
            with contextlib.suppress(OSError):  # no IPv6 autoconf chatter on our links
                Path(f"/proc/sys/net/ipv6/conf/{veth.host_if}/disable_ipv6").write_text("1")
            _run([ip, "addr", "add", f"{host}/30", "dev", veth.host_if])
            _run([ip, "link", "set", veth.host_if, "up"])
            _run([ip, "-n", ns, "addr", "add", f"{peer}/30", "dev", veth.ns_if])
            _run([ip, "-n", ns, "link", "set", veth.ns_if, "up"])
            self._in_ns(["sh", "-c",
                         f"echo 1 > /proc/sys/net/ipv4/conf/{veth.ns_if}/route_localnet"])
            macs[veth.host_if] = Path(f"/sys/class/net/{veth.host_if}/address").read_text()
            macs[veth.ns_if] = self._in_ns(["cat", f"/sys/class/net/{veth.ns_if}/address"])
            # Permanent neighbours: a cut link must not become ARP failures, which
            # sockets would hear of as "no route to host" instead of silence.
            _run([ip, "neigh", "replace", peer, "lladdr", macs[veth.ns_if].strip(),
                  "dev", veth.host_if, "nud", "permanent"])
            _run([ip, "-n", ns, "neigh", "replace", host, "lladdr", macs[veth.host_if].strip(),
                  "dev", veth.ns_if, "nud", "permanent"])

    def _taken_networks(self) -> list[ipaddress.IPv4Network]:
        taken: list[ipaddress.IPv4Network] = []
        out = _run([self._ip, "-4", "-o", "addr", "show"]) + \
            _run([self._ip, "-4", "route", "show", "table", "all"], check=False)
        for word in out.split():
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(word, strict=False)
                if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
                    taken.append(net)
        return taken

    @staticmethod
    def _pick_subnet(taken: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
        """A link-local /30 that overlaps no address or route of the host (a
        route for all of 169.254/16 does not count: ours is more specific)."""
        for _ in range(200):
            # Not 169.254.0.x / .255.x (reserved), nor 169.254.169.x (cloud metadata).
            third = random.choice([n for n in range(1, 255) if n != 169])
            subnet = ipaddress.IPv4Network(f"169.254.{third}.{random.randrange(64) * 4}/30")
            if not any(subnet.overlaps(t) and t != _LINK_LOCAL for t in taken):
                return subnet
        raise NetnsUnavailable("no free link-local /30")


class LinkServer(pgtest.PgServer):
    """A throwaway PostgreSQL for a :class:`NetnsLink`: listens on 127.0.0.1 and
    on the host end of both links, trusts the namespace's addresses, and makes
    its 127.0.0.1 DSN work inside the namespace too (over the control link).

    ``dsn(db)``: for the test, and for the namespace's bookkeeping connections
    (never cut); ``link.dsn(server.dsn(db))`` or ``ns_dsn(db, **libpq_params)``:
    over the data link. ``bindir`` defaults to :func:`pgque.testing.localpg.find_bindir`.
    """

    restartable = True

    def __init__(self, link: NetnsLink, *, bindir: Path | None = None,
                 tmpdir: Path | None = None, settings: Mapping[str, str] | None = None) -> None:
        from pgque.testing.localpg import LocalPostgres

        self.link = link
        listen = f"127.0.0.1,{link.data.host_address},{link.control.host_address}"
        self.postgres = LocalPostgres(bindir, settings={"listen_addresses": listen,
                                                        **(settings or {})}, tmpdir=tmpdir)
        self.description = ""

    def start(self) -> None:
        """Start the server, let the namespace in (pg_hba.conf, reload), forward
        the namespace's 127.0.0.1:<port> to it."""
        import psycopg

        self.postgres.start()
        with (self.postgres.datadir / "pg_hba.conf").open("a", encoding="utf-8") as hba:
            hba.write("\n# the namespace of tests/netns.py: data and control links\n")
            for veth in (self.link.data, self.link.control):
                hba.write(f"host all all {veth.ns_address}/32 trust\n")
        with psycopg.connect(self.postgres.dsn(), autocommit=True) as conn:
            conn.execute("select pg_reload_conf()")
        self.link.forward_loopback(self.postgres.port)
        self.description = (f"PostgreSQL {self.postgres.major_version} at 127.0.0.1, "
                            f"{self.link.data.host_address} and "
                            f"{self.link.control.host_address}:{self.postgres.port}")
        # New backends read pg_hba.conf once the postmaster has reloaded it.
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.link.inside(), psycopg.connect(self.ns_dsn(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.postgres.close()

    def __enter__(self) -> LinkServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        return self.postgres.port

    @property
    def major_version(self) -> int:
        return self.postgres.major_version

    def restart(self) -> None:
        self.postgres.restart()

    def dsn(self, dbname: str = "postgres") -> str:
        """Over 127.0.0.1: on the host, and inside the namespace over the control link."""
        return self.postgres.dsn(dbname)

    def ns_dsn(self, dbname: str = "postgres", **params: Any) -> str:
        """Over the data link, for a client inside the namespace; ``params`` are
        extra libpq parameters (keepalives_idle=2, tcp_user_timeout=3000, ...)."""
        return make_conninfo(self.link.dsn(self.dsn(dbname)), **params)


@contextlib.contextmanager
def python_in(link: NetnsLink, script: str, *args: str, term_timeout: float = 30.0,
              **popen_kwargs: Any) -> Iterator[subprocess.Popen[Any]]:
    """Run ``python script args...`` (this interpreter) inside ``link``'s namespace;
    on exit SIGTERM it, and SIGKILL it after ``term_timeout`` seconds."""
    import sys

    proc = link.popen([sys.executable, script, *args], **popen_kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(term_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- measurements: python tests/netns.py ------------------------------------------------

_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 2, "keepalives_interval": 1,
               "keepalives_count": 3}
_SERVER_KEEPALIVES = ["set tcp_keepalives_idle = 2", "set tcp_keepalives_interval = 1",
                      "set tcp_keepalives_count = 3"]
#: name: (libpq parameters, server settings the session SETs, what the client does:
#: "idle", "busy" (select pg_sleep(90) in flight, acked before the cut), "busy25"
#: (pg_sleep(25)) or "after" (select 1 sent after the cut, never acked)).
SCENARIOS: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "S0 server, idle client, defaults": ({}, [], "idle"),
    "S1 server, idle client, keepalives 2/1/3": ({}, _SERVER_KEEPALIVES, "idle"),
    "S2 server, idle client, tcp_user_timeout 3s only": (
        {}, ["set tcp_user_timeout = 3000"], "idle"),
    "S3 server, idle client, keepalives 2/1/3 + tcp_user_timeout 3s": (
        {}, [*_SERVER_KEEPALIVES, "set tcp_user_timeout = 3000"], "idle"),
    "S7 server, idle client, keepalives 2/1/3 as startup options": (
        {"options": "-c tcp_keepalives_idle=2 -c tcp_keepalives_interval=1 "
                    "-c tcp_keepalives_count=3"}, [], "idle"),
    "S4 server, busy pg_sleep(25), keepalives 2/1/3": ({}, _SERVER_KEEPALIVES, "busy25"),
    "S5 server, busy, keepalives 2/1/3 + client_connection_check_interval 1s": (
        {}, [*_SERVER_KEEPALIVES, "set client_connection_check_interval = 1000"], "busy"),
    "S6 server, busy, client_connection_check_interval 1s, no keepalives": (
        {}, ["set client_connection_check_interval = 1000"], "busy"),
    "C1 client idle, defaults": ({}, [], "idle"),
    "C2 client idle, keepalives 2/1/3": (_KEEPALIVES, [], "idle"),
    "C3 client busy, keepalives 2/1/3": (_KEEPALIVES, [], "busy"),
    "C4 client busy, tcp_user_timeout 3s only": ({"tcp_user_timeout": 3000}, [], "busy"),
    "C5 client busy, keepalives 2/1/3 + tcp_user_timeout 3s": (
        {**_KEEPALIVES, "tcp_user_timeout": 3000}, [], "busy"),
    "C6 client sends after the cut, defaults": ({}, [], "after"),
    "C7 client sends after the cut, keepalives 2/1/3": (_KEEPALIVES, [], "after"),
    "C8 client sends after the cut, tcp_user_timeout 3s": (
        {"tcp_user_timeout": 3000}, [], "after"),
}


def measure(cut_seconds: float = 32.0, bindir: Path | None = None) -> dict[str, dict[str, str]]:
    """Open one connection per :data:`SCENARIOS` entry from inside a namespace,
    cut the data link for ``cut_seconds``, heal; returns, per scenario, when the
    server session ended, when the client noticed, and what a query does after
    the heal (times in seconds from the cut)."""
    import select

    import psycopg

    results: dict[str, dict[str, str]] = {name: {} for name in SCENARIOS}
    with NetnsLink() as link, LinkServer(link, bindir=bindir) as server:
        conns: dict[str, psycopg.Connection[Any]] = {}
        with link.inside():
            for name, (params, sets, _) in SCENARIOS.items():
                conn = psycopg.connect(server.ns_dsn(application_name=name[:2], **params),
                                       autocommit=True)
                for statement in sets:
                    conn.execute(statement)
                conns[name] = conn
        admin = psycopg.connect(server.dsn(), autocommit=True)
        pids = {name: conn.info.backend_pid for name, conn in conns.items()}
        cut_at: list[float] = []
        outcomes: dict[str, str] = {}

        def query(name: str, statement: str) -> None:
            try:
                conns[name].execute(statement)
                outcome = "query returned"
            except psycopg.Error as exc:
                outcome = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:80]}"
            outcomes[name] = f"{time.monotonic() - cut_at[0]:.1f}s {outcome}"

        threads = []
        for name, (_, _, mode) in SCENARIOS.items():
            if mode.startswith("busy"):
                sleep = 25 if mode == "busy25" else 90
                threads.append(threading.Thread(target=query, daemon=True,
                                                args=(name, f"select pg_sleep({sleep})")))
                threads[-1].start()
        time.sleep(1.0)  # the busy queries are on the server and acknowledged
        link.blackhole()
        cut_at.append(time.monotonic())
        for name, (_, _, mode) in SCENARIOS.items():
            if mode == "after":
                threads.append(threading.Thread(target=query, args=(name, "select 1"),
                                                daemon=True))
                threads[-1].start()
        gone: dict[str, float] = {}
        noticed: dict[str, float] = {}
        while (elapsed := time.monotonic() - cut_at[0]) < cut_seconds:
            alive = {row[0] for row in admin.execute("select pid from pg_stat_activity")}
            gone.update({n: elapsed for n, pid in pids.items() if n not in gone
                         and pid not in alive})
            for name, (_, _, mode) in SCENARIOS.items():
                if mode == "idle" and name not in noticed:
                    readable, _, _ = select.select([conns[name].pgconn.socket], [], [], 0)
                    if readable:  # the kernel reports an error on the idle socket
                        noticed[name] = elapsed
            time.sleep(0.1)
        link.heal()
        healed_at = time.monotonic()
        for thread in threads:
            thread.join(max(0.0, healed_at + 25 - time.monotonic()))
        snapshot = dict(outcomes)  # what comes later is the script closing connections
        for name, (_, _, mode) in SCENARIOS.items():
            result = results[name]
            if name in snapshot:
                result["client"] = snapshot[name]
            result["server session ended"] = (f"{gone[name]:.1f}s" if name in gone
                                              else f"still there at {cut_seconds:.0f}s")
            if mode == "idle":
                result["client"] = (f"socket error at {noticed[name]:.1f}s" if name in noticed
                                    else "no socket error")
                try:
                    conns[name].execute("select 1")
                    result["after heal"] = "select 1 ok"
                except psycopg.Error as exc:
                    result["after heal"] = f"{type(exc).__name__}"
            result.setdefault("client", "still waiting 25s after the heal")
        admin.close()
        for conn in conns.values():
            conn.close()
    return results


if __name__ == "__main__":
    import json
    import sys

    reason = unavailable()
    if reason:
        sys.exit(f"unavailable: {reason}")
    bindir = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    for scenario, result in measure(bindir=bindir).items():
        print(f"{scenario}: {json.dumps(result)}", flush=True)
