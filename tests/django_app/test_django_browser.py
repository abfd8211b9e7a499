"""The admin in a real browser: Debian's headless chromium logs in and works the pages, with screenshots.

Django's WSGI application (with the admin's static files) is served on a
free loopback port in a thread; chromium logs in through the admin's login
form, searches, filters, cancels a job from the list, opens a dead letter and
a recurring schedule. Set ``DJANGO_ADMIN_SHOTS`` to a folder to keep the
screenshots (default: the test's temporary folder).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from celery import Celery
from conftest import PASSWORD
from django.test import override_settings
from support import need
from support.browser import browser_available, chromium

from celery_delayed import DelayedTask, apply_later, controls, schedules
from celery_delayed.testing import DelayedTestKit


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def live_admin(dj: str) -> Iterator[str]:
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.core.wsgi import get_wsgi_application

    server = make_server("127.0.0.1", 0, StaticFilesHandler(get_wsgi_application()), server_class=_Server,
                         handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _jobs(app: Celery, kit: DelayedTestKit) -> dict[str, str]:
    @app.task(base=DelayedTask, name="billing.charge_card", shared=False, max_attempts=1, dlq_all_failures=True)
    def charge(order: int, amount_cents: int) -> None:
        raise RuntimeError(f"card declined: insufficient funds (order {order})")

    @app.task(base=DelayedTask, name="emails.send_digest", shared=False)
    def digest(user: int, kind: str = "weekly") -> None:
        return None

    start = datetime.now(timezone.utc)
    out = {}
    for i in range(12):
        h = apply_later(app, "shop.remind", (1000 + i,), {"channel": "sms" if i % 3 else "mail"},
                        when=start + timedelta(minutes=7 * i + 3), idempotency_key=f"order-{1000 + i}-reminder")
        out.setdefault("reminder", h.id)
    for i in range(6):
        apply_later(app, "emails.send_digest", (50 + i,), {"kind": "weekly"}, when=start + timedelta(hours=2 + i),
                    queue="emails")
    held = apply_later(app, "emails.send_digest", (7,), when=0, queue="emails")
    controls.pause(app, queue="emails")
    for i in range(2):
        apply_later(app, "billing.charge_card", (2000 + i, 4999))
    kit.run_due()
    controls.resume(app, queue="emails")
    out["held"] = held.id
    schedules.add(app, "nightly-report", "emails.send_digest", "30 2 * * mon-fri", [1], {"kind": "nightly"},
                  timezone="Europe/Berlin")
    schedules.add(app, "poll-payments", "shop.remind", 30.0, [0])
    schedules.add(app, "quarterly-cleanup", "shop.remind", "0 4 1 */3 *", [9])
    schedules.pause(app, "quarterly-cleanup")
    return out


def test_the_admin_in_chromium(admin_app: Celery, redis_url: str, live_admin: str, tmp_path: Path) -> None:
    need("Debian's chromium, chromium-driver and selenium", browser_available())
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    shots = Path(os.environ.get("DJANGO_ADMIN_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with DelayedTestKit(admin_app, redis_url) as kit, override_settings(TIME_ZONE="Europe/Berlin"), \
            chromium(1680, 1050) as drv:
        made = _jobs(admin_app, kit)

        def shot(name: str) -> None:
            height = drv.execute_script("return document.documentElement.scrollHeight")
            drv.set_window_size(1680, min(max(1050, int(height) + 140), 3000))  # the whole page
            drv.save_screenshot(str(shots / f"{name}.png"))
            drv.set_window_size(1680, 1050)

        def click(element: Any) -> None:
            """Click and wait for the next page."""
            from selenium.webdriver.support import expected_conditions
            from selenium.webdriver.support.ui import WebDriverWait

            page = drv.find_element(By.TAG_NAME, "html")
            element.click()
            WebDriverWait(drv, 10).until(expected_conditions.staleness_of(page))

        drv.get(live_admin + "/admin/login/?next=/admin/")
        drv.find_element(By.NAME, "username").send_keys("admin")
        drv.find_element(By.NAME, "password").send_keys(PASSWORD)
        click(drv.find_element(By.CSS_SELECTOR, "input[type=submit]"))
        assert "Pending jobs" in drv.find_element(By.ID, "content-main").text
        shot("01-index")

        drv.get(live_admin + "/admin/celery_delayed/pendingjob/")
        body = drv.find_element(By.ID, "changelist").text
        assert "order-1000-reminder" in body and "Held by a pause" in body
        rows = drv.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
        assert len(rows) >= 19  # and the schedules' next occurrences
        assert "CET" in body or "CEST" in body  # due times in the user's zone
        shot("02-pending-jobs")

        drv.find_element(By.ID, "searchbar").send_keys("digest")
        click(drv.find_element(By.CSS_SELECTOR, "#changelist-search input[type=submit]"))
        assert len(drv.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")) == 8  # and nightly-report's next
        shot("03-search-task")

        drv.get(live_admin + "/admin/celery_delayed/pendingjob/")
        first = drv.find_elements(By.CSS_SELECTOR, "input.action-select")[0]
        cancelled = first.get_attribute("value")
        first.click()  # (a checkbox: no new page)
        Select(drv.find_element(By.NAME, "action")).select_by_value("cancel")
        click(drv.find_element(By.CSS_SELECTOR, ".actions button"))
        assert f"Pending job {cancelled}: cancelled (it was SCHEDULED)" in \
            drv.find_element(By.CSS_SELECTOR, ".messagelist").text
        shot("04-cancelled-from-the-list")

        drv.get(live_admin + f"/admin/celery_delayed/pendingjob/{made['reminder']}/change/")
        summary = drv.find_element(By.ID, "job-summary").text
        assert "(1000,)" in summary and "order-1000-reminder" in summary and "SCHEDULED" in summary
        shot("05-job")

        drv.get(live_admin + "/admin/celery_delayed/deadletter/")
        assert "card declined" in drv.find_element(By.ID, "result_list").text
        shot("06-dead-letters")
        click(drv.find_element(By.CSS_SELECTOR, "#result_list th a"))
        assert "Last error" in drv.find_element(By.ID, "job-summary").text
        assert "RuntimeError" in drv.find_element(By.ID, "traceback").text
        shot("07-dead-letter")

        drv.get(live_admin + "/admin/celery_delayed/schedule/")
        listing = drv.find_element(By.ID, "result_list").text
        assert "nightly-report" in listing and "cron 30 2 * * mon-fri" in listing
        shot("08-schedules")
        click(drv.find_element(By.LINK_TEXT, "nightly-report"))
        assert drv.find_element(By.NAME, "timezone").get_attribute("value") == "Europe/Berlin"
        shot("09-schedule-form")
        kwargs = drv.find_element(By.NAME, "kwargs")
        kwargs.clear()
        kwargs.send_keys('{"kind": nightly}')
        click(drv.find_element(By.NAME, "_continue"))
        assert "not JSON" in drv.find_element(By.ID, "schedule_form").text
        shot("10-schedule-error")
        kwargs = drv.find_element(By.NAME, "kwargs")
        kwargs.clear()
        kwargs.send_keys('{"kind": "nightly", "full": true}')  # JSON, but not what the task takes
        click(drv.find_element(By.NAME, "_continue"))
        assert "unexpected keyword argument 'full'" in drv.find_element(By.ID, "schedule_form").text
        shot("11-schedule-signature-error")
        kwargs = drv.find_element(By.NAME, "kwargs")
        kwargs.clear()
        kwargs.send_keys('{"kind": "monthly"}')
        click(drv.find_element(By.NAME, "_continue"))
        assert "saved" in drv.find_element(By.CSS_SELECTOR, ".messagelist").text
        assert schedules.get(admin_app, "nightly-report").kwargs == {"kind": "monthly"}
        shot("12-schedule-saved")
