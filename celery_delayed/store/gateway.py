"""The store of one Celery app: the runner, the shard layout, and one facet per calling side.

Every change to the store is one Lua script (``lua/<name>.lua``), run by the
one facet method that bears its name (``lua/cancel.lua`` is
``store.jobs.cancel``). A facet builds the script's keys
(:class:`~.keys.Keys`) and arguments, runs it through the runner, and maps
its reply code (:class:`~celery_delayed.vocab.Reply`) to a result or an
error; Redis errors become :class:`~celery_delayed.errors.StoreUnavailable`
or :class:`~celery_delayed.errors.StoreFull` at the facet's boundary
(:func:`~.client.translate_errors`).

==================  =====================================  ==========================================
attribute           what                                   who calls it
==================  =====================================  ==========================================
``redis``           :class:`~.runner.Runner`: the client,  the facets (and tests reading raw keys)
                    pipelines, ``MULTI``/``EXEC``, ``WAIT``
``layout``          :class:`~.layout.ShardLayout`          everyone: shard count, reshard, path
``jobs``            :class:`~.jobs.Jobs`                   producers, the API, operators
``lookup``          :class:`~.lookup.Lookup`               everyone: one job's record and message
``release``         :class:`~.release.Releases`            the scheduler, the reconciler
``fleet``           :class:`~.fleet.Fleet`                 the scheduler: membership, leases, wake-ups
``executions``      :class:`~.executions.Executions`       the worker: start, lease, finish, failures
``dead_letters``    :class:`~.dead_letters.DeadLetters`    operators: list, show, requeue, purge
``schedules``       :class:`~.schedules.ScheduleRecords`   recurring schedules
``changes``         :class:`~.changes.ChangeLog`           the database mirror
``moves``           :class:`~.moves.Moves`                 ``delayed reshard``, a producer meeting one
``shaping``         :class:`~.shaping.Shaping`             operators: rate limits at run time, tenants
==================  =====================================  ==========================================

Reads that list many jobs live in :mod:`.views`; the record schema is in
:mod:`.records`.
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery

from ..config import DelayedConfig, get_config
from .broker_layout import BrokerLayout
from .changes import ChangeLog
from .client import translate_errors
from .dead_letters import DeadLetters
from .executions import Executions
from .fleet import Fleet
from .jobs import Jobs
from .keys import Keys
from .layout import ShardLayout
from .lookup import Lookup
from .moves import Moves
from .release import Releases
from .runner import Runner
from .schedules import ScheduleRecords
from .shaping import Shaping


@translate_errors
class Store:
    """The delayed-job store of one Celery app: its Redis, its layout and its facets.

    Args:
        app: the Celery app (its ``delayed_*`` settings and broker options apply).
        config: its config (default: :func:`~celery_delayed.config.get_config`).
        fail_fast: a client that retries a failed command once, quickly (for
            scheduler threads, which back off themselves).
        client: a redis-py client to use instead of making one.
    """

    def __init__(
        self, app: Celery, config: DelayedConfig | None = None, *, fail_fast: bool = False,
        client: redis.Redis | None = None,
    ) -> None:
        self.app = app
        self.config = config or get_config(app)
        self.url = self.config.redis_url
        self.keys = Keys(self.config.key_prefix)
        self.broker = BrokerLayout.from_app(app, self.config)
        #: The transport: the one way to Redis (for the facets; tests read raw keys through its client).
        self.redis = Runner(app, self.config, self.keys, self.broker, fail_fast=fail_fast, client=client)
        #: The shard count, followed through a reshard, and the release path.
        self.layout = ShardLayout(self.redis)
        #: Single-job reads.
        self.lookup = Lookup(self.redis, self.layout)
        #: Moving jobs between shards.
        self.moves = Moves(self.redis, self.layout)
        #: Producers and operators: schedule, cancel, reschedule, promote, pause.
        self.jobs = Jobs(self.redis, self.layout, self.lookup, self.moves)
        #: The scheduler: release due jobs (direct or publish path), send lost ones again.
        self.release = Releases(self.redis, self.layout)
        #: The scheduler fleet: membership, shard leases, the wake channel.
        self.fleet = Fleet(self.redis, self.layout)
        #: The worker: each job's execution lease and how each attempt ended.
        self.executions = Executions(self.redis, self.layout, self.lookup)
        #: The dead-letter queue.
        self.dead_letters = DeadLetters(self.redis, self.layout, self.lookup)
        #: Recurring schedules.
        self.schedules = ScheduleRecords(self.redis, self.layout)
        #: The change log a database mirror reads.
        self.changes = ChangeLog(self.redis, self.layout)
        #: Release shaping: rate limits set at run time, what they hold back, tenants.
        self.shaping = Shaping(self.redis, self.layout, self.lookup)

    def drop_everything(self) -> int:
        """Delete every key under this store's prefix; return how many (the testing kit's clean-up).

        It SCANs the whole server: for a test's own prefix, never a production store.
        """
        client = self.redis.client
        n = 0
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.config.key_prefix)
        batch: list[Any] = []
        for key in client.scan_iter(match=f"{escaped}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                n += int(client.unlink(*batch))
                batch = []
        if batch:
            n += int(client.unlink(*batch))
        return n
