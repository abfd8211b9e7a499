"""Paging many jobs: the page size a listing reads per round trip, and the check of a caller's page."""

from __future__ import annotations

from ..errors import InvalidOption

#: Entries a listing reads from Redis per round trip.
PAGE = 500


def check_page(offset: int, limit: int) -> None:
    """Refuse a page that is not ``offset >= 0``, ``limit >= 1`` (both ints).

    Raises:
        InvalidOption: what was wrong.
    """
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 \
            or isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidOption(f"offset must be an int >= 0 and limit an int >= 1, got offset={offset!r}, "
                            f"limit={limit!r}")
