"""The shared vocabulary: the Lua scripts use the states, fields and reply codes of vocab.py."""

from __future__ import annotations

import re

from celery_delayed.store.loader import lua_dir
from celery_delayed.vocab import Field, JobState, Reply, ScheduleField

HASH_CALLS = ("HGET", "HSET", "HMGET", "HDEL", "HSETNX", "HEXISTS", "HINCRBY")
HASH_CALL = re.compile(r"redis\.call\('(" + "|".join(HASH_CALLS) + r")',\s*([^)]*)\)")
FIELDS = {v for cls in (Field, ScheduleField) for k, v in vars(cls).items()
          if not k.startswith("_") and isinstance(v, str)}


def _lua_sources() -> dict[str, str]:
    base = lua_dir()
    files = sorted(base.glob("*.lua")) + sorted((base / "includes").glob("*.lua"))
    assert len(files) >= 20
    return {p.name: p.read_text() for p in files}


def test_reply_codes_match_the_lua_table():
    common = (lua_dir() / "includes" / "common.lua").read_text()
    m = re.search(r"^local ([A-Z_, ]+) = ([-0-9, ]+)$", common, re.M)
    assert m, "common.lua declares the reply codes on one line"
    names = [n.strip() for n in m.group(1).split(",")]
    values = [int(v) for v in m.group(2).split(",")]
    assert dict(zip(names, values, strict=True)) == {r.name: r.value for r in Reply}
    for r in Reply:  # and the comment table documents each
        assert re.search(rf"^--\s+{r.value}\s+{r.name}\s", common, re.M), r


def test_lua_state_literals_are_job_states():
    states = {s.value for s in JobState}
    seen: set[str] = set()
    for name, text in _lua_sources().items():
        for lit in re.findall(r"(?:st|state|outcome|unsent)\s*[~=]=\s*'([A-Z]+)'", text):
            assert lit in states, (name, lit)
            seen.add(lit)
        for lit in re.findall(r"'st',\s*'([A-Z]+)'", text):
            assert lit in states, (name, lit)
            seen.add(lit)
    assert {"SCHEDULED", "QUEUED", "RUNNING", "CANCELLED", "DEAD", "CLAIMED"} <= seen


def test_lua_record_fields_are_known_fields():
    used: set[str] = set()
    for name, text in _lua_sources().items():
        for call in HASH_CALL.finditer(text):
            args = call.group(2).split(",")[1:]  # after the key
            if call.group(1) in ("HSET", "HSETNX"):
                args = args[::2]  # field, value, field, value ...
            for arg in args:
                lit = re.fullmatch(r"\s*'([a-z_]+)'\s*", arg)
                if lit:
                    assert lit.group(1) in FIELDS, (name, lit.group(1))
                    used.add(lit.group(1))
    assert {"st", "due", "msg", "lo", "lu", "att", "died"} <= used


def test_job_state_is_a_str():
    assert JobState.QUEUED == "QUEUED" and str(JobState.QUEUED) == "QUEUED"
    assert f"{JobState.DEAD}" == "DEAD"
