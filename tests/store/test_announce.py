"""Jobs that end without running are reported as Celery reports them: get() returns at once."""

from __future__ import annotations

import time

import pytest
from celery.exceptions import TaskRevokedError
from support import make_app

from celery_delayed import DelayedResult, apply_later, cancel, get_store, lookup
from celery_delayed.errors import Misfired
from celery_delayed.scheduler.releaser import DirectReleaser

TASK = "t.announce"


@pytest.fixture
def bapp(redis_url, uid):  # type: ignore[no-untyped-def]
    return make_app(redis_url, uid, result_backend=redis_url)


def _release(app) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    releaser = DirectReleaser(app, get_store(app))
    not_sent = []
    try:
        for s in range(get_store(app).config.shards):
            not_sent += releaser.release(s, "", "", 500).not_sent
    finally:
        releaser.close()
    return not_sent


@pytest.mark.timeout(30)
def test_cancelled_while_scheduled_get_raises_revoked_at_once(bapp):
    h = apply_later(bapp, TASK, when=30, strict=False)
    assert h.cancel()
    t0 = time.monotonic()
    with pytest.raises(TaskRevokedError):
        h.get(timeout=4)
    assert time.monotonic() - t0 < 1.0
    assert h.state == "REVOKED"
    # by id, from another handle, and through cancel(): the same
    h2 = apply_later(bapp, TASK, when=30, strict=False)
    assert cancel(bapp, h2.id) == "SCHEDULED"
    assert DelayedResult(h2.id, app=bapp).state == "REVOKED"


@pytest.mark.timeout(30)
def test_expired_skipped_and_misfired_reach_the_backend(bapp):
    expired = apply_later(bapp, TASK, when=0, expires=0.5, strict=False)
    skipped = apply_later(bapp, TASK, when=0, max_lateness=0.2, misfire="skip", strict=False)
    dead = apply_later(bapp, TASK, when=0, max_lateness=0.2, misfire="dead", strict=False)
    time.sleep(0.8)
    not_sent = {jid: state for jid, state, _ in _release(bapp)}
    assert not_sent == {expired.id: "EXPIRED", skipped.id: "SKIPPED", dead.id: "DEAD"}
    for h in (expired, skipped):
        with pytest.raises(TaskRevokedError):
            h.get(timeout=4)
        assert h.state == "REVOKED"
    with pytest.raises(Misfired, match="misfire"):
        dead.get(timeout=4)
    assert dead.state == "FAILURE"


def test_lookup_gives_a_handle_from_an_id(bapp):
    h = apply_later(bapp, TASK, when=60, strict=False, shard_key="user-7")
    found = lookup(bapp, h.id)
    assert (found.id, found.shard, found.due_ms, found.eta, found.job_state) == (h.id, h.shard, h.due_ms, h.eta,
                                                                                  "SCHEDULED")
    bare = DelayedResult(h.id, app=bapp)  # what AsyncResult(id) users write
    assert bare.eta == h.eta and bare.job_state == "SCHEDULED"
    assert bare.cancel() and h.job_state == "CANCELLED"
