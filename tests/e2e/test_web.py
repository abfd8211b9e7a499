"""The web dashboard: HTTP rules (auth, CSRF, read-only, paging), hostile requests, escaping, a real browser."""

from __future__ import annotations

import base64
import http.client
import http.cookiejar
import re
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import redis
from celery import Celery
from click.testing import CliRunner
from support import Proc, app_env, free_port, make_app, need, run_celery, wait_for
from support.browser import browser_available, chromium

from celery_delayed import JobNotFound, apply_later, apply_later_many, get_store, job_id_for_key
from celery_delayed.web import Auth, make_server, serve_in_thread
from celery_delayed.web.server import DashboardServer


class Client:
    """An HTTP client with its own cookie jar (as a browser keeps the dashboard's cookies), following redirects.

    A dropped connection comes back as status 0, so that a test says which request dropped it.
    """

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base = base
        self.headers = headers or {}
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def __call__(self, path: str, data: bytes | dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
        if isinstance(data, dict):
            data = urlencode(data).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={**self.headers, **(headers or {})})
        try:
            with self.opener.open(req, timeout=10) as resp:
                return resp.status, resp.read().decode(), resp.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), exc.headers
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError) as exc:
            return 0, f"connection dropped: {exc!r}", {}

    def csrf(self, path: str = "/") -> str:
        status, page, _ = self(path)
        assert status == 200, page
        return re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)  # type: ignore[union-attr]


def serve(app: Celery, address: str = "127.0.0.1", auth: Auth | None = None,
          read_only: bool = False) -> tuple[DashboardServer, str]:
    server = make_server(app, address, 0, auth, read_only)
    serve_in_thread(server)
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def stop(server: DashboardServer) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture
def wapp(redis_url, uid):
    return make_app(redis_url, uid, delayed_shards=4)


@pytest.fixture
def dashboard(wapp) -> Iterator[tuple[DashboardServer, str]]:
    server, base = serve(wapp)
    yield server, base
    stop(server)


@pytest.fixture
def client(dashboard) -> Client:
    return Client(dashboard[1])


def _dead_letter(app, **kw: Any) -> str:
    """A dead letter with its message (misfire policy 'dead'), released in this process."""
    h = apply_later(app, kw.pop("task", "e2e.mark"), args=kw.pop("args", (7,)), when=0, max_lateness=0.05,
                    misfire="dead", strict=False, **kw)
    time.sleep(0.2)
    store = get_store(app)
    for s in range(store.config.shards):
        store.release.release_due(s)
    assert store.lookup.get(h.id)["st"] == "DEAD"
    return h.id


# -- authentication ----------------------------------------------------------------------


def test_basic_auth_token_and_loopback_rules(wapp):
    with pytest.raises(PermissionError, match="without credentials"):
        make_server(wapp, "0.0.0.0", 0)
    server, base = serve(wapp, auth=Auth.basic("ops:s3cret"))
    fetch = Client(base)
    try:
        status, _, headers = fetch("/")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
        bad = base64.b64encode(b"ops:wrong").decode()
        assert fetch("/", headers={"Authorization": f"Basic {bad}"})[0] == 401
        good = base64.b64encode(b"ops:s3cret").decode()
        assert fetch("/", headers={"Authorization": f"Basic {good}"})[0] == 200
        assert fetch("/healthz")[0] == 200
    finally:
        stop(server)
    server, base = serve(wapp, auth=Auth(token="tok-123"))
    fetch = Client(base)
    try:
        assert fetch("/jobs")[0] == 401
        assert fetch("/jobs", headers={"Authorization": "Bearer tok-123"})[0] == 200
        assert fetch("/jobs", headers={"Cookie": "cd_token=tok-123"})[0] == 200
        assert fetch("/jobs", headers={"Cookie": "cd_token=nope"})[0] == 401
        status, page, _ = fetch("/login?token=tok-123")  # sets the cookie, then every page opens
        assert status == 200 and "Overview" in page
        assert fetch("/jobs")[0] == 200
    finally:
        stop(server)


def test_an_empty_or_short_credential_is_none(wapp):
    """An empty token or password counts as none: off loopback the dashboard refuses to start; a token off
    loopback needs 16 characters; and no empty credential ever opens a page."""
    for auth in (Auth(token=""), Auth(user="ops", password=""), Auth(user="", password="")):
        with pytest.raises(PermissionError, match="without credentials"):
            make_server(wapp, "0.0.0.0", 0, auth)
    with pytest.raises(PermissionError, match="at least 16"):
        make_server(wapp, "0.0.0.0", 0, Auth(token="short-token"))
    with pytest.raises(ValueError, match="user:password"):
        Auth.basic(":")
    make_server(wapp, "0.0.0.0", 0, Auth(token="x" * 16)).server_close()  # long enough: it binds
    # A configured token never matches an empty one, however it is sent.
    server, base = serve(wapp, auth=Auth(token="tok-123"))
    fetch = Client(base)
    try:
        for headers in ({"Authorization": "Bearer "}, {"Authorization": "Bearer"}, {"Cookie": "cd_token="}):
            assert fetch("/", headers=headers)[0] == 401, headers
        assert fetch("/login?token=")[0] == 401
        assert fetch("/", headers={"Cookie": "cd_token="})[0] == 401
    finally:
        stop(server)


def test_the_web_command_refuses_an_empty_or_short_token(wapp):
    from celery.bin.base import CLIContext

    from celery_delayed.cli import delayed

    def web(*args: str) -> Any:
        obj = CLIContext(app=wapp, no_color=True, workdir=None, quiet=True)
        return CliRunner().invoke(delayed, ["web", "--port", "0", *args], obj=obj)

    for args in (["--token", ""], ["--address", "0.0.0.0", "--token", ""]):
        res = web(*args)
        assert res.exit_code == 2 and "--token is empty" in res.output, res.output
    res = web("--basic-auth", "")
    assert res.exit_code == 1 and "--basic-auth takes user:password" in res.output, res.output
    res = web("--address", "0.0.0.0", "--token", "tok-123")
    assert res.exit_code == 1 and "at least 16" in res.output, res.output


# -- hostile requests: each refused with a 4xx, nothing changed in the store ----------------

TOKEN = "module-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Fleet:
    """One app and one token-protected dashboard for the module's tables (a job, a dead letter, no pause)."""

    def __init__(self, redis_url: str) -> None:
        self.app = make_app(redis_url, uuid.uuid4().hex[:10], delayed_shards=4)
        self.store = get_store(self.app)
        self.job = apply_later(self.app, "e2e.mark", args=(1,), when=3600, strict=False).id
        self.dead = _dead_letter(self.app)
        self.server, self.base = serve(self.app, auth=Auth(token=TOKEN))
        self.client = Client(self.base, AUTH)
        self.token = self.client.csrf()
        self.redis = redis.Redis.from_url(redis_url)

    def fingerprint(self) -> dict[bytes, bytes | None]:
        """Every key of the store with its value, serialized (DUMP): any write shows."""
        prefix = self.store.config.key_prefix
        return {k: self.redis.dump(k) for k in sorted(self.redis.scan_iter(match=f"{prefix}*", count=1000))}


@pytest.fixture(scope="module")
def fleet(redis_server) -> Iterator[Fleet]:
    f = Fleet(redis_server.url)
    yield f
    stop(f.server)
    f.redis.close()


def _routes(f: Fleet) -> list[tuple[str, dict[str, str]]]:
    """Every POST route, with a form that would change the store if it got through."""
    job, dead = quote(f.job, safe=""), quote(f.dead, safe="")
    return [(f"/jobs/{job}/cancel", {}), (f"/jobs/{job}/promote", {}), (f"/jobs/{job}/reschedule", {"when": "60"}),
            (f"/dlq/{dead}/requeue", {}), ("/dlq/purge", {"older_than": "0"}), ("/pause", {}),
            ("/resume", {"flag": "all"}), ("/limits", {"op": "set", "key": "e2e.mark", "rate": "5/s"})]


ROUTES = ["cancel", "promote", "reschedule", "requeue", "purge", "pause", "resume", "limits"]

#: (what, method, path, form, headers, expected status). In a form, {csrf} is the server's token; paths
#: starting "route:" are the POST routes of _routes(); {job} / {hash} are filled in per case.
HOSTILE: list[tuple[str, str, str, dict[str, str] | None, dict[str, str], int]] = [
    ("no credentials", "GET", "/", None, {"Authorization": ""}, 401),
    ("empty bearer", "GET", "/jobs", None, {"Authorization": "Bearer "}, 401),
    ("wrong bearer", "GET", "/jobs", None, {"Authorization": "Bearer module-token-0123456780"}, 401),
    ("basic on a token server", "GET", "/", None, {"Authorization": "Basic b3BzOnB3"}, 401),
    ("empty cookie", "GET", "/dlq", None, {"Authorization": "", "Cookie": "cd_token="}, 401),
    ("garbage cookie", "GET", "/", None, {"Authorization": "", "Cookie": 'cd_token="x; =;;cd_flash=.'}, 401),
    ("basic, not base64", "GET", "/", None, {"Authorization": "Basic !!!"}, 401),
    ("empty login", "GET", "/login?token=", None, {"Authorization": ""}, 401),
    ("wrong login", "GET", "/login?token=nope", None, {"Authorization": ""}, 401),
    ("unauthenticated pause", "POST", "/pause", {"csrf": "{csrf}"}, {"Authorization": ""}, 401),
    ("unauthenticated purge", "POST", "/dlq/purge", {"csrf": "{csrf}", "confirm": "all"}, {"Authorization": ""}, 401),
    ("wrong bearer purge", "POST", "/dlq/purge", {"csrf": "{csrf}", "confirm": "all"},
     {"Authorization": "Bearer x"}, 401),
    ("purge older_than=abc", "POST", "/dlq/purge", {"csrf": "{csrf}", "older_than": "abc"}, {}, 400),
    ("purge older_than=-1", "POST", "/dlq/purge", {"csrf": "{csrf}", "older_than": "-1"}, {}, 400),
    ("purge older_than=inf", "POST", "/dlq/purge", {"csrf": "{csrf}", "older_than": "inf"}, {}, 400),
    ("purge older_than=nan", "POST", "/dlq/purge", {"csrf": "{csrf}", "older_than": "nan"}, {}, 400),
    ("resume an unknown flag", "POST", "/resume", {"csrf": "{csrf}", "flag": "shard:3"}, {}, 400),
    ("a limit's unknown op", "POST", "/limits", {"csrf": "{csrf}", "op": "drop", "key": "e2e.mark"}, {}, 400),
    ("a limit without an op", "POST", "/limits", {"csrf": "{csrf}", "key": "e2e.mark", "rate": "1/s"}, {}, 400),
    ("a limit of a bad key", "POST", "/limits", {"csrf": "{csrf}", "op": "set", "key": "qeue:x", "rate": "1/s"}, {},
     400),
    ("a limit without a key", "POST", "/limits", {"csrf": "{csrf}", "op": "lift", "key": " "}, {}, 400),
    ("a limit of a bad rate", "POST", "/limits", {"csrf": "{csrf}", "op": "set", "key": "e2e.mark", "rate": "fast"},
     {}, 400),
    ("a limit of rate 0/s", "POST", "/limits", {"csrf": "{csrf}", "op": "set", "key": "e2e.mark", "rate": "0/s"}, {},
     400),
    ("a limit set without a rate", "POST", "/limits", {"csrf": "{csrf}", "op": "set", "key": "e2e.mark"}, {}, 400),
    ("cancel no such job", "POST", "/jobs/no-such-job/cancel", {"csrf": "{csrf}"}, {}, 404),
    ("post nowhere", "POST", "/nowhere", {"csrf": "{csrf}"}, {}, 404),
    ("a huge form", "POST", "/pause", {"csrf": "{csrf}", "x": "y" * 70_000}, {}, 413),
    ("a Content-Length that is no number", "POST", "/pause", {"csrf": "{csrf}"}, {"Content-Length": "abc"}, 400),
    ("cursor naming a hash key", "GET", "/jobs?after=1|{hash}|x", None, {}, 400),
    ("cursor naming a key off the store", "GET", "/jobs?after=1|someone-elses-key|x", None, {}, 400),
    ("cursor of another shard count", "GET", "/jobs?after=1|99|x", None, {}, 400),
    ("cursor without an id", "GET", "/jobs?after=1|0|", None, {}, 400),
    ("cursor, garbage", "GET", "/jobs?after=garbage", None, {}, 400),
    ("offset=abc", "GET", "/dlq?offset=abc", None, {}, 400),
    ("offset=-1", "GET", "/dlq?offset=-1", None, {}, 400),
    ("no such job", "GET", "/jobs/no-such-job", None, {}, 404),
]
for _route in ROUTES:
    HOSTILE += [
        (f"{_route}: no csrf", "POST", f"route:{_route}", {}, {}, 403),
        (f"{_route}: wrong csrf", "POST", f"route:{_route}", {"csrf": "0" * 40}, {}, 403),
        (f"{_route}: cross origin", "POST", f"route:{_route}", {"csrf": "{csrf}"}, {"Origin": "http://evil.example"},
         403),
        (f"{_route}: cross site", "POST", f"route:{_route}", {"csrf": "{csrf}"}, {"Sec-Fetch-Site": "cross-site"}, 403),
    ]


@pytest.mark.parametrize(("what", "method", "path", "form", "headers", "expected"), HOSTILE,
                         ids=[case[0] for case in HOSTILE])
def test_a_hostile_request_is_refused_and_changes_nothing(fleet: Fleet, what, method, path, form, headers, expected):
    if path.startswith("route:"):
        path, action_form = _routes(fleet)[ROUTES.index(path[6:])]
        form = {**action_form, **form}
    record = fleet.store.keys.shard(fleet.store.layout.shard_of(fleet.job)).job(fleet.job)  # a hash
    path = path.replace("{hash}", record)
    before = fleet.fingerprint()
    data = None if method == "GET" else {k: v.replace("{csrf}", fleet.token) for k, v in (form or {}).items()}
    status, body, _ = fleet.client(path, data, {k: v for k, v in headers.items()})
    assert status == expected, (what, status, body)
    assert body.strip(), "a refusal says why"
    assert fleet.fingerprint() == before, what


def test_a_bad_request_gets_a_page_that_says_what_was_wrong(fleet: Fleet):
    status, page, _ = fleet.client("/jobs?after=1|99|x", headers={"Accept": "text/html"})
    assert status == 400 and "<h1>Bad Request</h1>" in page
    assert "the cursor names shard 99; the store has shards 0 to 3" in page
    status, page, _ = fleet.client("/jobs?after=1|x", headers={"Accept": "text/html"})
    assert status == 400 and "bad cursor" in page and "open /jobs for the first page" in page
    status, text, headers = fleet.client("/dlq?offset=abc")
    assert status == 400 and headers["Content-Type"].startswith("text/plain") and "offset must be" in text


def test_read_only_serves_no_action(wapp):
    h = apply_later(wapp, "e2e.mark", when=600, strict=False)
    server, base = serve(wapp, read_only=True)
    fetch = Client(base)
    try:
        _, page, _ = fetch(f"/jobs/{h.id}")
        assert "read-only" in page and 'method="post"' not in page
        assert fetch(f"/jobs/{h.id}/cancel", b"csrf=x")[0] == 403
        stats = get_store(wapp).keys.shard(0).stats  # the cursor is checked here too: no key is probed
        assert fetch(f"/jobs?after=1|{stats}|x")[0] == 400
    finally:
        stop(server)


# -- flash messages --------------------------------------------------------------------------


def test_the_outcome_of_an_action_shows_once_and_never_from_the_url(wapp, client):
    h = apply_later(wapp, "e2e.mark", when=600, strict=False)
    _, page, _ = client(f"/jobs/{h.id}?ok=Your+session+expired%3A+log+in+at+evil.example&error=forged")
    assert "evil.example" not in page and "forged" not in page and 'id="flash"' not in page
    token = client.csrf(f"/jobs/{h.id}")
    status, page, _ = client(f"/jobs/{h.id}/cancel", {"csrf": token})
    assert status == 200 and 'id="flash">cancelled (was SCHEDULED)' in page
    _, page, _ = client(f"/jobs/{h.id}")
    assert 'id="flash"' not in page  # shown once
    # a flash cookie the server did not sign shows nothing
    forged = base64.urlsafe_b64encode(b"oYou are logged out").decode().rstrip("=")
    _, page, _ = Client(client.base)("/", headers={"Cookie": f"cd_flash={forged}.{'0' * 32}"})
    assert "logged out" not in page


# -- pages -------------------------------------------------------------------------------------


def test_pending_pages_in_due_order_with_arguments_and_a_total(wapp, client):
    ids = [h.id for h in apply_later_many(wapp, "e2e.mark", [{"args": (i,), "when": 100 + i} for i in range(120)],
                                          strict=False)]
    apply_later_many(wapp, "e2e.sleep", [{"args": (i,), "when": 50 + i} for i in range(5)], strict=False)
    keyed = apply_later(wapp, "e2e.mark", args=("k",), kwargs={"n": 1}, when=9999, idempotency_key="welcome-42",
                        strict=False)
    seen: list[str] = []
    url: str | None = "/jobs?task=e2e.mark"
    while url:
        _, page, _ = client(url)
        assert '<b>121</b> pending jobs (task e2e.mark)' in page
        rows = re.findall(r'<tr><td class="mono id"><a href="/jobs/([^"]+)">', page)
        assert len(rows) <= 50
        seen += rows
        m = re.search(r'id="next-page" href="([^"]+)"', page)
        url = m.group(1).replace("&amp;", "&") if m else None
    assert seen == [*ids, keyed.id]  # due order, every one once
    assert "(&#x27;k&#x27;,) {&#x27;n&#x27;: 1}" in page  # the arguments column: argsrepr and kwargsrepr
    _, page, _ = client("/jobs")
    assert "<b>126</b> pending jobs, earliest due first; 50 on this page" in page
    assert "<th>arguments</th>" in page and ">(0,)</td>" in page
    first = re.findall(r'<tr><td class="mono id"><a href="/jobs/([^"]+)">', page)
    assert len(first) == 50 and "e2e.sleep" in page.split(first[5])[0]
    status, page, _ = client("/jobs?q=welcome-42")
    assert status == 200 and f"Job {keyed.id}" in page and job_id_for_key("welcome-42") == keyed.id
    status, page, _ = client(f"/jobs?q={ids[3]}")
    assert f"Job {ids[3]}" in page
    _, page, _ = client("/jobs?q=nothing-like-it")
    assert "no job with id or idempotency key" in page
    _, css, headers = client("/static/app.css")
    assert headers["Content-Type"].startswith("text/css") and "--accent" in css


def test_the_job_page_speaks_words_and_folds_the_raw_record(wapp, client):
    h = apply_later(wapp, "e2e.mark", args=("alice", 3), kwargs={"x": 1}, when=600, strict=False,
                    idempotency_key="order-7")
    _, page, _ = client(f"/jobs/{h.id}")
    summary, raw = page.split('<details id="raw-record">')
    labels = re.findall(r"<dt>([^<]+)</dt>", summary)
    assert labels[:8] == ["job id", "state", "task", "arguments", "keyword arguments", "queue", "due", "attempts"]
    assert "idempotency key" in labels
    assert "<dd class=mono>(&#x27;alice&#x27;, 3)</dd>" in summary and "{&#x27;x&#x27;: 1}" in summary
    assert "none yet" in summary and re.search(r"\(in (9|10)m", summary)
    for code in ("lk", "rk", "tp", "q", "st", "ik"):  # the short names only in the folded raw record
        assert f">{code}<" not in summary, code
    assert "<td class=mono>lk</td><td>broker list</td>" in raw
    assert "<td class=mono>st</td><td>state</td><td class=mono>SCHEDULED</td>" in raw


def test_arguments_are_shown_as_the_app_redacts_them(wapp, client):
    h = apply_later(wapp, "e2e.mark", args=("alice", "hunter2"), kwargs={"card": "4111-1111-1111-1111"},
                    when=600, strict=False,
                    argsrepr="('alice', '***')", kwargsrepr="{'card': '***'}")
    _, page, _ = client(f"/jobs/{h.id}")
    # (the card with its dashes: "4111" alone turned up once inside the page's random CSRF token)
    assert "hunter2" not in page and "4111-1111" not in page
    assert "(&#x27;alice&#x27;, &#x27;***&#x27;)" in page
    _, page, _ = client("/jobs")
    assert "hunter2" not in page and "(&#x27;alice&#x27;, &#x27;***&#x27;)" in page


def test_ids_with_any_printable_character(wapp, client):
    odd = "odd id/with?chars%&#"
    apply_later(wapp, "e2e.mark", task_id=odd, when=600, strict=False)
    _, page, _ = client("/jobs")
    link = re.search(r'<a href="(/jobs/odd[^"]+)">', page).group(1)
    status, page, _ = client(link)
    assert status == 200 and "Job odd id/with?chars%&amp;#" in page
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
    action = re.search(r'<form class="inline" method="post" action="([^"]+/cancel)"', page).group(1)
    status, page, _ = client(action, {"csrf": token})
    assert status == 200 and get_store(wapp).lookup.get(odd)["st"] == "CANCELLED"


def test_run_now_reschedule_pause_resume_and_purge_from_the_pages(wapp, client):
    store = get_store(wapp)
    h = apply_later(wapp, "e2e.mark", when=3600, strict=False)
    token = client.csrf(f"/jobs/{h.id}")

    def post(path: str, **form: str) -> str:
        status, body, _ = client(path, {"csrf": token, **form})
        assert status == 200, body
        return body

    assert "rescheduled to" in post(f"/jobs/{h.id}/reschedule", when="7200")
    assert int(store.lookup.get(h.id)["due"]) >= store.redis.now_ms() + 7_100_000
    assert "when must be seconds from now or an ISO date" in post(f"/jobs/{h.id}/reschedule", when="next tuesday")
    assert "due now" in post(f"/jobs/{h.id}/promote")
    assert int(store.lookup.get(h.id)["due"]) <= store.redis.now_ms()
    assert "paused queue:" in post("/pause", queue=wapp.conf.task_default_queue)
    assert store.jobs.pauses()
    _, page, _ = client("/")
    assert f"queue:{wapp.conf.task_default_queue}" in page
    assert "resumed" in post("/resume", flag=f"queue:{wapp.conf.task_default_queue}")
    assert not store.jobs.pauses()
    dead = _dead_letter(wapp)
    assert "purged 0 dead letter(s)" in post("/dlq/purge", older_than="3600")  # none that old: no question
    # The box left empty: every dead letter, so the page asks first, as `delayed dlq purge` does.
    page = post("/dlq/purge", older_than="")
    assert "Purge <b>every</b> dead letter (1 now)?" in page and 'name="confirm" value="all"' in page
    assert store.lookup.get(dead)["st"] == "DEAD"
    assert "purged 1 dead letter(s)" in post("/dlq/purge", older_than="", confirm="all")
    with pytest.raises(JobNotFound):
        store.lookup.get(dead)


def test_rate_limits_and_tenants_on_the_overview_and_changed_from_it(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=2, delayed_rate_limits={"e2e.mark": "10/m"})
    store = get_store(app)
    apply_later_many(app, "e2e.mark", [{"args": (i,), "when": 0} for i in range(8)], strict=False)
    for s in store.layout.shard_range():
        store.release.release_due(s)
    waiting = store.shaping.waiting()["e2e.mark"]
    for i in range(23):
        apply_later_many(app, "e2e.sleep", [{"when": 600, "tenant": f"t{i:02d}"} for _ in range(i + 1)],
                         strict=False)
    server, base = serve(app)
    client = Client(base)
    try:
        _, page, _ = client("/")
        limits = page.split('id="limits"')[1].split('id="tenants"')[0]
        assert f"{waiting} due job(s) held back" in limits
        assert re.search(rf"<td class=mono>e2e.mark</td><td class=mono>10/m</td><td>app</td>"
                         rf'<td class="num warnline">{waiting}</td>', limits)
        tenants = page.split('id="tenants"')[1]
        assert "Tenants (23, 276 scheduled job(s))" in tenants and "<td>t22</td><td class=num>23</td>" in tenants
        assert "<td>t02</td>" not in tenants and "and 3 more tenant(s) with 6 job(s)" in tenants
        token = client.csrf("/")

        def post(**form: str) -> tuple[int, str]:
            status, body, _ = client("/limits", {"csrf": token, **form})
            return status, body

        status, body = post(op="set", key="queue:bulk", rate="50/s")
        assert status == 200 and 'id="flash">queue:bulk: limited to 50/s' in body
        assert "<td class=mono>queue:bulk</td><td class=mono>50/s</td><td>runtime</td>" in body
        assert store.shaping.runtime_limits() == {"queue:bulk": 50.0}
        status, body = post(op="lift", key="e2e.mark")
        assert status == 200 and "e2e.mark: lifted until reset" in body
        assert "<td class=mono>e2e.mark</td><td class=mono>none</td><td>lifted</td>" in body
        status, body = post(op="reset", key="e2e.mark")
        assert status == 200 and "e2e.mark: back to the app&#x27;s setting" in body
        assert store.shaping.runtime_limits() == {"queue:bulk": 50.0}
        status, body, _ = client("/limits", {"csrf": token, "op": "set", "key": "e2e.mark", "rate": "lots"},
                                       {"Accept": "text/html"})
        assert status == 400 and "&#x27;lots&#x27; is not a rate" in body and "<h1>Bad Request</h1>" in body
    finally:
        stop(server)
    server, base = serve(app, read_only=True)
    try:
        _, page, _ = Client(base)("/")
        assert 'id="limits"' in page and 'id="limit-form"' not in page and 'method="post"' not in page
    finally:
        stop(server)


# -- escaping: markup in every field the pages show --------------------------------------------

MARK = """<xss data-x="1">'" onfocus="alert(1)" &amp;"""


class _Tags(HTMLParser):
    """The start tags and attribute names of a page, and its text as a reader sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parsed(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    return parser


def test_markup_in_every_field_is_shown_as_text_on_every_page(wapp, client):
    store = get_store(wapp)
    task, queue = f"e2e.{MARK}", f"q{MARK}"
    job = apply_later(wapp, task, args=(MARK,), kwargs={MARK: MARK}, when=600, queue=queue, task_id=f"id{MARK}",
                      shard_key=f"sk{MARK}", strict=False)
    keyed = apply_later(wapp, task, when=700, queue=queue, idempotency_key=f"key{MARK}", strict=False,
                        tenant=f"tn{MARK}")
    store.shaping.set_limit(task, "1/s")  # the overview's limits and tenants show both
    dead = _dead_letter(wapp, task=task, task_id=f"dead{MARK}", argsrepr=f"({MARK!r},)")
    shard = store.layout.shard_of(dead)
    store.redis.client.hset(store.keys.shard(shard).job(dead), mapping={
        "etype": f"app.{MARK}", "emsg": MARK, "tb": f"Traceback {MARK}", "reason": MARK})
    token = client.csrf("/")
    client(f"/jobs/{quote(job.id, safe='')}/cancel", {"csrf": token})
    _, cancelled_again, _ = client(f"/jobs/{quote(job.id, safe='')}/cancel", {"csrf": token},
                                   {"Referer": f"{client.base}/jobs/{quote(job.id, safe='')}"})
    assert "cannot cancel job" in cancelled_again  # an error flash that names the id
    flash = f"?ok={quote(MARK)}&error={quote(MARK)}"
    paths = ["/", "/?span=day", "/jobs", f"/jobs?task={quote(task)}&queue={quote(queue)}", f"/jobs?q={quote(MARK)}",
             "/dlq", "/schedules", *(f"/jobs/{quote(j, safe='')}" for j in (job.id, keyed.id, dead))]
    pages = {p: client(p + ("&" if "?" in p else "?") + flash[1:]) for p in paths}
    pages["cancel again"] = (200, cancelled_again, {})
    pages["bad cursor"] = client(f"/jobs?after={quote(MARK)}", headers={"Accept": "text/html"})
    pages["purge question"] = client("/dlq/purge", {"csrf": token})
    for where, (status, page, _) in pages.items():
        assert status in (200, 400), (where, status)
        parsed = _parsed(page)
        assert "xss" not in parsed.tags and not {"data-x", "onfocus"} & parsed.attrs, where
        assert MARK not in page and "<xss" not in page, where
    # ... and shown, as text, where the values are
    for where in (f"/jobs/{quote(job.id, safe='')}", f"/jobs/{quote(dead, safe='')}"):
        text = "".join(_parsed(pages[where][1]).text)
        assert text.count(MARK) >= 4, (where, text)
    dead_text = "".join(_parsed(pages[f"/jobs/{quote(dead, safe='')}"][1]).text)
    assert f"Traceback {MARK}" in dead_text and f"app.{MARK}: {MARK}" in dead_text
    assert MARK in "".join(_parsed(pages["/jobs"][1]).text)
    assert MARK in "".join(_parsed(pages["/dlq"][1]).text)
    overview = "".join(_parsed(pages["/"][1]).text)
    assert f"tn{MARK}" in overview and task in overview  # the tenants' and the rate limits' panels


# -- the real browser and the real command -----------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_in_a_real_browser_cancel_and_requeue(wapp, dashboard, tmp_path):
    need("Debian's chromium, chromium-driver and selenium", browser_available())
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    _, base = dashboard
    h = apply_later(wapp, "e2e.mark", args=(1,), when=3600, strict=False)
    dead = _dead_letter(wapp)
    store = get_store(wapp)
    with chromium() as drv:
        wait = WebDriverWait(drv, 10)
        drv.get(base + "/")
        assert "Overview" in drv.title
        assert drv.find_element(By.ID, "counts").is_displayed()
        assert "e2e.mark" in drv.find_element(By.ID, "by-task").text
        drv.find_element(By.LINK_TEXT, "Pending jobs").click()
        wait.until(ec.presence_of_element_located((By.ID, "pending")))
        drv.find_element(By.LINK_TEXT, h.id).click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "job-state"), "SCHEDULED"))
        assert not drv.find_element(By.ID, "raw-record").find_element(By.TAG_NAME, "table").is_displayed()
        drv.find_element(By.CSS_SELECTOR, "#raw-record summary").click()  # the raw record unfolds
        assert drv.find_element(By.ID, "raw-record").find_element(By.TAG_NAME, "table").is_displayed()
        drv.find_element(By.ID, "cancel").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "flash"), "cancelled (was SCHEDULED)"))
        assert drv.find_element(By.ID, "job-state").text == "CANCELLED"
        assert store.lookup.get(h.id)["st"] == "CANCELLED"
        drv.refresh()
        assert not drv.find_elements(By.ID, "flash")  # shown once
        drv.save_screenshot(str(tmp_path / "job.png"))

        drv.get(base + "/dlq")
        assert dead in drv.find_element(By.ID, "dead-letters").text
        box = drv.find_element(By.ID, "older-than")
        assert box.get_attribute("placeholder") == "all ages" and box.size["width"] >= 100
        drv.find_element(By.ID, "purge").click()  # left empty: the page asks first
        wait.until(ec.presence_of_element_located((By.ID, "purge-confirm")))
        drv.find_element(By.ID, "keep").click()
        wait.until(ec.presence_of_element_located((By.ID, f"requeue-{dead}")))
        assert store.lookup.get(dead)["st"] == "DEAD"
        drv.find_element(By.ID, f"requeue-{dead}").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "flash"), "requeued"))
        assert store.lookup.get(dead)["st"] == "SCHEDULED"
        assert drv.find_element(By.ID, "job-state").text == "SCHEDULED"

        # search by idempotency key from the header
        k = apply_later(wapp, "e2e.mark", when=60, idempotency_key="order-9", strict=False)
        drv.find_element(By.ID, "search").send_keys("order-9")
        drv.find_element(By.ID, "search-go").click()
        wait.until(ec.title_contains(k.id))


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_in_a_real_browser_change_a_rate_limit(redis_url, uid, tmp_path):
    need("Debian's chromium, chromium-driver and selenium", browser_available())
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    app = make_app(redis_url, uid, delayed_shards=2, delayed_rate_limits={"e2e.mark": "10/m", "tenant:*": "5/s"})
    store = get_store(app)
    apply_later_many(app, "e2e.mark", [{"args": (i,), "when": 0} for i in range(12)], strict=False)
    for s in store.layout.shard_range():
        store.release.release_due(s)
    for name, n in (("acme", 40), ("globex", 12), ("initech", 3)):
        apply_later_many(app, "e2e.sleep", [{"when": 600, "tenant": name} for _ in range(n)], strict=False)
    server, base = serve(app)
    try:
        with chromium(height=1500) as drv:
            wait = WebDriverWait(drv, 10)
            drv.get(base + "/")
            panel = drv.find_element(By.ID, "limits")
            assert "e2e.mark" in panel.text and "10/m" in panel.text
            assert "acme 40" in drv.find_element(By.ID, "tenants").text
            drv.find_element(By.ID, "limit-key").send_keys("queue:bulk")
            drv.find_element(By.ID, "limit-rate").send_keys("100/s")
            drv.find_element(By.ID, "limit-set").click()
            wait.until(ec.text_to_be_present_in_element((By.ID, "flash"), "queue:bulk: limited to 100/s"))
            assert "queue:bulk 100/s runtime 0" in drv.find_element(By.ID, "limits").text
            assert store.shaping.runtime_limits() == {"queue:bulk": 100.0}
            drv.find_element(By.ID, "limit-key").send_keys("e2e.mark")
            drv.find_element(By.ID, "limit-lift").click()
            wait.until(ec.text_to_be_present_in_element((By.ID, "flash"), "e2e.mark: lifted until reset"))
            assert store.shaping.runtime_limits()["e2e.mark"] == 0
            drv.find_element(By.ID, "limits").location_once_scrolled_into_view  # noqa: B018 (scrolls)
            drv.save_screenshot(str(tmp_path / "limits.png"))
            drv.find_element(By.ID, "limit-set").click()  # no key: the browser asks for one, nothing is posted
            assert store.shaping.runtime_limits() == {"queue:bulk": 100.0, "e2e.mark": 0.0}
    finally:
        stop(server)


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_the_web_command_serves_and_refuses_an_open_address_without_credentials(redis_url, uid, workers):
    prefix, queue = f"t{uid}", f"q{uid}"
    res = run_celery(redis_url, prefix, queue, "delayed", "web", "--address", "0.0.0.0", "--port", "0")
    assert res.returncode == 1 and "without credentials" in res.stderr
    res = run_celery(redis_url, prefix, queue, "delayed", "web", "--address", "0.0.0.0", "--port", "0",
                     "--token", "")  # `--token "$TOKEN"` with TOKEN unset
    assert res.returncode == 2 and "--token is empty" in res.stderr
    port = free_port()
    web = Proc([sys.executable, "-m", "celery", "-A", "e2e_app", "delayed", "web", "--port", str(port),
                "--basic-auth", "ops:pw"], app_env(redis_url, prefix, queue))
    workers.append(web)
    fetch = Client(f"http://127.0.0.1:{port}")
    wait_for(lambda: fetch("/healthz")[0] == 200, 20, interval=0.1, what="the dashboard")
    status, _, headers = fetch("/")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
    auth = base64.b64encode(b"ops:pw").decode()
    status, page, _ = fetch("/", headers={"Authorization": f"Basic {auth}"})
    assert status == 200 and f"prefix {prefix}" in page
