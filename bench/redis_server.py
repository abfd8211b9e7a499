"""The private ``redis-server`` starter: the test suite's, reused so the repo holds one copy."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_server import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]
