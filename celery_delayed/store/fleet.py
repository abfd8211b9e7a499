"""The scheduler fleet: membership, shard leases and the wake channel.

Schedulers heartbeat into one membership set (:meth:`Fleet.heartbeat`), hold
shard leases while they are live members (:meth:`Fleet.shard_lease`), and
listen on the wake channel (:meth:`Fleet.subscribe_wake`) for jobs due
earlier than they know and for membership changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis

from ..errors import ConfigurationError
from ..vocab import Reply
from .client import close_client, make_client
from .facet import Facet
from .loader import Arg
from .records import Membership

#: Payload prefix of a membership notice on the wake channel.
MEMBERS_NOTICE = "members|"
#: The "owner" of the membership notice a reshard sends when it changes the layout.
LAYOUT_NOTICE = "~layout"


class Fleet(Facet):
    """Scheduler membership and shard leases (``heartbeat.lua``, ``shard_lease.lua``), and the wake channel."""

    SCRIPTS = ("heartbeat", "shard_lease")

    def settings(self) -> str:
        """The settings every scheduler of this store must share, as heartbeat.lua records them."""
        return f"lease_ms={self.config.lease_ms}"

    def heartbeat(self, owner: str, leave: bool = False, now_ms: int | None = None) -> Membership:
        """Renew (or give up) ``owner``'s membership (``heartbeat.lua``); return what it saw."""
        reply = self.redis.run(
            self.redis.scripts.heartbeat, [self.keys.schedulers, self.keys.scheduler_settings],
            [self.redis.now_arg(now_ms), owner, self.config.lease_ms, "1" if leave else "", self.settings()],
        )
        deadlines = {str(reply[i]): int(float(reply[i + 1])) for i in range(2, len(reply), 2)}
        return Membership(int(reply[0]), list(deadlines), deadlines, int(reply[1]) == 1)

    def check(self) -> None:
        """Refuse to join a fleet of schedulers that run with other shared settings.

        Checks the store's layout (``delayed_shards``, ``delayed_bucket_ms``)
        and that every live scheduler has this one's ``delayed_lease_ms`` (a
        member with a shorter lease would be counted dead by the others, and
        its shards taken over while it still releases them).

        Raises:
            ConfigurationError: what differs, from which scheduler, and what to do.
        """
        self.layout.check()
        live = set(self.live_members())
        mine = self.settings()
        settings: dict[str, str] = self.redis.client.hgetall(self.keys.scheduler_settings)  # type: ignore[assignment]
        for owner, theirs in settings.items():
            if owner in live and theirs != mine:
                raise ConfigurationError(
                    f"this scheduler runs with {mine.replace(';', ', ')}, but scheduler {owner} of the store "
                    f"under prefix {self.config.key_prefix!r} runs with {theirs.replace(';', ', ')}: every "
                    "scheduler of one store must use the same delayed_lease_ms (stop the others first to change it)"
                )

    def shard_lease(
        self, owner: str, take: Iterable[int], give: Iterable[int] = (), live: Iterable[str] = (),
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Take (or check) the leases of shards ``take``, give up those of ``give`` (``shard_lease.lua`` per shard).

        One script call per shard (one slot each: this runs on Redis Cluster),
        all in one round trip. A lease has no deadline: it is its holder's
        while the holder is among the ``live`` members (the caller's last
        heartbeat), so a held shard needs no renewal, and a shard another
        live member holds is not taken.

        Returns ({shard: fence} of the ``take`` shards the caller holds now,
        {shard: holder} of the others).
        """
        wanted, dropped = sorted(set(take)), sorted(set(give) - set(take))
        members = list(live)
        calls: list[tuple[Sequence[str], Sequence[Arg]]] = []
        for shard, arg in [(s, "") for s in wanted] + [(s, "1") for s in dropped]:
            shard_keys = self.keys.shard(shard)
            calls.append(([shard_keys.lease, shard_keys.fence], ["", owner, arg, *([] if arg else members)]))
        held: dict[int, str] = {}
        waits: dict[int, str] = {}
        replies = self.redis.run_many(self.redis.scripts.shard_lease, calls) if calls else []
        for shard, (code, fence, holder) in zip(wanted, replies, strict=False):
            if int(code) == Reply.OK:
                held[shard] = str(fence)
            else:
                waits[shard] = str(holder)
        return held, waits

    def live_members(self) -> list[str]:
        """The schedulers whose membership lease has not run out."""
        return [str(m) for m in self.redis.client.zrangebyscore(self.keys.schedulers, self.redis.now_ms(), "+inf")]

    def notify_members(self, owner: str) -> None:
        """Tell the other schedulers that the membership changed (on the wake channel)."""
        self.redis.client.publish(self.keys.wake, MEMBERS_NOTICE + owner)

    def subscribe_wake(self) -> WakeSubscription:
        """A new subscription to the wake channel (its own connection; see :class:`WakeSubscription`)."""
        return WakeSubscription(
            make_client(self.url, options=self.config.redis_options, fail_fast=True, cluster=self.redis.cluster),
            self.keys.wake)

class WakeSubscription:
    """A subscription to the store's wake channel, on a connection of its own.

    ``schedule.lua`` (and the other scripts that index a job) publish
    ``"<shard>:<due_ms>"`` there when a job is due earlier than the shard's
    known next due time; schedulers publish ``"members|<owner>"`` when they
    join or leave (:meth:`Fleet.notify_members`).
    """

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self._client = client
        self._pubsub: Any = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
        self._pubsub.subscribe(channel)

    def get(self, timeout: float) -> tuple[str, str] | None:
        """The next event, waiting up to ``timeout`` seconds: ``("subscribed", "")``,
        ``("members", owner)``, ``("due", "<shard>:<due_ms>")`` or None.

        Raises redis-py's errors when the connection is lost (the caller
        resubscribes).
        """
        msg = self._pubsub.get_message(timeout=timeout)
        if msg is None:
            return None
        kind = msg.get("type")
        if kind == "subscribe":
            return ("subscribed", "")
        if kind != "message":
            return None
        data = str(msg["data"])
        if data.startswith(MEMBERS_NOTICE):
            return ("members", data[len(MEMBERS_NOTICE):])
        return ("due", data)

    def close(self) -> None:
        """Unsubscribe and close the connection."""
        try:
            self._pubsub.close()
        finally:
            close_client(self._client)

