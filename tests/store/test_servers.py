"""The private servers the tests start: each one is the process its port reaches."""

from __future__ import annotations

import pytest
import redis

from celery_delayed.testing.servers import RedisServer, _cluster_port


@pytest.mark.timeout(30)
def test_a_server_whose_port_is_taken_refuses_to_start_rather_than_share_the_other_server() -> None:
    with RedisServer() as first:
        redis.Redis.from_url(first.url).set("who", "first")
        second = RedisServer(port=first.port)
        try:
            with pytest.raises(RuntimeError, match=f"did not start on port {first.port}"):
                second.start(timeout=5)
        finally:
            second.close()
        assert redis.Redis.from_url(first.url).get("who") == b"first"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("extra", [("--requirepass", "s3cret"), ("--loglevel", "warning")])
def test_the_check_of_whose_server_answers_holds_with_a_password_and_a_quiet_log(extra: tuple[str, str]) -> None:
    with RedisServer(*extra) as first:
        first.restart()
        second = RedisServer(*extra, port=first.port)
        try:
            with pytest.raises(RuntimeError, match=f"did not start on port {first.port}"):
                second.start(timeout=5)
        finally:
            second.close()


@pytest.mark.timeout(30)
def test_a_server_that_chose_its_port_chooses_another_if_that_one_was_taken_before_it_started() -> None:
    server = RedisServer()
    chosen = server.port
    with RedisServer(port=chosen) as squatter:
        redis.Redis.from_url(squatter.url).set("who", "squatter")
        try:
            server.start(timeout=10)
            assert server.port != chosen
            assert redis.Redis.from_url(server.url).get("who") is None
            server.restart()
            assert server.port != chosen and redis.Redis.from_url(server.url).ping()
        finally:
            server.close()


@pytest.mark.timeout(30)
def test_a_restarted_server_counts_as_started_only_when_it_serves_again() -> None:
    with RedisServer(appendonly=True) as server:
        redis.Redis.from_url(server.url).set("k", "v")
        server.restart()
        assert redis.Redis.from_url(server.url).get("k") == b"v"


@pytest.mark.timeout(30)
def test_cluster_ports_are_never_handed_out_twice() -> None:
    # The CI once built a "cluster" of three nodes on two ports: the third node's
    # port was the second's, and the second server answered its PING.
    taken: set[int] = set()
    ports = [_cluster_port(taken) for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not set(ports) & {p + 10000 for p in ports}
    pinned = {ports[0], ports[0] + 10000}
    assert _cluster_port(pinned) not in {ports[0], ports[0] + 10000}
