"""The message options of an old entry that carry over to celery-delayed, and those left out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...producer.message import MESSAGE_OPTIONS


def split_options(options: Mapping[str, Any], recurring: bool) -> tuple[dict[str, Any], list[str]]:
    """(the options kept, a note for each one left out).

    ``expires`` as seconds is an expiry counted from each send: a recurring
    schedule's occurrences are stored ahead, so it has no equivalent there
    (a late occurrence is skipped by the schedule's misfire policy instead).
    An option ``apply_later`` does not take has none either.
    """
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in options.items():
        if value is None:
            continue
        if key == "expires" and recurring:
            dropped.append(f"option expires={value!r} (an expiry after each send; a late occurrence is skipped "
                           "by the misfire policy instead)")
        elif key in MESSAGE_OPTIONS:
            kept[key] = value
        else:
            dropped.append(f"option {key}={value!r} (no equivalent)")
    return kept, dropped
