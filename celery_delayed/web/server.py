"""The dashboard's HTTP server: routes, authentication, CSRF, actions (standard library only).

Bound to 127.0.0.1 by default. Without credentials it serves only on a
loopback address (as Flower does), and an empty token or password counts as
none; off loopback a token must be at least :data:`MIN_TOKEN_LENGTH`
characters. With ``basic`` credentials an unauthenticated request gets 401
with ``WWW-Authenticate: Basic``; with a ``token``, a request must carry
``Authorization: Bearer <token>`` or the cookie that ``/login?token=<token>``
sets. Every action is a POST carrying the server's CSRF token (and, when the
browser sends one, an ``Origin`` of this server); ``read_only`` serves no
action at all. The outcome of an action is shown on the next page from a
cookie the server signs (never from the URL, which anyone can write). A bad
request gets a 4xx with a message that says what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
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

from .. import controls, describe, dlq
from ..cancellation import cancel_job
from ..errors import ConfigurationError, DelayedError, InvalidOption, InvalidWhen, JobNotFound, StoreUnavailable
from ..producer.prepare import job_id_for_key
from ..store import Pending, get_store
from ..store.stats import FleetStats
from ..timeutil import due_spec, from_ms
from . import pages, shaping

logger = logging.getLogger("celery_delayed.web")

_JOB = re.compile(r"^/jobs/([^/]+)(?:/(cancel|promote|reschedule))?$")
_DLQ = re.compile(r"^/dlq/([^/]+)/requeue$")
_STATIC = {"app.css": "text/css; charset=utf-8"}
_COOKIE = "cd_token"
_FLASH = "cd_flash"
#: The shortest token a dashboard bound off loopback accepts (``new_token()`` makes 24 characters).
MIN_TOKEN_LENGTH = 16
#: The largest form body an action reads, bytes.
_MAX_BODY = 65536
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
        """Whether requests must authenticate: an empty token or password counts as none."""
        return bool(self.user and self.password) or bool(self.token)


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
        self.secret = secrets.token_bytes(32)
        self.csrf = hmac.new(self.secret, b"csrf", hashlib.sha256).hexdigest()[:40]
        base = files("celery_delayed.web")
        self.layout = Template((base / "templates" / "base.html").read_text(encoding="utf-8"))
        self.static = {name: (base / "static" / name).read_bytes() for name in _STATIC}


class BadRequest(Exception):
    """A request the dashboard cannot act on: answered 400 (or ``status``) with this message."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


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
        headers = {"Location": location}
        if flash:
            headers["Set-Cookie"] = self._flash_cookie(flash, error)
        self._send(HTTPStatus.SEE_OTHER, b"", headers=headers)

    def _problem(self, status: int, text: str, t0: float) -> None:
        """A 4xx (or 5xx) answer that says what was wrong: a page for a browser, a line for a script."""
        if "text/html" in self.headers.get("Accept", ""):
            self._page(HTTPStatus(status).phrase, pages.message(text), "", t0, status)
        else:
            self._send(status, (text + "\n").encode("utf-8"), "text/plain; charset=utf-8")

    # -- the outcome of an action, shown once on the next page -----------------------

    def _sign(self, data: str) -> str:
        return hmac.new(self.dash.secret, data.encode("ascii"), hashlib.sha256).hexdigest()[:32]

    def _flash_cookie(self, text: str, error: bool) -> str:
        data = base64.urlsafe_b64encode((("e" if error else "o") + text[:600]).encode("utf-8")).decode().rstrip("=")
        return f"{_FLASH}={data}.{self._sign(data)}; HttpOnly; SameSite=Strict; Path=/; Max-Age=120"

    def _take_flash(self) -> tuple[str, str | None]:
        """(the flash's HTML, the header that clears its cookie): only a cookie this server signed shows."""
        morsel = SimpleCookie(self.headers.get("Cookie", "")).get(_FLASH)
        if morsel is None:
            return "", None
        clear = f"{_FLASH}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"
        data, _, sig = morsel.value.partition(".")
        if not hmac.compare_digest(sig.encode(), self._sign(data).encode()):
            return "", clear
        try:
            text = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return "", clear
        cls = "flash error" if text[:1] == "e" else "flash"
        return f'<p class="{cls}" id="flash">{pages.e(text[1:])}</p>', clear

    def _page(self, title: str, body: str, nav: str, t0: float, status: int = 200, search: str = "") -> None:
        flash, clear = self._take_flash()
        cfg = self.dash.store.config
        html = self.dash.layout.substitute(
            title=pages.e(title), body=body, flash=flash, search=pages.e(search),
            nav_overview=' class="current"' if nav == "overview" else "",
            nav_jobs=' class="current"' if nav == "jobs" else "", nav_dlq=' class="current"' if nav == "dlq" else "",
            nav_schedules=' class="current"' if nav == "schedules" else "",
            store=pages.e(f"prefix {cfg.key_prefix} · {self.dash.store.layout.shards} shards"),
            mode=" · read-only" if self.dash.read_only else "",
            render_ms=f"{(time.perf_counter() - t0) * 1000:.0f}",
            now=pages.e(describe.when(self.dash.store.redis.now_ms())),
        )
        self._send(status, html.encode("utf-8"), headers={"Set-Cookie": clear} if clear else None)

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
                user, _, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError, ValueError):
                return False
            return hmac.compare_digest(user.encode(), auth.user.encode()) and \
                hmac.compare_digest(password.encode(), (auth.password or "").encode())
        token = (auth.token or "").encode()
        if header.startswith("Bearer "):
            given = header[7:].strip().encode()
            return bool(given) and hmac.compare_digest(given, token)
        got = SimpleCookie(self.headers.get("Cookie", "")).get(_COOKIE)
        return got is not None and bool(got.value) and hmac.compare_digest(got.value.encode(), token)

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
        if not token or not given or not hmac.compare_digest(given.encode(), token.encode()):
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
        self._answer(lambda: self._get(path, query, t0), t0)

    def _answer(self, act: Callable[[], None], t0: float) -> None:
        """Run a route; a bad request gets its 4xx, an error of the store a page that says so, never a dropped
        connection."""
        try:
            act()
        except BadRequest as exc:
            self._problem(exc.status, str(exc), t0)
        except JobNotFound as exc:
            self._problem(HTTPStatus.NOT_FOUND, str(exc), t0)
        except (InvalidOption, InvalidWhen) as exc:
            self._problem(HTTPStatus.BAD_REQUEST, str(exc), t0)
        except DelayedError as exc:
            self._problem(HTTPStatus.SERVICE_UNAVAILABLE if isinstance(exc, StoreUnavailable)
                          else HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), t0)
        except Exception:
            logger.exception("dashboard: %s %s failed", self.command, urlsplit(self.path).path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error: the dashboard's log has the traceback\n",
                       "text/plain; charset=utf-8")

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
            span = "day" if _one(query, "span") == "day" else "hour"
            stats = FleetStats(dash.store)
            snap = stats.snapshot()
            step = 60_000 if span == "hour" else 1_800_000
            steps = 60 if span == "hour" else 48
            due = stats.coming_due(snap.now_ms, step, steps)
            labels = [from_ms(snap.now_ms + i * step).strftime("%H:%M") for i in range(steps)]
            panels = shaping.panels(controls.limits(dash.app), controls.tenants(dash.app), dash.csrf, dash.read_only)
            body = pages.overview(snap, due, labels, span, dash.csrf, dash.read_only, panels)
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
            offset = _offset(_one(query, "offset"))
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
        search = _one(query, "q").strip()
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
        task = _one(query, "task") or None
        queue = _one(query, "queue") or None
        after = _cursor(_one(query, "after"))
        pending = Pending(store)
        rows, nxt = pending.window(after, 50, task=task, queue=queue)
        base = {k: v for k, v in (("task", task), ("queue", queue)) if v}
        next_link = "/jobs?" + urlencode({**base, "after": f"{nxt[0]}|{nxt[1]}|{nxt[2]}"}) if nxt else None
        first_link = "/jobs?" + urlencode(base) if after else None
        body = pages.pending(rows, pending.count(task, queue), store.redis.now_ms(), task, queue, next_link,
                             first_link, note)
        self._page("Pending jobs", body, "jobs", t0, search=search)

    # -- POST (actions) -------------------------------------------------------------

    def do_POST(self) -> None:
        t0 = time.perf_counter()
        if not self._authorized():
            self._challenge()
            return
        if self.dash.read_only:
            self._send(HTTPStatus.FORBIDDEN, b"read-only dashboard: it serves no action\n",
                       "text/plain; charset=utf-8")
            return
        try:
            length = int(self.headers.get("Content-Length") or "0")
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_BODY:
            self.close_connection = True  # the body is not kept: the connection cannot be reused
            status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length > _MAX_BODY else HTTPStatus.BAD_REQUEST
            left = length if length <= 16 * _MAX_BODY else 0
            while left > 0:  # read a large body away (up to a bound), so that the client reads the answer
                left -= len(self.rfile.read(min(left, _MAX_BODY)) or b"x" * left)
            self._problem(status, f"an action's form must have a Content-Length of at most {_MAX_BODY} bytes", t0)
            return
        form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode("utf-8", "replace")).items()}
        if not self._same_origin() or not hmac.compare_digest(form.get("csrf", "").encode(), self.dash.csrf.encode()):
            self._send(HTTPStatus.FORBIDDEN, b"CSRF check failed: reload the page and try again\n",
                       "text/plain; charset=utf-8")
            return
        path = urlsplit(self.path).path
        self._answer(lambda: self._act(path, form, t0), t0)

    def _act(self, path: str, form: dict[str, str], t0: float) -> None:
        try:
            self._post(path, form, t0)
        except (JobNotFound, BadRequest, InvalidOption):
            raise
        except DelayedError as exc:  # the job's state does not allow it, a bad date ...: back, saying why
            if isinstance(exc, StoreUnavailable):
                raise
            back = urlsplit(self.headers.get("Referer") or "/").path or "/"
            self._redirect(back if back.startswith("/") and not back.startswith("//") else "/", str(exc), error=True)

    def _same_origin(self) -> bool:
        if self.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            return False
        origin = self.headers.get("Origin")
        if origin is None or origin == "null":
            return origin is None
        return urlsplit(origin).netloc == self.headers.get("Host", "")

    def _post(self, path: str, form: dict[str, str], t0: float) -> None:
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
                self._redirect(here, f"rescheduled to {describe.when(due)}")
            return
        m = _DLQ.match(path)
        if m:
            jid = unquote(m.group(1))
            due = dlq.requeue(dash.store, jid)
            self._redirect("/jobs/" + quote(jid, safe=""), f"requeued, due {describe.when(due)}")
            return
        if path == "/dlq/purge":
            older = _seconds(form.get("older_than", ""), "older_than")
            if older is None and form.get("confirm") != "all":  # everything: ask first, as the CLI does
                self._page("Purge every dead letter?", pages.purge_confirm(dlq.count(dash.store), dash.csrf),
                           "dlq", t0)
                return
            n = dlq.purge(dash.store, older_than=older)
            self._redirect("/dlq", f"purged {n} dead letter(s)")
            return
        if path == "/pause":
            flags = controls.pause(app, queue=form.get("queue") or None, task=form.get("task") or None)
            self._redirect("/", f"paused {', '.join(flags)}")
            return
        if path == "/resume":
            flag = form.get("flag", "")
            scope, _, name = flag.partition(":")
            if flag == "all":
                moved = dash.store.jobs.resume(["all"])
            elif scope in ("task", "queue") and name:
                moved = controls.resume(app, **{scope: name})
            else:
                raise BadRequest(f"resume takes flag=all, task:<name> or queue:<name>, got {flag!r}")
            self._redirect("/", f"resumed {flag}: {moved} held job(s) released")
            return
        if path == "/limits":
            self._limit(form)
            return
        self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _limit(self, form: dict[str, str]) -> None:
        """Set, lift or reset a rate limit (as ``delayed limits set | lift | reset``); a bad key or rate: 400."""
        op, key, rate = form.get("op", ""), form.get("key", "").strip(), form.get("rate", "").strip()
        if op not in ("set", "lift", "reset"):
            raise BadRequest(f"a limit's op is set, lift or reset, got {op!r}")
        if op == "set" and not rate:
            raise BadRequest(f"give a rate to set the limit of {key!r} to (100/s, 10/m, 1000/h), or lift it")
        try:
            controls.set_limit(self.dash.app, key, rate if op == "set" else 0 if op == "lift" else None)
        except ConfigurationError as exc:
            raise BadRequest(str(exc)) from exc
        done = {"set": f"limited to {rate}", "lift": "lifted until reset", "reset": "back to the app's setting"}
        self._redirect("/", f"{key}: {done[op]} (the schedulers apply it on their next release)")


def _one(query: dict[str, list[str]], name: str) -> str:
    """A query parameter's first value, or ''."""
    return (query.get(name) or [""])[0]


def _offset(text: str) -> int:
    """A page offset: '' is 0; anything but a whole number >= 0 is a bad request."""
    if not text:
        return 0
    if not text.isdigit():
        raise BadRequest(f"offset must be a whole number >= 0, got {text!r}")
    return int(text)


def _seconds(text: str, name: str) -> float | None:
    """A form's number of seconds (>= 0, finite), or None when left empty."""
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise BadRequest(f"{name} must be a number of seconds >= 0 (or empty), got {text!r}")
    return value


def _cursor(text: str) -> tuple[int, int, str] | None:
    """The pending page's cursor ``<due ms>|<shard>|<job id>`` ('' : the first page); anything else is a bad
    request. It names no Redis key: the store finds the job's set among the shard's own."""
    if not text:
        return None
    due, sep, rest = text.partition("|")
    shard, sep2, jid = rest.partition("|")
    if not sep or not sep2 or not jid or not due.lstrip("-").isdigit() or not shard.isdigit():
        raise BadRequest("bad cursor: 'after' is '<due ms>|<shard>|<job id>' as the 'next page' link gives it; "
                         "open /jobs for the first page")
    return int(due), int(shard), jid


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
        PermissionError: a non-loopback address without credentials (an empty token or password counts
            as none), or with a token shorter than :data:`MIN_TOKEN_LENGTH` characters.
    """
    auth = auth or Auth()
    if not is_loopback(address):
        if not auth.required:
            empty = " (an empty token or password counts as none)" if auth.token == "" or auth.user else ""
            raise PermissionError(f"refusing to serve the dashboard on {address} without credentials{empty}: "
                                  "give --basic-auth user:password or --token, or bind 127.0.0.1")
        if auth.token and len(auth.token) < MIN_TOKEN_LENGTH:
            raise PermissionError(f"refusing to serve the dashboard on {address} with a token of {len(auth.token)} "
                                  f"characters: give one of at least {MIN_TOKEN_LENGTH} (for instance "
                                  "python -c 'import secrets; print(secrets.token_urlsafe(24))'), or bind 127.0.0.1")
        if auth.password and len(auth.password) < MIN_TOKEN_LENGTH:
            logger.warning("the dashboard on %s takes a basic-auth password of %d characters: anyone who can reach "
                           "it may guess it; give one of at least %d", address, len(auth.password), MIN_TOKEN_LENGTH)
    return DashboardServer((address, port), Dashboard(app, auth, read_only))


def serve_in_thread(server: DashboardServer) -> threading.Thread:
    """Run a server in a daemon thread (tests, benchmarks)."""
    thread = threading.Thread(target=server.serve_forever, name="celery-delayed-web", daemon=True)
    thread.start()
    return thread


def new_token() -> str:
    """A random token for ``--token`` when none is given."""
    return base64.urlsafe_b64encode(os.urandom(18)).decode()
