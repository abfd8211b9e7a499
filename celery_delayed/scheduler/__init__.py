"""The scheduler: a loop that sleeps until jobs are due and releases them.

The releaser (:mod:`.releaser`: release or claim-publish-ack one batch of one shard)
is separate from the loop (:mod:`.loop`: membership, shard leases, sleeping,
waking, stopping).
"""

from __future__ import annotations

from .loop import Scheduler
from .releaser import DirectReleaser, PublishReleaser, Releaser, make_releaser
from .wakeup import WakeListener

__all__ = ["DirectReleaser", "PublishReleaser", "Releaser", "Scheduler", "WakeListener", "make_releaser"]
