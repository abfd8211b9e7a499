"""Recurring schedules on the real store, with a fake clock: occurrences, cursor, misfire, changes, DST."""

from __future__ import annotations

from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab
from support import make_app

from celery_delayed import get_store
from celery_delayed import schedules as api
from celery_delayed.errors import InvalidOption, ScheduleNotFound, UnknownTask
from celery_delayed.schedules.definition import definition
from celery_delayed.schedules.keeper import Recurrer
from celery_delayed.schedules.occurrences import occurrence_id, plan

pytestmark = pytest.mark.timeout(60)

T0 = 1_800_000_000_000  # a round epoch ms (2027-01-15)


@pytest.fixture
def app(redis_url, uid):
    return make_app(redis_url, uid, delayed_shards=4, delayed_lookahead_ms=0)


def recurrer(app, owner=""):
    store = get_store(app)
    return Recurrer(app, store, owner, lambda: dict.fromkeys(range(store.config.shards), ""))


def release(app, now_ms):
    """Release every due job of every shard at ``now_ms``; return (released ids, skipped ids)."""
    store = get_store(app)
    sent, skipped = [], []
    for s in range(store.config.shards):
        b = store.release.release_due(s, now_ms=now_ms)
        sent += b.ids
        skipped += [i for i, _, _ in b.not_sent]
    return sent, skipped


def put(app, name, entry, now_ms=T0):
    rec = get_store(app).schedules
    rec.put_schedule(name, definition(app, name, entry), "api", now_ms=now_ms)
    return rec.get(name)


def test_occurrences_are_stored_ahead_released_once_and_chained(app):
    s = put(app, "tick", {"task": "e2e.mark", "schedule": 10})
    r1, r2 = recurrer(app), recurrer(app)
    assert r1.tick(now_ms=T0) == 1  # the first fire past the horizon: T0 + 10 s
    assert r2.tick(now_ms=T0) == 0  # another scheduler changes nothing
    occ = get_store(app).schedules.occurrences("tick")
    assert occ == [(occurrence_id(s, T0 + 10_000), T0 + 10_000)]
    ran = []
    for k in range(1, 6):
        now = T0 + k * 10_000
        r1.tick(now_ms=now - 2_000)  # within the horizon: the next one is stored before this one goes
        r2.tick(now_ms=now - 2_000)
        assert get_store(app).schedules.occurrences("tick")[-1][1] == now + 10_000
        sent, skipped = release(app, now)
        assert skipped == []
        ran += sent
    assert ran == [occurrence_id(s, T0 + k * 10_000) for k in range(1, 6)]
    assert get_store(app).schedules.get("tick").last_ms == T0 + 60_000


def test_two_recurrers_on_the_same_cursor_store_one_set_of_jobs(app):
    put(app, "dup", {"task": "e2e.mark", "schedule": 1})
    r1, r2 = recurrer(app), recurrer(app)
    s = get_store(app).schedules.get("dup")
    f1, f2 = plan(s, T0, r1.horizon_ms, 1), plan(s, T0, r2.horizon_ms, 1)
    assert f1 == f2
    # both store (a lost race): the ids are derived, the second finds them; only one cursor move wins
    n1 = r1._advance(s, "", T0)
    n2 = r2._advance(s, "", T0)  # its cursor move fails; it cancels nothing (the same ids)
    assert n1 == len(f1[0]) and n2 == 0
    assert {get_store(app).lookup.get(i)["st"] for i, _ in get_store(app).schedules.occurrences("dup")} == {"SCHEDULED"}
    store = get_store(app)
    assert sum(store.redis.client.zcard(store.keys.shard(x).due) for x in range(4)) == len(f1[0])


def test_occurrences_stored_for_a_schedule_removed_meanwhile_never_run_even_once_released(app, monkeypatch):
    """A keeper read the schedule, it was removed, then the keeper stored its occurrences: its cursor move
    fails and it cancels them, though the release loop released the first one in between (the real
    release script runs between the keeper's store and its cursor move)."""
    put(app, "gone", {"task": "e2e.mark", "schedule": 10})
    stale = get_store(app).schedules.get("gone")
    api.remove(app, "gone")
    rec = get_store(app).schedules
    advance = rec.advance_schedule

    def released_first(*args, **kwargs):
        assert release(app, T0 + 10_000)[0] == [occurrence_id(stale, T0 + 10_000)]
        return advance(*args, **kwargs)

    monkeypatch.setattr(rec, "advance_schedule", released_first)
    assert recurrer(app)._advance(stale, "", T0 + 9_000) == 0
    states = get_store(app).lookup.record_states(stale.shard, [occurrence_id(stale, T0 + k * 10_000) for k in (1, 2)])
    assert list(states.values()) == ["CANCELLED", "CANCELLED"]


def test_after_an_outage_the_latest_missed_occurrence_runs_once(app):
    put(app, "late", {"task": "e2e.mark", "schedule": 10})
    r = recurrer(app)
    r.tick(now_ms=T0)  # stores T0 + 10 s
    now = T0 + 10_000 + 95_000  # down for 9.5 periods
    sent, skipped = release(app, now)
    assert sent == [] and len(skipped) == 1  # the stored one missed the next fire time: skipped
    r.tick(now_ms=now)
    sent, skipped = release(app, now)
    s = get_store(app).schedules.get("late")
    assert sent == [occurrence_id(s, T0 + 100_000)]  # the latest, once
    assert get_store(app).schedules.get("late").last_ms > now


def test_the_caught_up_occurrence_runs_though_its_release_comes_just_after_the_next_fire_time(app):
    put(app, "late", {"task": "e2e.mark", "schedule": 10})
    r = recurrer(app)
    r.tick(now_ms=T0)
    now = T0 + 109_500  # back 0.5 s before the next fire time: the latest missed one is T0 + 100 s
    r.tick(now_ms=now)
    s = get_store(app).schedules.get("late")
    sent, _ = release(app, now + 600)  # released a moment later: past T0 + 110 s
    assert occurrence_id(s, T0 + 100_000) in sent  # not skipped: it has a grace from when it was stored
    assert occurrence_id(s, T0 + 110_000) in sent  # and the next one runs on time


def test_misfire_each_runs_every_missed_occurrence_capped(app):
    app.conf.delayed_schedule_catch_up_max = 5
    put(app, "each", {"task": "e2e.mark", "schedule": 10, "misfire": "each"})
    r = recurrer(app)
    r.tick(now_ms=T0)
    now = T0 + 10_000 + 95_000
    r.tick(now_ms=now)
    sent, skipped = release(app, now)
    s = get_store(app).schedules.get("each")
    # the one stored before the outage, then the latest five missed
    want = [T0 + 10_000] + [T0 + k * 10_000 for k in range(6, 11)]
    assert sorted(sent) == sorted(occurrence_id(s, f) for f in want) and skipped == []


def test_misfire_skip_runs_none_of_the_missed(app):
    put(app, "skip", {"task": "e2e.mark", "schedule": 10, "misfire": "skip"})
    r = recurrer(app)
    r.tick(now_ms=T0)
    now = T0 + 10_000 + 95_000
    r.tick(now_ms=now)
    sent, skipped = release(app, now)
    assert sent == [] and len(skipped) == 1


def test_config_sync_change_and_removal_take_effect_and_runtime_changes_win(app):
    app.conf.delayed_schedule = {"cfg": {"task": "e2e.mark", "schedule": 60, "args": [1]}}
    r = recurrer(app)
    r.tick()
    s1 = get_store(app).schedules.get("cfg")
    assert s1.source == "config" and s1.definition["args"] == [1]
    assert len(get_store(app).schedules.occurrences("cfg")) == 1
    old_id = get_store(app).schedules.occurrences("cfg")[0][0]
    # a run-time change wins over an unchanged config
    api.add(app, "cfg", "e2e.mark", 60, args=[2], strict=False)
    store = get_store(app)
    assert store.lookup.get(old_id)["st"] == "CANCELLED"
    r.sync_config(full=True)
    assert get_store(app).schedules.get("cfg").definition["args"] == [2]
    # until the config entry itself changes
    app.conf.delayed_schedule = {"cfg": {"task": "e2e.mark", "schedule": 60, "args": [3]}}
    r._next_sync = 0.0
    r.tick()
    s3 = get_store(app).schedules.get("cfg")
    assert s3.definition["args"] == [3] and s3.version > s1.version and s3.source == "config"
    # removed from the config: removed, its pending occurrence cancelled
    pending = [i for i, _ in get_store(app).schedules.occurrences("cfg")]
    app.conf.delayed_schedule = {}
    r._next_sync = 0.0
    r.tick()
    assert get_store(app).schedules.get("cfg") is None
    assert {store.lookup.get(i)["st"] for i in pending} == {"CANCELLED"}
    # one added at run time is not the config's to remove
    api.add(app, "mine", "e2e.mark", 60, strict=False)
    r._next_sync = 0.0
    r.tick()
    assert get_store(app).schedules.get("mine") is not None


def test_api_list_get_pause_resume_remove_run_now(app):
    api.add(app, "a", "e2e.mark", crontab(minute="*/5"), timezone="Europe/Berlin", strict=False)
    api.add(app, "b", "e2e.mark", 30, args=["x"], strict=False)
    recurrer(app).tick()
    listed = api.list(app)
    assert [s.name for s in listed] == ["a", "b"]
    a = api.get(app, "a")
    assert a.schedule == "cron */5 * * * *" and a.timezone == "Europe/Berlin" and a.next_fire_ms is not None
    pending = [i for i, _ in api.get(app, "b").occurrences]
    assert pending  # stored by the tick
    assert api.pause(app, "b") is True and api.pause(app, "b") is False
    store = get_store(app)
    assert [store.lookup.get(i)["st"] for i in pending] == ["CANCELLED"] * len(pending)
    assert api.get(app, "b").occurrences == []
    assert recurrer(app).tick() == 0  # paused: nothing stored
    assert api.resume(app, "b") is True  # stores its next occurrence itself
    assert [f > store.redis.now_ms() for _, f in api.get(app, "b").occurrences] == [True]
    assert recurrer(app).tick() == 0
    h = api.run_now(app, "b")
    assert store.lookup.get(h.id)["st"] == "SCHEDULED" and h.shard == get_store(app).schedules.shard_of("b")
    assert api.remove(app, "b") == 1
    with pytest.raises(ScheduleNotFound):
        api.get(app, "b")
    with pytest.raises(ScheduleNotFound):
        api.remove(app, "b")
    # added again: a new epoch, so its occurrences never meet the old ones' records
    again = api.add(app, "b", "e2e.mark", 30, args=["x"], strict=False)
    assert [store.lookup.get(i)["st"] for i, _ in again.occurrences] == ["SCHEDULED"]


def test_bad_entries_are_refused_and_store_nothing(app):
    for entry, match in [({"schedule": 5}, "task"), ({"task": "e2e.mark"}, "schedule"),
                         ({"task": "e2e.mark", "schedule": 5, "timezone": "Nowhere/X"}, "time zone"),
                         ({"task": "e2e.mark", "schedule": 5, "timezone": ""}, "timezone must be an IANA name"),
                         ({"task": "e2e.mark", "schedule": 5, "timezone": 7}, "timezone must be an IANA name"),
                         ({"task": "e2e.mark", "schedule": 1e12}, "interval must be between"),
                         ({"task": "e2e.mark", "schedule": float("inf")}, "interval must be between"),
                         ({"task": "e2e.mark", "schedule": 5, "misfire": "sometimes"}, "misfire"),
                         ({"task": "e2e.mark", "schedule": 5, "args": [object()]}, "JSON"),
                         ({"task": "e2e.mark", "schedule": 5, "color": "red"}, "unknown key"),
                         ({"task": "e2e.mark", "schedule": 5, "options": {"priority": "high"}}, "priority"),
                         ({"task": "e2e.mark", "schedule": 5, "options": {"expires": -5}}, "expires")]:
        with pytest.raises(InvalidOption, match=match):
            definition(app, "bad", entry)
    app.conf.delayed_schedule = {"bad": {"task": "e2e.mark", "schedule": -1}}
    recurrer(app).tick()
    assert api.list(app) == []
    with pytest.raises(InvalidOption, match="interval must be between"):
        api.add(app, "huge", "e2e.mark", 1e12, strict=False)
    with pytest.raises(UnknownTask, match=r"schedule 'b17': no task named 'no\.such\.task'.*strict=False"):
        api.add(app, "b17", "no.such.task", 5)
    assert api.list(app) == []


def test_beat_schedule_is_imported_when_asked(app):
    app.conf.beat_schedule = {"beat-one": {"task": "e2e.mark", "schedule": 15.0, "relative": False}}
    recurrer(app).tick()
    assert api.list(app) == []
    app.conf.delayed_import_beat_schedule = True
    r = recurrer(app)
    r.tick()
    assert [s.name for s in api.list(app)] == ["beat-one"]


def test_a_cron_occurrence_is_stored_at_the_dst_jump(app):
    # 29 March 2026, Europe/Berlin: 02:30 does not exist; it fires at the jump (01:00 UTC)
    before = int(datetime(2026, 3, 28, 23, 0, tzinfo=timezone.utc).timestamp() * 1000)
    put(app, "berlin", {"task": "e2e.mark", "schedule": crontab(minute=30, hour=2), "timezone": "Europe/Berlin"},
        now_ms=before)
    recurrer(app).tick(now_ms=before)
    [(job_id, fire)] = get_store(app).schedules.occurrences("berlin")
    assert fire == int(datetime(2026, 3, 29, 1, 0, tzinfo=timezone.utc).timestamp() * 1000)
    assert int(float(get_store(app).lookup.get(job_id)["due"])) == fire


def test_skip_if_running_skips_an_occurrence_while_the_previous_one_has_not_finished(app):
    put(app, "slow", {"task": "e2e.mark", "schedule": 10, "skip_if_running": True})
    store = get_store(app)
    r = recurrer(app)
    s = get_store(app).schedules.get("slow")
    first, second, third = (occurrence_id(s, T0 + k * 10_000) for k in (1, 2, 3))
    r.tick(now_ms=T0)
    assert release(app, T0 + 10_000)[0] == [first]
    shard = get_store(app).schedules.shard_of("slow")
    assert store.executions.start(first, shard, "w1", now_ms=T0 + 10_010).code == 1  # running
    r.tick(now_ms=T0 + 19_500)  # the second is about to be released: the first still runs
    assert store.lookup.get(second)["st"] == "CANCELLED"
    assert release(app, T0 + 20_000)[0] == []
    r.tick(now_ms=T0 + 29_500)  # the first still runs: the third is skipped too (not only the second's overlap)
    assert store.lookup.get(third)["st"] == "CANCELLED"
    store.executions.finish(first, shard, "w1", "SUCCEEDED", now_ms=T0 + 35_000)
    fourth = occurrence_id(s, T0 + 40_000)
    r.tick(now_ms=T0 + 39_500)
    assert store.lookup.get(fourth)["st"] == "SCHEDULED"  # nothing earlier runs any more
    assert release(app, T0 + 40_000)[0] == [fourth]


@pytest.mark.parametrize(("zone_name", "day", "hours"), [
    # (from 00:00:30 to 23:59 local: 01:00 .. 23:00)
    # fall back: 01:xx happens twice; each wall hour runs once (23 runs in 24 hours)
    ("America/New_York", "2026-11-01", 23),
    # spring forward: 02:00 does not exist and runs at the jump, which is 03:00: one run (22 runs)
    ("Europe/Berlin", "2026-03-29", 22),
    # Lord Howe's half-hour fall back: 01:30-02:00 happens twice; 02:00 runs once
    ("Australia/Lord_Howe", "2026-04-05", 23),
])
def test_an_hourly_cron_through_a_dst_day_on_a_fake_clock(app, zone_name, day, hours):
    from zoneinfo import ZoneInfo

    tz = ZoneInfo(zone_name)
    start = int(datetime.fromisoformat(f"{day}T00:00:30").replace(tzinfo=tz).timestamp() * 1000)
    end = int(datetime.fromisoformat(f"{day}T23:59:00").replace(tzinfo=tz).timestamp() * 1000)
    put(app, "hourly", {"task": "e2e.mark", "schedule": crontab(minute=0), "timezone": zone_name}, now_ms=start)
    r = recurrer(app)
    ran = []
    for now in range(start, end, 60_000):  # a scheduler ticking and releasing every minute of the day
        r.tick(now_ms=now)
        sent, skipped = release(app, now)
        assert skipped == []
        ran += sent
    fires = dict(get_store(app).schedules.occurrences("hourly"))
    walls = [datetime.fromtimestamp(fires[i] / 1000, tz).strftime("%H:%M") for i in ran]
    assert len(ran) == len(set(ran)) == hours, walls
    assert walls == sorted(set(walls)), walls  # every wall hour once, in order


def test_occurrences_are_rows_first_with_a_database(redis_url, uid, database_url):
    from celery_delayed.sql.rows import get_rows

    dapp = make_app(redis_url, uid, delayed_shards=4, delayed_lookahead_ms=0, delayed_database_url=database_url)
    rows = get_rows(dapp)
    assert rows is not None
    rows.init_schema()
    try:
        put(dapp, "db", {"task": "e2e.mark", "schedule": 10})
        recurrer(dapp).tick(now_ms=T0)
        [(job_id, fire)] = get_store(dapp).schedules.occurrences("db")
        row = rows.get(job_id)
        assert row is not None and int(row.due_ms) == fire
    finally:
        rows.dispose()


def test_names_are_data_never_code_and_keep_to_their_shard(app):
    for name in ["'; redis.call('FLUSHALL') --", "{0}:{1} %s %d", "a]]..[[b", "ünï 🚀"]:
        put(app, name, {"task": "e2e.mark", "schedule": 60})
        recurrer(app).tick(now_ms=T0)
        s = get_store(app).schedules.get(name)
        assert s is not None and s.name == name and s.shard == get_store(app).schedules.shard_of(name)
        [(job_id, _)] = get_store(app).schedules.occurrences(name)
        assert get_store(app).layout.shard_of(job_id, name) == s.shard  # the occurrence is in the schedule's shard
        assert api.remove(app, name) == 1
    for bad in ["", " ", "tab\there", "\u202e", "x" * 300]:
        with pytest.raises(InvalidOption):
            definition(app, bad, {"task": "e2e.mark", "schedule": 60})


def test_during_a_rolling_deploy_an_old_scheduler_never_undoes_the_new_config(redis_url, uid):
    old_app = make_app(redis_url, uid, delayed_shards=4,
                       delayed_schedule={"a": {"task": "e2e.mark", "schedule": 60, "args": ["old"]},
                                         "gone": {"task": "e2e.mark", "schedule": 60}})
    new_app = make_app(redis_url, uid, delayed_shards=4,
                       delayed_schedule={"a": {"task": "e2e.mark", "schedule": 60, "args": ["new"]},
                                         "added": {"task": "e2e.mark", "schedule": 60}})
    old = recurrer(old_app)
    old.tick()
    assert get_store(old_app).schedules.get("a").definition["args"] == ["old"]
    new = recurrer(new_app)  # started later
    new.tick()
    rec = get_store(new_app).schedules
    assert rec.get("a").definition["args"] == ["new"] and rec.get("added") and rec.get("gone") is None
    old.sync_config(full=True)  # the old one syncs in full again: it writes nothing back
    assert rec.get("a").definition["args"] == ["new"] and rec.get("added") and rec.get("gone") is None
    restarted = recurrer(old_app)  # a scheduler started now with the old config (a rollback) wins
    restarted.tick()
    assert rec.get("a").definition["args"] == ["old"] and rec.get("added") is None and rec.get("gone")


def test_a_scheduler_with_a_bad_entry_refuses_to_start_with_its_message(redis_url, uid):
    from celery_delayed.errors import ConfigurationError
    from celery_delayed.scheduler import Scheduler

    bad = make_app(redis_url, uid, delayed_schedule={"nightly": {"task": "e2e.mark", "schedule": "61 * * * *"}})
    sched = Scheduler(bad)
    try:
        with pytest.raises(ConfigurationError, match=r"delayed_schedule: schedule 'nightly': bad crontab"):
            sched.preflight()
    finally:
        sched.releaser.close()
        sched.store.redis.close()


def test_the_testing_kit_runs_recurring_schedules_by_its_clock(redis_url):
    from celery import Celery

    from celery_delayed.testing import DelayedTestKit

    kapp = Celery("kitrec", broker="memory://", set_as_current=False)
    calls = []

    @kapp.task(name="kitrec.report", shared=False)
    def report(kind: str) -> str:
        calls.append(kind)
        return kind

    kapp.conf.delayed_schedule = {"nightly": {"task": "kitrec.report", "schedule": crontab(minute=30, hour=2),
                                              "args": ["nightly"], "timezone": "Europe/Berlin"}}
    # 27 March 2026, noon in Berlin: the night of the 29th has no 02:30 (it runs at the jump, 03:00)
    with DelayedTestKit(kapp, redis_url, start=datetime(2026, 3, 27, 11, 0, tzinfo=timezone.utc)) as kit:
        ran = []
        for _ in range(4 * 24 * 4):  # four days, every quarter hour
            ran += [(kit.clock.now().astimezone(ZoneInfo("Europe/Berlin")).strftime("%d %H:%M"), r.result)
                    for r in kit.run_due()]
            kit.clock.advance(minutes=15)
        assert ran == [("28 02:30", "nightly"), ("29 03:00", "nightly"), ("30 02:30", "nightly"),
                       ("31 02:30", "nightly")]
        schedules_now = api.list(kapp)
        assert [s.name for s in schedules_now] == ["nightly"] and schedules_now[0].source == "config"


def test_a_broken_stored_schedule_is_listed_as_broken_skipped_once_logged_and_breaks_no_other(app, caplog):
    """Records a check refuses now, written into the store directly: one an older version accepted (an interval
    of 1e12 s, whose fire times are no dates), and one that is not even JSON."""
    rec = get_store(app).schedules
    put(app, "good", {"task": "e2e.mark", "schedule": 10})
    huge = definition(app, "huge", {"task": "e2e.mark", "schedule": 10}) | {"spec": {"every_ms": 10**15}}
    rec.put_schedule("huge", huge, "api", now_ms=T0)
    rec.put_schedule("mangled", definition(app, "mangled", {"task": "e2e.mark", "schedule": 10}), "api", now_ms=T0)
    shard = rec.shard_of("mangled")
    get_store(app).redis.client.hset(get_store(app).keys.shard(shard).schedule("mangled"), "def", "{not json")
    # and one whose fire times compute but whose occurrences cannot be made (found when storing them)
    badopts = definition(app, "badopts", {"task": "e2e.mark", "schedule": 10}) | {"options": {"priority": "high"}}
    rec.put_schedule("badopts", badopts, "api", now_ms=T0)
    # the listing shows every schedule, the broken ones saying what is wrong
    listed = {s.name: s for s in api.list(app)}
    assert sorted(listed) == ["badopts", "good", "huge", "mangled"]
    assert listed["good"].error == "" and listed["good"].next_fire_ms is not None
    assert listed["huge"].error.startswith("broken: an interval must be between 0.1 s and 10,000,000,000 s")
    assert listed["huge"].next_fire_ms is None and listed["huge"].task == "e2e.mark"
    assert listed["mangled"].error.startswith("broken: its record cannot be read")
    assert api.get(app, "huge").error == listed["huge"].error
    # the keeper stores the good one's occurrences and skips the broken ones, one ERROR line each
    r = recurrer(app)
    caplog.set_level("INFO", logger="celery_delayed.scheduler")
    for k in range(3):
        r.tick(now_ms=T0 + k * 1_000)
    assert [f for _, f in rec.occurrences("good")] == [T0 + 10_000]
    assert rec.occurrences("huge") == rec.occurrences("mangled") == rec.occurrences("badopts") == []
    errors = [x for x in caplog.records if x.levelname == "ERROR"]
    assert sorted(x.args[0] for x in errors) == ["badopts", "huge", "mangled"], [x.getMessage() for x in errors]
    assert [x.exc_info is None for x in sorted(errors, key=lambda x: x.args[0])] == [False, True, True]
    assert "InvalidOption: priority" in next(x.getMessage() for x in errors if x.args[0] == "badopts")
    assert "is broken and skipped: an interval must be between" in next(
        x.getMessage() for x in errors if x.args[0] == "huge")
    # what needs its definition refuses clearly; a fix (added again) or a removal works
    with pytest.raises(InvalidOption, match="'huge' is broken: an interval"):
        api.run_now(app, "huge")
    assert api.resume(app, "huge") is False  # not paused; nothing stored for it
    api.add(app, "huge", "e2e.mark", 60, strict=False)
    fixed = api.get(app, "huge")
    assert fixed.error == "" and fixed.occurrences and fixed.next_fire_ms is not None
    assert api.remove(app, "mangled") == 0
    assert [s.name for s in api.list(app)] == ["badopts", "good", "huge"]


def test_add_after_resumes_from_a_last_run_elsewhere_and_runs_the_missed_fire_once(app):
    """``add(after=)``: a schedule taken over from another scheduler that last ran it then."""
    from datetime import timedelta

    store = get_store(app)
    now = store.redis.now_ms()
    last = now - 25_000  # ran 25 s ago; every 10 s: due 15 s and 5 s ago (missed), then 5 s ahead
    s = api.add(app, "imported", "e2e.mark", 10, strict=False,
                after=datetime.fromtimestamp(last / 1000, timezone.utc))
    stored = store.schedules.get("imported")
    assert stored.origin_ms == last and not s.paused
    fires = [f for _, f in store.schedules.occurrences("imported")]
    assert fires[:2] == [last + 20_000, last + 30_000]  # the latest missed one once (now), then on its grid
    assert s.next_fire_ms == last + 30_000
    p = api.add(app, "off", "e2e.mark", 10, strict=False, paused=True,
                after=datetime.fromtimestamp(last / 1000, timezone.utc))
    assert p.paused and store.schedules.occurrences("off") == []
    with pytest.raises(InvalidOption, match="after must be an aware datetime"):
        api.add(app, "naive", "e2e.mark", 10, strict=False, after=datetime(2027, 1, 1) + timedelta(0))
    assert store.schedules.get("naive") is None
