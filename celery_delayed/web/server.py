"""The dashboard's HTTP server: routes, authentication, CSRF, actions (standard library only).

Bound to 127.0.0.1 by default. Without credentials it serves only on a
loopback address (as Flower does); with ``basic`` credentials an
unauthenticated request gets 401 with ``WWW-Authenticate: Basic``; with a
``token``, a request must carry ``Authorization: Bearer <token>`` or the
cookie that ``/login?token=<token>`` sets. Every action is a POST carrying
the server's CSRF token (and, when the browser sends one, an ``Origin`` of
this server); ``read_only`` serves no action at all.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from string import Template
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from celery import Celery

from .. import controls, dlq
from ..cancellation import cancel_job
from ..errors import DelayedError, InvalidWhen, JobNotFound
from ..producer.prepare import job_id_for_key
from ..store import Pending, get_store
from ..store.stats import FleetStats
from ..timeutil import due_spec, from_ms
from . import pages

logger = logging.getLogger("celery_delayed.web")

_JOB = re.compile(r"^/jobs/([^/]+)(?:/(cancel|promote|reschedule))?$")
_DLQ = re.compile(r"^/dlq/([^/]+)/requeue$")
_STATIC = {"app.css": "text/css; charset=utf-8"}
_COOKIE = "cd_token"
_CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'")


@dataclass(frozen=True)
class Auth:
    """How requests authenticate: HTTP basic (``user``, ``password``), a bearer ``token``, or neither."""

    user: str | None = None
    password: str | None = None
    token: str | None = None

    @classmethod
    def basic(cls, spec: str) -> Auth:
        """From ``user:password`` (as Flower's ``--basic-auth`` spells it)."""
        user, sep, password = spec.partition(":")
        if not sep or not user or not password:
            raise ValueError("--basic-auth takes user:password")
        return cls(user=user, password=password)

    @property
    def required(self) -> bool:
        return self.user is not None or self.token is not None


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class Dashboard:
    """What every request shares: the app, the store, the settings, the CSRF secret."""

    def __init__(self, app: Celery, auth: Auth | None = None, read_only: bool = False) -> None:
        self.app = app
        self.store = get_store(app)
        self.auth = auth or Auth()
        self.read_only = read_only
        self.csrf = hmac.new(secrets.token_bytes(32), b"csrf", hashlib.sha256).hexdigest()[:40]
        base = files("celery_delayed.web")
        self.layout = Template((base / "templates" / "base.html").read_text(encoding="utf-8"))
        self.static = {name: (base / "static" / name).read_bytes() for name in _STATIC}


class Handler(BaseHTTPRequestHandler):
    """One request (see the module docstring)."""

    server: DashboardServer
    protocol_version = "HTTP/1.1"

    @property
    def dash(self) -> Dashboard:
        return self.server.dashboard

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    # -- responses -----------------------------------------------------------------

    def _send(self, status: int, body: bytes, ctype: str = "text/html; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "same-origin")
        self.send_header("Cache-Control", "no-store" if ctype.startswith("text/html") else "max-age=3600")
        if ctype.startswith("text/html"):
            self.send_header("Content-Security-Policy", _CSP)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _redirect(self, location: str, flash: str = "", error: bool = False) -> None:
        if flash:
            sep = "&" if "?" in location else "?"
            location += sep + urlencode({"error" if error else "ok": flash})
        self._send(HTTPStatus.SEE_OTHER, b"", headers={"Location": location})

    def _page(self, title: str, body: str, nav: str, t0: float, status: int = 200, search: str = "") -> None:
        q = parse_qs(urlsplit(self.path).query)
        flash = ""
        if q.get("ok"):
            flash = f'<p class="flash" id="flash">{pages.e(q["ok"][0])}</p>'
        elif q.get("error"):
            flash = f'<p class="flash error" id="flash">{pages.e(q["error"][0])}</p>'
        cfg = self.dash.store.config
        html = self.dash.layout.substitute(
            title=pages.e(title), body=body, flash=flash, search=pages.e(search),
            nav_overview=' class="current"' if nav == "overview" else "",
            nav_jobs=' class="current"' if nav == "jobs" else "", nav_dlq=' class="current"' if nav == "dlq" else "",
            nav_schedules=' class="current"' if nav == "schedules" else "",
            store=pages.e(f"prefix {cfg.key_prefix} · {self.dash.store.layout.shards} shards"),
            mode=" · read-only" if self.dash.read_only else "",
            render_ms=f"{(time.perf_counter() - t0) * 1000:.0f}",
            now=pages.e(pages.when(self.dash.store.redis.now_ms())),
        )
        self._send(status, html.encode("utf-8"))

    # -- authentication ------------------------------------------------------------

    def _authorized(self) -> bool:
        auth = self.dash.auth
        if not auth.required:
            return True
        header = self.headers.get("Authorization", "")
        if auth.user is not None:
            if not header.startswith("Basic "):
                return False
            try:
                user, _, password = base64.b64decode(header[6:]).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            return hmac.compare_digest(user.encode(), auth.user.encode()) and \
                hmac.compare_digest(password.encode(), (auth.password or "").encode())
        token = auth.token or ""
        if header.startswith("Bearer "):
            return hmac.compare_digest(header[7:].encode(), token.encode())
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        got = cookie.get(_COOKIE)
        return got is not None and hmac.compare_digest(got.value.encode(), token.encode())

    def _challenge(self) -> None:
        if self.dash.auth.user is not None:
            self._send(HTTPStatus.UNAUTHORIZED, b"authentication required\n", "text/plain; charset=utf-8",
                       {"WWW-Authenticate": 'Basic realm="celery-delayed", charset="UTF-8"'})
        else:
            self._send(HTTPStatus.UNAUTHORIZED, b"a token is required: open /login?token=<token>\n",
                       "text/plain; charset=utf-8", {"WWW-Authenticate": 'Bearer realm="celery-delayed"'})

    def _login(self, query: dict[str, list[str]]) -> None:
        token = self.dash.auth.token
        given = (query.get("token") or [""])[0]
        if token is None or not hmac.compare_digest(given.encode(), token.encode()):
            self._challenge()
            return
        cookie = f"{_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
        self._send(HTTPStatus.SEE_OTHER, b"", headers={"Location": "/", "Set-Cookie": cookie})

    # -- GET -----------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        t0 = time.perf_counter()
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
            return
        if path == "/login":
            self._login(query)
            return
        if not self._authorized():
            self._challenge()
            return
        try:
            self._get(path, query, t0)
        except JobNotFound as exc:
            self._page("Not found", f'<p class="flash error">{pages.e(exc)}</p>', "", t0, 404)
        except DelayedError as exc:
            self._page("Error", f'<p class="flash error">{pages.e(exc)}</p>', "", t0, 500)

    def _get(self, path: str, query: dict[str, list[str]], t0: float) -> None:
        dash = self.dash
        if path.startswith("/static/"):
            name = path[len("/static/"):]
            if name in dash.static:
                self._send(200, dash.static[name], _STATIC[name])
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")
            return
        if path == "/":
            span = "day" if (query.get("span") or [""])[0] == "day" else "hour"
            stats = FleetStats(dash.store)
            snap = stats.snapshot()
            step = 60_000 if span == "hour" else 1_800_000
            steps = 60 if span == "hour" else 48
            due = stats.coming_due(snap.now_ms, step, steps)
            labels = [from_ms(snap.now_ms + i * step).strftime("%H:%M") for i in range(steps)]
            body = pages.overview(snap, due, labels, span, dash.csrf, dash.read_only)
            self._page("Overview", body, "overview", t0)
            return
        if path == "/metrics":
            try:
                from ..metrics import render

                data, ctype = render(dash.app)
            except ImportError:
                self._send(404, b'/metrics needs prometheus_client: pip install "celery-delayed[metrics]"\n',
                           "text/plain; charset=utf-8")
                return
            self._send(200, data, ctype)
            return
        if path == "/jobs":
            self._jobs(query, t0)
            return
        m = _JOB.match(path)
        if m and not m.group(2):
            rec = dash.store.lookup.get(unquote(m.group(1)))
            msg = dash.store.lookup.message(rec["id"], int(rec["shard"]))
            self._page(f"Job {rec['id']}", pages.job(rec, msg, dash.store.redis.now_ms(), dash.csrf, dash.read_only),
                       "jobs", t0)
            return
        if path == "/dlq":
            offset = _int((query.get("offset") or ["0"])[0])
            letters = dlq.list_dead(dash.store, offset=offset, limit=50)
            body = pages.dead_letters(letters, dlq.count(dash.store), offset, 50, dash.csrf, dash.read_only)
            self._page("Dead letters", body, "dlq", t0)
            return
        if path == "/schedules":
            from .. import schedules  # the recurring schedules' API

            self._page("Recurring schedules", pages.recurring(schedules.list(dash.app)), "schedules", t0)
            return
        self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _jobs(self, query: dict[str, list[str]], t0: float) -> None:
        store = self.dash.store
        search = (query.get("q") or [""])[0].strip()
        note = ""
        if search:
            for candidate in (search, job_id_for_key(search)):
                try:
                    store.lookup.locate(candidate)
                except JobNotFound:
                    continue
                self._redirect("/jobs/" + quote(candidate, safe=""))
                return
            note = f"no job with id or idempotency key {search!r}"
        task = (query.get("task") or [""])[0] or None
        queue = (query.get("queue") or [""])[0] or None
        after = _cursor((query.get("after") or [""])[0])
        rows, nxt = Pending(store).window(after, 50, task=task, queue=queue)
        base = {k: v for k, v in (("task", task), ("queue", queue)) if v}
        next_link = "/jobs?" + urlencode({**base, "after": f"{nxt[0]}|{nxt[1]}|{nxt[2]}"}) if nxt else None
        first_link = "/jobs?" + urlencode(base) if after else None
        body = pages.pending(rows, store.redis.now_ms(), task, queue, next_link, first_link, note)
        self._page("Pending jobs", body, "jobs", t0, search=search)

    # -- POST (actions) -------------------------------------------------------------

    def do_POST(self) -> None:
        if not self._authorized():
            self._challenge()
            return
        if self.dash.read_only:
            self._send(HTTPStatus.FORBIDDEN, b"read-only dashboard\n", "text/plain; charset=utf-8")
            return
        length = _int(self.headers.get("Content-Length", "0"))
        form = {k: v[0] for k, v in parse_qs(self.rfile.read(min(length, 65536)).decode("utf-8", "replace")).items()}
        if not self._same_origin() or not hmac.compare_digest(form.get("csrf", "").encode(), self.dash.csrf.encode()):
            self._send(HTTPStatus.FORBIDDEN, b"CSRF check failed: reload the page and try again\n",
                       "text/plain; charset=utf-8")
            return
        path = urlsplit(self.path).path
        try:
            self._post(path, form)
        except DelayedError as exc:
            back = self.headers.get("Referer") or "/"
            self._redirect(urlsplit(back).path or "/", str(exc), error=True)

    def _same_origin(self) -> bool:
        if self.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            return False
        origin = self.headers.get("Origin")
        if origin is None or origin == "null":
            return origin is None
        return urlsplit(origin).netloc == self.headers.get("Host", "")

    def _post(self, path: str, form: dict[str, str]) -> None:
        dash, app = self.dash, self.dash.app
        m = _JOB.match(path)
        if m and m.group(2):
            jid, action = unquote(m.group(1)), m.group(2)
            here = "/jobs/" + quote(jid, safe="")
            if action == "cancel":
                prev = cancel_job(dash.store, jid)
                self._redirect(here, f"cancelled (was {prev})")
            elif action == "promote":
                controls.promote(app, jid)
                self._redirect(here, "due now: the scheduler releases it at once")
            else:
                due = dash.store.jobs.reschedule(jid, _when(form.get("when", ""), app))
                self._redirect(here, f"rescheduled to {pages.when(due)}")
            return
        m = _DLQ.match(path)
        if m:
            jid = unquote(m.group(1))
            due = dlq.requeue(dash.store, jid)
            self._redirect("/jobs/" + quote(jid, safe=""), f"requeued, due {pages.when(due)}")
            return
        if path == "/dlq/purge":
            older = form.get("older_than", "").strip()
            n = dlq.purge(dash.store, older_than=float(older) if older else None)
            self._redirect("/dlq", f"purged {n} dead letter(s)")
            return
        if path == "/pause":
            flags = controls.pause(app, queue=form.get("queue") or None, task=form.get("task") or None)
            self._redirect("/", f"paused {', '.join(flags)}")
            return
        if path == "/resume":
            flag = form.get("flag", "")
            scope, _, name = flag.partition(":")
            if scope == "all":
                moved = dash.store.jobs.resume(["all"])
            else:
                moved = controls.resume(app, **{scope: name}) if scope in ("task", "queue") else 0
            self._redirect("/", f"resumed {flag}: {moved} held job(s) released")
            return
        self._send(404, b"not found\n", "text/plain; charset=utf-8")


def _int(text: str) -> int:
    try:
        return max(0, int(text))
    except ValueError:
        return 0


def _cursor(text: str) -> tuple[int, str, str] | None:
    due, sep, rest = text.partition("|")
    key, sep2, jid = rest.partition("|")
    if not sep or not sep2:
        return None
    try:
        return int(due), key, jid
    except ValueError:
        return None


def _when(text: str, app: Celery) -> str:
    """A reschedule form's ``when``: seconds from now, or an ISO date (naive: the app's timezone)."""
    text = text.strip()
    try:
        return due_spec(float(text), app.timezone)
    except ValueError:
        pass
    try:
        return due_spec(datetime.fromisoformat(text), app.timezone)
    except ValueError as exc:
        raise InvalidWhen(f"when must be seconds from now or an ISO date, got {text!r}") from exc


class DashboardServer(ThreadingHTTPServer):
    """A threading HTTP server that carries the :class:`Dashboard`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        super().__init__(address, Handler)


def make_server(app: Celery, address: str = "127.0.0.1", port: int = 5566, auth: Auth | None = None,
                read_only: bool = False) -> DashboardServer:
    """Bind the dashboard (``serve_forever()`` runs it).

    Raises:
        PermissionError: a non-loopback address without credentials.
    """
    auth = auth or Auth()
    if not auth.required and not is_loopback(address):
        raise PermissionError(f"refusing to serve the dashboard on {address} without credentials: give "
                              "--basic-auth user:password or --token, or bind 127.0.0.1")
    return DashboardServer((address, port), Dashboard(app, auth, read_only))


def serve_in_thread(server: DashboardServer) -> threading.Thread:
    """Run a server in a daemon thread (tests, benchmarks)."""
    thread = threading.Thread(target=server.serve_forever, name="celery-delayed-web", daemon=True)
    thread.start()
    return thread


def new_token() -> str:
    """A random token for ``--token`` when none is given."""
    return base64.urlsafe_b64encode(os.urandom(18)).decode()
