"""Job functions of the other libraries (RQ, dramatiq, arq) in the benchmark."""

from __future__ import annotations

from typing import Any


def rq_late(due: float = 0.0, pad: str = "") -> None:
    """The RQ job (never run: only scheduling is measured for RQ)."""


async def arq_late(ctx: dict[str, Any], due: float = 0.0, pad: str = "") -> None:
    """The arq job (never run: only scheduling is measured for arq)."""
