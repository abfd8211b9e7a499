"""What every facet of the store holds: the runner (its only way to Redis), the layout, keys and config."""

from __future__ import annotations

from typing import ClassVar

from ..config import DelayedConfig
from .broker_layout import BrokerLayout
from .client import translate_errors
from .keys import Keys
from .layout import ShardLayout
from .runner import Runner


class Facet:
    """One side's operations on the store (see :class:`~.gateway.Store`).

    A facet holds no connection: it builds each script's keys and arguments,
    runs it through :attr:`redis` (the :class:`~.runner.Runner`) and maps the
    reply to a result or an error. ``SCRIPTS`` names the ``lua/`` scripts it
    runs, each by the one method that bears the script's name. Every public
    method of a facet raises celery-delayed's errors, not redis-py's
    (:func:`~.client.translate_errors`, applied to each subclass).
    """

    #: The scripts of ``lua/`` this facet runs (each by its method of the same name).
    SCRIPTS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        translate_errors(cls)

    def __init__(self, redis: Runner, layout: ShardLayout) -> None:
        self.redis = redis
        self.layout = layout
        self.keys: Keys = redis.keys
        self.config: DelayedConfig = redis.config
        self.broker: BrokerLayout = redis.broker
        #: The store's URL (the errors' messages name it).
        self.url: str = redis.url
