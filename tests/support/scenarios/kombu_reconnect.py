"""Celery 5.7's reconnect sequence on a kombu Redis connection after a Redis SIGKILL.

``python kombu_reconnect.py PORT [--guard]`` prints ``RESULT: OK`` or
``RESULT: CRASH <exception>``. The connection has a delivered, unacked
message, a ``BRPOP`` outstanding on its default channel and a ``SUBSCRIBE`` on
a second channel (a waiting worker with its remote-control queue); then the
server is killed and, as ``Consumer.on_connection_error_after_connected``
does, ``connection.collect()`` and ``connection.close()`` run. Without the
guard of ``celery_delayed.fixups.reconnect_guard``, kombu 5.7 raises
``AttributeError("'NoneType' object has no attribute 'hostname'")``.
"""

from __future__ import annotations

import contextlib
import sys

from kombu import Connection, Exchange, Queue
from kombu.utils.eventio import poll

from celery_delayed.fixups import reconnect_guard
from celery_delayed.testing import RedisServer


def main() -> None:
    if "--guard" in sys.argv:
        assert reconnect_guard.install()
    server = RedisServer().start()
    ch = None
    try:
        conn = Connection(server.url)
        ch = conn.default_channel
        q = Queue("scenario")(ch)
        q.declare()
        ch.basic_publish(ch.prepare_message("x"), exchange="", routing_key="scenario")
        assert q.get(no_ack=False) is not None  # delivered, not acked: close() restores it
        ch.basic_consume("scenario", False, lambda m: None, "scenario-tag")
        ch2 = conn.channel()
        bq = Queue("scenario.pidbox", Exchange("scenario.bcast", type="fanout"), auto_delete=True)(ch2)
        bq.declare()
        ch2.basic_consume("scenario.pidbox", True, lambda m: None, "pidbox-tag")
        cycle = conn.transport.cycle
        cycle.on_poll_init(poll())
        cycle._register_BRPOP(ch)  # a BRPOP is outstanding
        cycle._register_LISTEN(ch2)  # a SUBSCRIBE is outstanding
        server.stop("kill")
        with contextlib.suppress(Exception):  # Celery ignores anything here
            conn.collect(socket_timeout=5)
        with contextlib.suppress(*conn.connection_errors):  # Celery: ignore_errors(conn, conn.close)
            conn.close()
        print("RESULT: OK")
    except Exception as exc:
        print(f"RESULT: CRASH {exc!r}")
    finally:
        if ch is not None:  # silence kombu's at-exit restore of the test message (Redis is gone)
            ch.qos._delivered.clear()
            ch.qos._delivered.restored = True
        server.close()


if __name__ == "__main__":
    main()
