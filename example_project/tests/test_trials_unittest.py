"""The same kit without pytest's fixtures: a ``unittest.TestCase`` (runs under pytest or ``python -m unittest``)."""

from __future__ import annotations

import sys
import unittest
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project: `import proj`

from proj import trials
from proj.celery import app
from proj.trials import charge_trial, start_trial

from celery_delayed.testing import DelayedTestKit, RedisServer


class TrialTests(unittest.TestCase):
    server: RedisServer

    @classmethod
    def setUpClass(cls) -> None:
        cls.server = RedisServer().start()  # one private redis-server for the class
        cls.addClassCleanup(cls.server.close)

    def setUp(self) -> None:
        self.kit = DelayedTestKit(app, self.server.url)
        self.addCleanup(self.kit.close)
        trials.CHARGED.clear()
        trials.DECLINING.clear()

    def test_charge_when_the_trial_ends(self) -> None:
        start_trial(3)
        self.kit.assert_scheduled(charge_trial, args=(3,), at=self.kit.clock.now() + timedelta(days=14))
        self.kit.clock.advance(days=14)
        self.kit.run_due()
        self.assertEqual(trials.CHARGED, [3])


if __name__ == "__main__":
    unittest.main()
