"""The scheduler: a loop that sleeps until jobs are due and releases them.

The mover (:mod:`.mover`: release or claim-publish-ack one batch of one shard)
is separate from the loop (:mod:`.loop`: membership, shard leases, sleeping,
waking, stopping).
"""

from __future__ import annotations

from .loop import Scheduler
from .mover import DirectMover, Mover, PublishMover, make_mover
from .wakeup import WakeListener

__all__ = ["DirectMover", "Mover", "PublishMover", "Scheduler", "WakeListener", "make_mover"]
