"""Tests of the example project: how a team tests code that schedules delayed tasks."""
