"""`pgque dashboard` over HTTP, in the recommended deployment: a team's login
runs the worker and the dashboard, a producer sends, a reader login watches.
Pages render from a running Worker's group; a dead letter replayed from the
page reaches the handler again; a reader sees no action and is refused on
POST; --read-only refuses every action; a POST without the page's CSRF token
is refused; a hostile payload is shown as text."""

from __future__ import annotations

import html
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.cookiejar import CookieJar
from typing import Any

import pytest
from helpers import wait_for

import pgque
from pgque.dashboard import DashboardServer
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"
SLOTS = 4


class Browser:
    """A cookie-keeping HTTP client: what the page's forms need (the CSRF cookie)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))

    def get(self, path: str) -> str:
        with self.opener.open(self.base + path, timeout=30) as response:
            return response.read().decode()

    def post(self, path: str, fields: list[tuple[str, str]]) -> tuple[int, str, str]:
        """(status, final URL, body); a redirect after the POST is followed."""
        data = urllib.parse.urlencode(fields).encode()
        try:
            with self.opener.open(self.base + path, data=data, timeout=30) as response:
                return response.status, response.url, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.url, exc.read().decode()


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no CSRF token on the page"
    return html.unescape(found.group(1))


@dataclass
class Team:
    deployment: Deployment
    dsn: str
    calls: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


POISON = "Poison"


@pytest.fixture
def team(pgque_deployment: Deployment) -> Iterator[Team]:
    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue(QUEUE, ticker_max_lag=0)
    dsn = deployment.dsn(deployment.login(deployment.teams[0]))
    with pgque.connect(dsn) as client:
        client.conn.execute(f"set role {deployment.teams[0]}")  # the team owns the group
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
    yield Team(deployment, dsn)


def _handler(team: Team) -> Any:
    def handle(message: pgque.Message[Any]) -> None:
        with team.lock:
            team.calls[message.id] = team.calls.get(message.id, 0) + 1
            first = team.calls[message.id] == 1
        if message.type == POISON and first:
            raise pgque.NonRetryable("poisoned <b>once</b>")
    return handle


def _send(team: Team, events: list[tuple[str, Any, str]]) -> list[int]:
    with pgque.connect(team.deployment.dsn(team.deployment.producer)) as producer:
        return [int(i) for i in producer.send_batch(QUEUE, events)]


def _dead_letter_ids(team: Team) -> list[int]:
    with pgque.connect(team.dsn) as client:
        return [d.id for d in client.dead_letters(QUEUE)]


def test_pages_show_a_running_group_and_a_replay_reaches_the_handler(team: Team) -> None:
    sent = _send(team, [("Order", {"n": n}, f"customer-{n % 8}") for n in range(20)]
                 + [(POISON, {"n": 0}, "customer-3")])
    poison = sent[-1]
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                         handler=_handler(team), ticker=False, poll_interval=0.05,
                         name="billing-1") as worker, \
            DashboardServer(team.dsn, interval=0.5) as dashboard:
        assert worker.wait(lambda: len(team.calls) == len(sent), timeout=60)
        wait_for(lambda: _dead_letter_ids(team), timeout=30, what="the poison's dead letter")
        browser = Browser(dashboard.url)
        queues = wait_for(lambda: (page := browser.get("/")) and "billing-1" not in page
                          and QUEUE in page and page, timeout=30, what="the queues page")
        assert f'/queues/{QUEUE}"' in queues
        group = wait_for(lambda: (page := browser.get(f"/queues/{QUEUE}/groups/{GROUP}"))
                         and page.count("billing-1-lane") == SLOTS and page,
                         timeout=30, what="every slot owned by the worker's lanes")
        assert group.count('data-slot=') == SLOTS and "STALLED" not in group
        assert GROUP in browser.get(f"/queues/{QUEUE}")
        assert "Active:" in browser.get("/tickers")

        listing = browser.get(f"/dead-letters?queue={QUEUE}&group={GROUP}")
        [letter] = _dead_letter_ids(team)
        assert f'value="{letter}"' in listing and "Replay selected" in listing
        # The reason is the handler's text, shown as text.
        assert "poisoned &lt;b&gt;once&lt;/b&gt;" in listing and "<b>once</b>" not in listing
        status, _, confirm = browser.post("/dead-letters/replay", [
            ("csrf", csrf_of(listing)), ("queue", QUEUE), ("id", str(letter))])
        assert status == 200 and "Replay 1 dead letter of" in confirm
        assert _dead_letter_ids(team) == [letter]  # nothing done before the confirmation
        status, url, _ = browser.post("/dead-letters/replay", [
            ("csrf", csrf_of(confirm)), ("queue", QUEUE), ("id", str(letter)),
            ("confirmed", "1")])
        assert status == 200 and "done=replay" in url
        assert worker.wait(lambda: sum(c for i, c in team.calls.items() if i != poison)
                           + team.calls[poison] > len(sent), timeout=30)
        assert _dead_letter_ids(team) == []
        # Consumed per second and the backlog over time: once drained, the
        # group's slowest slot is at the queue's head, and what it consumed
        # since the first reading is what was sent since (the replay: one more).
        group = wait_for(lambda: (g := dashboard.dashboard.sampler.snapshot.queues[QUEUE]
                                  .groups[GROUP]).backlog and g.backlog[-1][1] == 0 and g,
                         timeout=30, what="the group's backlog back to 0")
        assert group.rates and all(rate >= 0 for _, rate in group.rates)
        assert "consumed/s" in browser.get(f"/queues/{QUEUE}")


def test_a_bulk_purge_states_its_count_and_a_token_missing_is_refused(team: Team) -> None:
    _send(team, [(POISON, {"n": n}, f"customer-{n}") for n in range(3)])
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                         handler=_handler(team), ticker=False, poll_interval=0.05), \
            DashboardServer(team.dsn, interval=0.5) as dashboard:
        wait_for(lambda: len(_dead_letter_ids(team)) == 3, timeout=60, what="3 dead letters")
        browser = Browser(dashboard.url)
        listing = browser.get(f"/dead-letters?queue={QUEUE}")
        fields = [("queue", QUEUE), ("type", POISON), ("all", "1")]
        for forged in ([], [("csrf", "forged")]):
            status, _, body = browser.post("/dead-letters/purge", forged + fields)
            assert status == 403 and "CSRF" in body
        other = Browser(dashboard.url)  # another browser: no cookie, the page's token
        status, _, _ = other.post("/dead-letters/purge", [("csrf", csrf_of(listing)), *fields])
        assert status == 403
        status, _, confirm = browser.post("/dead-letters/purge",
                                          [("csrf", csrf_of(listing)), *fields])
        assert status == 200 and "Purge 3 dead letters of" in confirm
        status, _, again = browser.post("/dead-letters/purge", [
            ("csrf", csrf_of(listing)), *fields, ("confirmed", "2")])  # a stale count
        assert status == 200 and "Purge 3 dead letters of" in again
        assert len(_dead_letter_ids(team)) == 3
        status, url, _ = browser.post("/dead-letters/purge", [
            ("csrf", csrf_of(listing)), *fields, ("confirmed", "3")])
        assert status == 200 and "done=purge" in url and _dead_letter_ids(team) == []


@pytest.mark.parametrize("who", ["another team", "read-only"])
def test_who_may_not_act_sees_no_action_and_is_refused(team: Team, who: str) -> None:
    """Another team's role (pgque's rules: it may not use billing's group) sees
    neither the dead letter nor an action, and its POST is refused by pgque;
    billing's own role under --read-only sees the letter and no action, and
    every POST is refused by the dashboard."""
    _send(team, [(POISON, {"n": 0}, "customer-0")])
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                         handler=_handler(team), ticker=False, poll_interval=0.05):
        wait_for(lambda: _dead_letter_ids(team), timeout=60, what="a dead letter")
    [letter] = _dead_letter_ids(team)
    deployment = team.deployment
    dsn = (deployment.dsn(deployment.login(deployment.teams[1])) if who == "another team"
           else team.dsn)
    with DashboardServer(dsn, interval=0.5, read_only=who == "read-only") as dashboard:
        browser = Browser(dashboard.url)
        listing = browser.get(f"/dead-letters?queue={QUEUE}")
        assert (f">{letter}</a>" in listing) == (who == "read-only")
        assert "Replay" not in listing and "Purge" not in listing
        if who == "read-only":
            page = browser.get(f"/dead-letters/{QUEUE}/{letter}")
            assert "poisoned" in page and "Replay" not in page and "Purge" not in page
        for action in ("replay", "purge"):
            status, _, body = browser.post(f"/dead-letters/{action}", [
                ("csrf", csrf_of(listing) if "csrf" in listing else "x"), ("queue", QUEUE),
                ("id", str(letter)), ("confirmed", "1")])
            if who == "read-only":
                assert status == 403 and "read-only" in body, body
            else:  # not one of its dead letters: nothing to act on
                assert status == 200 and "Nothing matches" in body, body
    assert _dead_letter_ids(team) == [letter]


def test_a_hostile_payload_is_shown_as_text(team: Team) -> None:
    script = '<script>alert("pgque")</script>'
    payload = {"note": script + "\u0001\u001b[31m", "bulk": "x" * 1_000_000,
               "quote": "\"'&"}
    _send(team, [(POISON, payload, "<img src=x onerror=alert(1)>")])
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                         handler=_handler(team), ticker=False, poll_interval=0.05):
        wait_for(lambda: _dead_letter_ids(team), timeout=60, what="a dead letter")
    [letter] = _dead_letter_ids(team)
    with DashboardServer(team.dsn, interval=0.5) as dashboard:
        browser = Browser(dashboard.url)
        listing = browser.get(f"/dead-letters?queue={QUEUE}")
        page = browser.get(f"/dead-letters/{QUEUE}/{letter}")
    for text in (listing, page):
        assert "<img src=x" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    assert script not in page and "&lt;script&gt;alert(" in page
    assert "x" * 1_000_000 in page  # the whole payload, escaped, not cut


def test_the_command_serves_until_sigterm(team: Team) -> None:
    import signal
    import socket

    from helpers import TESTS_DIR, cli_process

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with cli_process("dashboard", "--port", str(port), "--interval", "0.5", "--read-only",
                     PGQUE_DSN=team.dsn, PYTHONPATH=TESTS_DIR) as proc:
        page = wait_for(lambda: _get_or_none(f"http://127.0.0.1:{port}/"), timeout=30,
                        what="the dashboard's first page")
        assert QUEUE in page and "read-only" in page
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    # A role that may not read the figures (the producer: pgque_writer only).
    from helpers import assert_one_line_error, run_cli

    refused = run_cli("dashboard", "--port", str(port),
                      PGQUE_DSN=team.deployment.dsn(team.deployment.producer))
    assert "pgque_reader" in assert_one_line_error(refused, 1)


def _get_or_none(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


def test_the_live_tail_streams_events_and_removes_its_consumer(team: Team) -> None:
    """The tail page's stream (server-sent events) carries each event sent after
    it opened, as JSON; once the page goes away its consumer is gone."""
    import json

    def consumers() -> list[str]:
        with pgque.connect(team.deployment.dsn(team.deployment.owner)) as owner:
            return [c.consumer_name for c in owner.consumer_info(QUEUE)
                    if c.consumer_name.startswith("tail-")]

    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            DashboardServer(team.dsn, interval=0.5) as dashboard:
        browser = Browser(dashboard.url)
        assert "Live tail" in browser.get(f"/queues/{QUEUE}")
        page = browser.get(f"/queues/{QUEUE}/tail")
        source = html.unescape(re.search(r'data-source="([^"]+)"', page).group(1))
        # Without the page's token (another site's EventSource, an <img>): refused.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(source.split("?")[0], timeout=30)
        assert refused.value.code == 403
        stream = browser.opener.open(source, timeout=30)
        try:
            assert stream.readline().startswith(b": tailing")
            wait_for(lambda: consumers() or None, timeout=30, what="the tail's consumer")
            sent = _send(team, [("Order", {"n": n, "html": "<i>x</i>"}, f"c-{n}")
                                for n in range(5)])
            seen: list[dict[str, Any]] = []
            while len(seen) < len(sent):
                line = stream.readline().decode()
                if line.startswith("data: "):
                    item = json.loads(line[6:])
                    if "id" in item:
                        seen.append(item)
            assert [item["id"] for item in seen] == sent
            assert seen[0]["key"] == "c-0" and "<i>x</i>" in seen[0]["data"]
        finally:
            stream.close()
        wait_for(lambda: not consumers() or None, timeout=30,
                 what="the tail's consumer removed once the page went away")


def test_requests_from_elsewhere_and_bad_input_are_refused(team: Team) -> None:
    """Another Host name (DNS rebinding), a cookie planted by another site (an
    unsigned token), ids that are not dead letters, and malformed input: each
    refused or counted out, nothing done; every page carries its security
    headers."""
    _send(team, [(POISON, {"n": 0}, "customer-0")])
    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            pgque.Worker(team.dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS,
                         handler=_handler(team), ticker=False, poll_interval=0.05):
        wait_for(lambda: _dead_letter_ids(team), timeout=60, what="a dead letter")
    [letter] = _dead_letter_ids(team)
    with DashboardServer(team.dsn, interval=0.5) as dashboard:
        rebound = urllib.request.Request(dashboard.url + "/", headers={
            "Host": "rebind.attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(rebound, timeout=30)
        assert refused.value.code == 400
        with urllib.request.urlopen(dashboard.url + "/", timeout=30) as response:
            assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
            assert response.headers["X-Frame-Options"] == "DENY"
        planted = Browser(dashboard.url)
        planted.opener.addheaders = [("Cookie", "pgque_csrf=attacker-chosen")]
        status, _, body = planted.post("/dead-letters/purge", [
            ("csrf", "attacker-chosen"), ("queue", QUEUE), ("id", str(letter)),
            ("confirmed", "1")])
        assert status == 403 and "CSRF" in body
        browser = Browser(dashboard.url)
        token = csrf_of(browser.get(f"/dead-letters?queue={QUEUE}"))
        status, _, body = browser.post("/dead-letters/purge", [
            ("csrf", token), ("queue", QUEUE)] + [
            ("id", i) for i in (str(letter), "424242", str(letter))] + [("confirmed", "3")])
        assert status == 200 and "Purge 1 dead letter of" in body  # only the one that exists
        for fields in ([("id", "²")], [("id", "99999999999999999999")],
                       [("all", "1"), ("older_than", "abc")]):
            status, _, _ = browser.post("/dead-letters/purge", [
                ("csrf", token), ("queue", QUEUE), *fields, ("confirmed", "1")])
            assert status == 400, fields
        with pytest.raises(urllib.error.HTTPError) as bad:
            browser.opener.open(f"{dashboard.url}/dead-letters?queue={QUEUE}&older_than=x")
        assert bad.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as missing:
            browser.opener.open(f"{dashboard.url}/dead-letters/{QUEUE}/99999999999999999999")
        assert missing.value.code == 404 and b"function" not in missing.value.read()
        foreign = urllib.request.Request(dashboard.url + "/dead-letters/purge", data=(
            urllib.parse.urlencode([("csrf", token), ("queue", QUEUE), ("id", str(letter)),
                                    ("confirmed", "1")]).encode()),
            headers={"Origin": "http://127.0.0.1:1"})
        with pytest.raises(urllib.error.HTTPError) as cross:
            browser.opener.open(foreign, timeout=30)
        assert cross.value.code == 403
    assert _dead_letter_ids(team) == [letter]


def test_tails_whose_pages_went_away_remove_their_consumers(team: Team) -> None:
    """Streams opened and dropped at once, more than MAX_TAILS of them: each
    tail's consumer is removed, and the limit holds meanwhile."""
    from pgque.dashboard.app import MAX_TAILS

    def consumers() -> list[str]:
        with pgque.connect(team.deployment.dsn(team.deployment.owner)) as owner:
            return [c.consumer_name for c in owner.consumer_info(QUEUE)
                    if c.consumer_name.startswith("tail-")]

    with pgque.Ticker(team.deployment.dsn(team.deployment.ticker)), \
            DashboardServer(team.dsn, interval=0.5) as dashboard:
        browser = Browser(dashboard.url)
        page = browser.get(f"/queues/{QUEUE}/tail")
        source = html.unescape(re.search(r'data-source="([^"]+)"', page).group(1))
        opened = 0
        for _ in range(MAX_TAILS + 4):
            try:
                stream = browser.opener.open(source, timeout=30)
            except urllib.error.HTTPError as exc:
                assert exc.code == 429  # all places taken until a tail is gone
                continue
            opened += 1
            stream.readline()
            stream.close()
        assert opened >= MAX_TAILS
        wait_for(lambda: not consumers() or None, timeout=60,
                 what="every tail's consumer removed")
