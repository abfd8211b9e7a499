"""Kombu's Redis transport layout, read once per app: where a released message goes.

The direct release path (``release_due.lua``) pushes messages onto the
broker's Redis lists itself, and the worker side refreshes kombu's unacked
index, so both must agree with ``kombu.transport.redis`` on every name. This
module is the one place that knows them (read from kombu, not guessed):

- a queue is the list ``global_keyprefix + queue``; a message whose priority
  falls in a higher step goes to ``... + sep + step`` (``Channel._q_for_pri``,
  ``sep = '\\x06\\x16'``, ``priority_steps`` default ``[0, 3, 6, 9]``);
- a named exchange's bindings are the set ``global_keyprefix +
  '_kombu.binding.<exchange>'`` with members ``routing_key + sep + pattern +
  sep + queue`` (``Channel.keyprefix_queue``);
- a message no queue is bound for goes to the transport option
  ``deadletter_queue`` (kombu's virtual channel), or is dropped;
- kombu tracks delivered, unacknowledged messages in the hash
  ``global_keyprefix + unacked_key`` (delivery tag -> message) and the sorted
  set ``global_keyprefix + unacked_index_key`` (delivery tag -> time, seconds).
"""

from __future__ import annotations

from bisect import bisect
from dataclasses import dataclass
from typing import Any

from kombu.transport.redis import Channel as RedisChannel
from kombu.transport.virtual.base import Channel as VirtualChannel

from ..config import DelayedConfig
from ..errors import ConfigurationError, InvalidOption
from ..redis_urls import broker_url, is_sentinel_url, same_redis


@dataclass(frozen=True)
class Route:
    """Where a message goes, resolved as Celery's ``send_task_message`` does."""

    queue: str
    exchange: str
    routing_key: str
    exchange_type: str
    priority: int


@dataclass(frozen=True)
class BrokerLayout:
    """Where kombu's Redis transport keeps an app's queues (see the module docstring).

    ``direct`` is True when released messages are pushed by the release
    script (the broker is Redis on the store's server and database, or
    ``delayed_release_mode = "direct"``); False on the publish path.
    """

    direct: bool
    global_keyprefix: str = ""
    priority_steps: tuple[int, ...] = tuple(RedisChannel.priority_steps)
    deadletter_queue: str = ""
    unacked_index_key: str = RedisChannel.unacked_index_key
    unacked_key: str = RedisChannel.unacked_key
    sep: str = RedisChannel.sep

    @classmethod
    def from_app(cls, app: Any, config: DelayedConfig) -> BrokerLayout:
        """Read the app's ``broker_transport_options`` and decide the release path.

        With ``delayed_redis_cluster = "auto"`` the path is decided as for a
        single server; the store refuses a direct path when it finds a
        cluster (:meth:`~celery_delayed.store.Store.client`).
        """
        opts = app.conf.broker_transport_options or {}
        if config.redis_cluster is True:  # kombu cannot use a cluster: the release script cannot push onto its lists
            if config.release_mode == "direct":
                raise ConfigurationError(
                    "delayed_release_mode is 'direct', but the store is a Redis Cluster (delayed_redis_cluster): "
                    "kombu cannot read queues from a cluster, so release publishes to the broker. Use "
                    "delayed_release_mode 'auto' or 'publish'")
            direct = False
        elif config.release_mode == "auto":
            broker = broker_url(app.conf)
            direct = bool(broker) and same_redis(broker, config.redis_url)
            if direct and is_sentinel_url(broker):  # the same Sentinels: the same master group too?
                direct = opts.get("master_name") == config.redis_options.get("master_name")
        else:
            direct = config.release_mode == "direct"
        return cls(
            direct=direct,
            global_keyprefix=opts.get("global_keyprefix", "") or "",
            priority_steps=tuple(opts.get("priority_steps", RedisChannel.priority_steps)),
            # Where kombu puts a message no queue is bound for (None: it drops it).
            deadletter_queue=opts.get("deadletter_queue", VirtualChannel.deadletter_queue) or "",
            unacked_index_key=opts.get("unacked_index_key", RedisChannel.unacked_index_key),
            unacked_key=opts.get("unacked_key", RedisChannel.unacked_key),
        )

    @property
    def unacked_index(self) -> str:
        """The key of kombu's unacked index ('' on the publish path: not ours to touch)."""
        return self.global_keyprefix + self.unacked_index_key if self.direct else ""

    @property
    def unacked_hash(self) -> str:
        """The key of kombu's hash of delivered, unacknowledged messages (delivery tag -> message)."""
        return f"{self.global_keyprefix}{self.unacked_key}"

    def priority_suffix(self, priority: int) -> str:
        """The list-key suffix of a message priority (``Channel._q_for_pri``; clamped to 0-9 as kombu does)."""
        steps = self.priority_steps
        pri = max(min(priority, RedisChannel.max_priority), RedisChannel.min_priority)
        step = steps[bisect(steps, pri) - 1]
        return f"{self.sep}{step}" if step else ""

    def list_key(self, queue: str, priority: int = 0) -> str:
        """The Redis list a message for ``queue`` with ``priority`` is pushed onto."""
        return f"{self.global_keyprefix}{queue}{self.priority_suffix(priority)}"

    def bindings_key(self, exchange: str) -> str:
        """The set of a named exchange's bindings."""
        return f"{self.global_keyprefix}{RedisChannel.keyprefix_queue % exchange}"

    def destination(self, route: Route) -> dict[str, str]:
        """Record fields that tell ``release_due.lua`` where to push a message.

        ``lk``: the list key for the anonymous exchange (kombu's ``_put``).
        For a named direct exchange, ``bx`` (its binding set), ``rk`` and
        ``ps`` (the priority suffix): the script pushes to each bound queue
        whose routing key matches, as kombu's ``DirectExchange`` does.

        Raises:
            InvalidOption: a topic or fanout exchange, which the direct path
                cannot route.
        """
        if not route.exchange:
            return {"lk": self.list_key(route.routing_key or route.queue, route.priority)}
        if route.exchange_type != "direct":
            raise InvalidOption(
                f"exchange {route.exchange!r} is a {route.exchange_type} exchange; the direct release path "
                "handles direct exchanges only: set delayed_release_mode = 'publish' to publish through kombu"
            )
        return {"bx": self.bindings_key(route.exchange), "rk": route.routing_key,
                "ps": self.priority_suffix(route.priority)}
