"""The dashboard's routes: pages rendered from the sampler's snapshot, the dead
letters read on demand, and the actions (replay, purge) as POSTs with a CSRF
token, refused in read-only mode."""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import threading
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone
from importlib import resources
from typing import Any, ClassVar

import psycopg
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pgque.client_async import AsyncClient
from pgque.dashboard.charts import sparkline
from pgque.dashboard.data import Sampler
from pgque.errors import AccessDenied, PgqueError

CSRF_COOKIE = "pgque_csrf"
#: The names the dashboard answers to unless told more (``hosts``).
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
#: Dead letters a list page shows at most, and reads at most to find them.
LIST_LIMIT = 500
SCAN_LIMIT = 20_000
#: Live tails open at once: each is a consumer of its own, which holds its
#: queue's rotation back while it is open.
MAX_TAILS = 4
#: Events a tail's page is sent at most a second (more are counted, not sent).
TAIL_RATE = 200

_HERE = resources.files("pgque.dashboard")


class Dashboard:
    """The app and what it holds: the DSN's pool, the sampler, the mode."""

    def __init__(self, dsn: str, *, read_only: bool = False, interval: float = 5.0,
                 hosts: Sequence[str] = ()) -> None:
        self.dsn = dsn
        self.read_only = read_only
        self.pool = AsyncConnectionPool(dsn, min_size=0, max_size=3, open=False,
                                        kwargs={"autocommit": True,
                                                "application_name": "pgque-dashboard"})
        self.sampler = Sampler(self._sampler_connection, interval=interval)
        self.may_act = False  # the role may replay and purge (pgque_writer's functions)
        self._secret = secrets.token_bytes(32)  # signs the CSRF tokens of this process
        self._tails: set[Any] = set()  # the live tails open (pgque.tail.Tail)
        self._tails_lock = threading.Lock()
        self.templates = Jinja2Templates(directory=str(_HERE / "templates"))
        self.templates.env.globals["sparkline"] = sparkline
        self.templates.env.filters["age"] = _age
        self.templates.env.filters["number"] = _number
        self.templates.env.filters["clock"] = _clock
        self.app = Starlette(routes=[
            Route("/", self.queues),
            Route("/queues/{queue}", self.queue),
            Route("/queues/{queue}/groups/{group}", self.group),
            Route("/dead-letters", self.dead_letters),
            Route("/dead-letters/{queue}/{id:int}", self.dead_letter),
            Route("/dead-letters/replay", self.act, methods=["POST"], name="act_replay"),
            Route("/dead-letters/purge", self.act, methods=["POST"], name="act_purge"),
            Route("/tickers", self.tickers),
            Route("/queues/{queue}/tail", self.tail),
            Route("/queues/{queue}/tail/events", self.tail_events),
            Mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static"),
        ], lifespan=self._lifespan, middleware=[
            # A page asked for by another name (DNS rebinding: a site whose name
            # now points here) is refused: its scripts could read the pages.
            Middleware(TrustedHostMiddleware, allowed_hosts=[*LOCAL_HOSTS, *hosts]),
            Middleware(_SecurityHeaders),
        ])

    async def _sampler_connection(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, application_name="pgque-dashboard-sampler",
            connect_timeout=10, keepalives=1, keepalives_idle=10, keepalives_interval=5,
            keepalives_count=3)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        import asyncio

        await self.pool.open()
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "select has_function_privilege("
                "'pgque.replay_dead_letter(text,bigint,boolean)', 'execute')")
            row = await cur.fetchone()
            self.may_act = bool(row and row[0]) and not self.read_only
        await self.sampler.read()
        task = asyncio.create_task(self.sampler.run())
        try:
            yield
        finally:
            with self._tails_lock:
                open_tails = list(self._tails)
            for tail in open_tails:  # their consumers removed before the process goes
                await asyncio.to_thread(self._stop_tail, tail)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.pool.close()

    # -- pages -----------------------------------------------------------------

    def _token(self, request: Request) -> str:
        """The browser's CSRF token: its cookie's, when this process signed it, else
        a new one. A token is a nonce and its HMAC under a secret of this
        process, so a cookie planted by another site (another port of this
        host shares its cookies) is not one."""
        cookie = request.cookies.get(CSRF_COOKIE, "")
        return cookie if self._signed(cookie) else self._new_token()

    def _new_token(self) -> str:
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{hmac.new(self._secret, nonce.encode(), 'sha256').hexdigest()}"

    def _signed(self, token: str) -> bool:
        nonce, _, mac = token.partition(".")
        return bool(nonce) and hmac.compare_digest(
            mac, hmac.new(self._secret, nonce.encode(), "sha256").hexdigest())

    def _check_request(self, request: Request, token: str) -> None:
        """A state-changing request (an action, a tail) must come from a page of
        this dashboard: the token its page carries, equal to the browser's
        signed cookie, and no Origin of another site."""
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            raise HTTPException(403, "a request from another site")
        cookie = request.cookies.get(CSRF_COOKIE, "")
        if not (cookie and self._signed(cookie) and hmac.compare_digest(token, cookie)):
            raise HTTPException(403, "the form's CSRF token does not match: reload the page")

    def _render(self, request: Request, template: str, status: int = 200,
                **context: Any) -> Response:
        token = self._token(request)
        response = self.templates.TemplateResponse(
            request, template, {"snapshot": self.sampler.snapshot, "may_act": self.may_act,
                                "snapshot_interval": self.sampler.interval,
                                "read_only": self.read_only, "csrf": token, **context},
            status_code=status)
        if request.cookies.get(CSRF_COOKIE) != token:
            response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict")
        return response

    async def queues(self, request: Request) -> Response:
        return self._render(request, "queues.html")

    async def queue(self, request: Request) -> Response:
        queue = self.sampler.snapshot.queues.get(request.path_params["queue"])
        if queue is None:
            raise HTTPException(404, "no such queue, or not one this role may see")
        return self._render(request, "queue.html", queue=queue)

    async def group(self, request: Request) -> Response:
        queue = self.sampler.snapshot.queues.get(request.path_params["queue"])
        group = None if queue is None else queue.groups.get(request.path_params["group"])
        if queue is None or group is None:
            raise HTTPException(404, "no such group, or not one this role may see")
        return self._render(request, "group.html", queue=queue, group=group)

    async def tickers(self, request: Request) -> Response:
        return self._render(request, "tickers.html")

    async def dead_letters(self, request: Request) -> Response:
        filters = _filters(request.query_params)
        _check_older_than(filters)
        letters: list[Any] = []
        error = None
        scanned = 0
        if filters["queue"]:
            # Read in pages, oldest first, until LIST_LIMIT match or SCAN_LIMIT
            # were read: the filters the SQL list does not take apply here.
            try:
                async with self.pool.connection() as conn:
                    after = 0
                    while len(letters) < LIST_LIMIT and scanned < SCAN_LIMIT:
                        page = await AsyncClient(conn).dead_letters(
                            filters["queue"], filters["group"] or None, limit=LIST_LIMIT,
                            after_id=after)
                        scanned += len(page)
                        letters += [d for d in page if _matches(d, filters)]
                        if len(page) < LIST_LIMIT:
                            break
                        after = page[-1].id
            except (PgqueError, psycopg.Error) as exc:
                error = _said(exc)
        return self._render(request, "dead_letters.html", filters=filters,
                            letters=letters[:LIST_LIMIT], error=error, limit=LIST_LIMIT,
                            scanned=scanned, scan_limit=SCAN_LIMIT)

    async def dead_letter(self, request: Request) -> Response:
        queue, wanted = request.path_params["queue"], request.path_params["id"]
        if wanted >= 2**63:
            raise HTTPException(404, "no such dead letter")
        try:
            async with self.pool.connection() as conn:
                letters = await AsyncClient(conn).dead_letters(queue, limit=1,
                                                               after_id=wanted - 1)
        except (PgqueError, psycopg.Error) as exc:
            raise HTTPException(404, _said(exc)) from None
        if not letters or letters[0].id != wanted:
            raise HTTPException(404, "no such dead letter, or not one this role may see")
        letter = letters[0]
        try:
            payload = json.dumps(json.loads(letter.data), indent=2, ensure_ascii=False) \
                if letter.data is not None else ""
        except ValueError:
            payload = letter.data or ""
        return self._render(request, "dead_letter.html", queue=queue, letter=letter,
                            payload=payload)

    async def tail(self, request: Request) -> Response:
        if self.read_only:
            raise HTTPException(403, "read-only: a tail subscribes a consumer of its own")
        queue = request.path_params["queue"]
        if queue not in self.sampler.snapshot.queues:
            raise HTTPException(404, "no such queue, or not one this role may see")
        return self._render(request, "tail.html", queue=queue)

    async def tail_events(self, request: Request) -> Response:
        """Server-sent events: each event of the queue from now on, as JSON, through
        a tail consumer of the DSN's role (pgque.tail.Tail, on a thread) that is
        removed when the page goes away."""
        import asyncio

        from starlette.responses import StreamingResponse

        from pgque.tail import Tail

        if self.read_only:
            raise HTTPException(403, "read-only: a tail subscribes a consumer of its own")
        # It subscribes a consumer: a page of this dashboard's asks, not another site.
        self._check_request(request, request.query_params.get("csrf", ""))
        queue = request.path_params["queue"]
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[str] = asyncio.Queue()

        def show(message: Any) -> None:
            item = json.dumps({"id": message.id, "type": message.type,
                               "key": message.partition_key, "data": message.data,
                               "at": message.created_at.isoformat()})
            loop.call_soon_threadsafe(inbox.put_nowait, item)

        def say(note: str) -> None:
            if not note.startswith("tailing "):  # the command's own line ("Ctrl-C to stop")
                loop.call_soon_threadsafe(inbox.put_nowait, json.dumps({"note": note}))

        tail = Tail(self.dsn, queue, show=show, say=say, from_now=True)
        with self._tails_lock:
            if len(self._tails) >= MAX_TAILS:
                raise HTTPException(429, f"{MAX_TAILS} tails are open already")
            self._tails.add(tail)
        tail.start()

        async def stream() -> AsyncIterator[str]:
            sent, window = 0, loop.time()
            announced = False
            try:
                yield ": tailing\n\n"
                while tail.alive or not inbox.empty():
                    if not announced and tail.following:
                        announced = True
                        yield f"data: {json.dumps({'state': 'following'})}\n\n"
                    try:
                        item = await asyncio.wait_for(inbox.get(), 0.2 if not announced
                                                      else 1.0)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        yield ": still here\n\n"  # a comment: keeps proxies from timing out
                        continue
                    if loop.time() - window >= 1.0:
                        sent, window = 0, loop.time()
                    sent += 1
                    if sent <= TAIL_RATE:
                        yield f"data: {item}\n\n"
                if tail.error is not None:
                    yield f"data: {json.dumps({'note': _said(tail.error)})}\n\n"
            finally:
                # Not awaited: a client gone cancels this generator, and a stop
                # awaited here could be cancelled before it ran (the consumer
                # would stay). A thread of its own stops the tail, which removes
                # its consumer, and only then frees its place.
                threading.Thread(target=self._stop_tail, args=(tail,), daemon=True,
                                 name="pgque-dashboard-tail-stop").start()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    def _stop_tail(self, tail: Any) -> None:
        try:
            tail.stop(30.0)
        finally:
            with self._tails_lock:
                self._tails.discard(tail)

    # -- actions ---------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        """Replay or purge dead letters: the ones named (``id``), or those the
        filters match. A first POST shows how many and asks again; the second
        (``confirmed`` equal to that count) acts, all or none."""
        action = "replay" if request.url.path.endswith("/replay") else "purge"
        if not self.may_act:
            raise HTTPException(403, "read-only: this dashboard takes no action"
                                if self.read_only else
                                "this role may not replay or purge dead letters")
        form = await request.form()
        self._check_request(request, str(form.get("csrf", "")))
        filters = _filters(form)
        _check_older_than(filters)
        everything = form.get("all") == "1"  # every dead letter the filters match
        ids = [] if everything else sorted({_bigint(str(i)) for i in form.getlist("id")})
        if not filters["queue"]:
            raise HTTPException(400, "which queue?")
        if not everything and not ids:
            raise HTTPException(400, "no dead letter selected")
        try:
            async with self.pool.connection() as conn, conn.transaction():
                # One transaction: what is counted is what is acted on, or nothing
                # (a count that changed in between rolls it back and asks again).
                client = AsyncClient(conn)
                if ids:  # those of the role's dead letters that exist
                    ids = await _existing(conn, filters["queue"], ids)
                count = len(ids) if not everything else await self._bulk(
                    client, action, filters, dry_run=True)
                if str(form.get("confirmed", "")) != str(count) or not count:
                    return self._render(request, "confirm.html", action=action, count=count,
                                        filters=filters, ids=ids)
                if ids and action == "replay":
                    for letter_id in ids:
                        await client.replay_dead_letter(filters["queue"], letter_id)
                    done = len(ids)
                elif ids:
                    done = await client.purge_dead_letters(filters["queue"], ids=ids)
                else:
                    done = await self._bulk(client, action, filters, dry_run=False)
                if done != count:
                    raise _CountChanged(done)
        except _CountChanged:
            return self._render(request, "confirm.html", action=action, count=None,
                                filters=filters, ids=ids)
        except (PgqueError, psycopg.Error) as exc:
            return self._render(request, "error.html", status=403 if _refused(exc) else 400,
                                message=_said(exc))
        target = request.url_for("dead_letters").include_query_params(
            queue=filters["queue"], done=f"{action}: {done}")
        return RedirectResponse(str(target), status_code=303)

    @staticmethod
    async def _bulk(client: AsyncClient, action: str, filters: dict[str, str], *,
                    dry_run: bool) -> int:
        older = float(filters["older_than"]) if filters["older_than"] else None
        args: dict[str, Any] = {
            "type": filters["type"] or None, "key": filters["key"] or None,
            "reason": filters["reason"] or None, "older_than": older, "dry_run": dry_run}
        if action == "replay":
            return await client.replay_dead_letters(filters["queue"], filters["group"] or None,
                                                    **args)
        return await client.purge_dead_letters_where(filters["queue"],
                                                     filters["group"] or None, **args)


class _CountChanged(Exception):
    """Acted on another number than confirmed: rolled back."""


async def _existing(conn: psycopg.AsyncConnection[Any], queue: str, ids: list[int]) -> list[int]:
    """Those of ``ids`` (ascending) that are dead letters of ``queue`` the role
    may see: its dead letters from the first id to the last, read in pages."""
    client, wanted, found = AsyncClient(conn), set(ids), set()
    after = ids[0] - 1
    while after < ids[-1]:
        page = await client.dead_letters(queue, limit=LIST_LIMIT, after_id=after)
        found |= {d.id for d in page} & wanted
        if len(page) < LIST_LIMIT:
            break
        after = page[-1].id
    return sorted(found)


def _bigint(text: str) -> int:
    """An id from a form or a path: ASCII digits within bigint, else 400."""
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        raise HTTPException(400, f"not a dead letter id: {text[:40]!r}")
    return int(text)


def _check_older_than(filters: dict[str, str]) -> None:
    """older_than is seconds: a number, not negative, else 400."""
    if filters["older_than"]:
        try:
            seconds = float(filters["older_than"])
        except ValueError:
            raise HTTPException(400, "older than: a number of seconds") from None
        if not 0 <= seconds < 1e9:
            raise HTTPException(400, "older than: a number of seconds") from None


def _filters(source: Any) -> dict[str, str]:
    return {name: str(source.get(name) or "").strip()
            for name in ("queue", "group", "type", "key", "reason", "older_than")}


def _matches(letter: Any, filters: dict[str, str]) -> bool:
    """A listed dead letter against the filters the SQL calls take too."""
    if filters["type"] and letter.type != filters["type"]:
        return False
    if filters["key"] and letter.partition_key != filters["key"]:
        return False
    if filters["reason"] and filters["reason"] not in (letter.reason or ""):
        return False
    if filters["older_than"]:
        with contextlib.suppress(ValueError):
            age = (datetime.now(timezone.utc) - letter.failed_at).total_seconds()
            if age <= float(filters["older_than"]):
                return False
    return True


def _said(exc: BaseException) -> str:
    """An error's first line (its CONTEXT would quote SQL)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, (psycopg.errors.InsufficientPrivilege, AccessDenied))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%H:%M:%S UTC")


def _number(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2f}"


class _SecurityHeaders:
    """Headers on every response: no framing, scripts and styles of this origin
    only (the pages have no inline script), no sniffing."""

    HEADERS: ClassVar[list[tuple[bytes, bytes]]] = [
        (b"content-security-policy",
         b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
         b"form-action 'self'; base-uri 'none'"),
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"same-origin"),
    ]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def create_app(dsn: str, *, read_only: bool = False, interval: float = 5.0,
               hosts: Sequence[str] = ()) -> Starlette:
    """The dashboard as an ASGI app, acting as the DSN's role; it answers to the
    loopback names and to ``hosts`` ("*": any) only."""
    return Dashboard(dsn, read_only=read_only, interval=interval, hosts=hosts).app
