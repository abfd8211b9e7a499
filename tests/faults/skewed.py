"""Run ``celery`` with ``time.time()`` shifted by $SKEW_S seconds: a host whose clock is wrong.

Usage: ``SKEW_S=30 python skewed.py -A app delayed run``. Only this process's
Python clock moves; Redis TIME (the one clock celery-delayed trusts) does not.
"""

from __future__ import annotations

import os
import sys
import time

_SKEW_S = float(os.environ.get("SKEW_S", "0"))
_real_time, _real_time_ns = time.time, time.time_ns
time.time = lambda: _real_time() + _SKEW_S
time.time_ns = lambda: _real_time_ns() + int(_SKEW_S * 1e9)

if __name__ == "__main__":
    from celery.__main__ import main

    sys.argv = ["celery", *sys.argv[1:]]
    sys.exit(main())
