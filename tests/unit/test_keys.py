"""Key schema and shard choice: pure, no Redis."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from celery_delayed.store.keys import Keys, shard_for


def test_shard_for_is_crc32_mod_n_and_in_range() -> None:
    for n in (1, 2, 16, 1000, 16384):
        for key in ("a", "job-1", "ünïcode", "", "x" * 1000):
            s = shard_for(key, n)
            assert 0 <= s < n
            assert s == zlib.crc32(key.encode("utf-8")) % n


def test_shard_for_is_stable_across_processes() -> None:
    """Unlike hash(), the shard must not depend on PYTHONHASHSEED."""
    keys = ["user:42", "order-7", "abc"]
    code = f"from celery_delayed.store.keys import shard_for; print([shard_for(k, 16) for k in {keys!r}])"
    outs = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PATH": ""},
                       capture_output=True, text=True, check=True).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str([shard_for(k, 16) for k in keys])
    # Known values pin the function itself (a change would move every stored job).
    assert shard_for("user:42", 16) == zlib.crc32(b"user:42") % 16


def test_shard_for_spreads_keys() -> None:
    counts = [0] * 16
    for i in range(16_000):
        counts[shard_for(f"job-{i}", 16)] += 1
    assert min(counts) > 800 and max(counts) < 1200


@pytest.mark.parametrize("shard", [0, 7, 16383])
def test_shard_keys_carry_the_hash_tag(shard: int) -> None:
    sk = Keys("pfx").shard(shard)
    tag = f"{{{shard}}}"
    names = [sk.due, sk.buckets, sk.next, sk.inflight, sk.lease, sk.fence, sk.dlq, sk.job("j1")]
    assert names == [
        f"pfx:{tag}:due", f"pfx:{tag}:buckets", f"pfx:{tag}:next", f"pfx:{tag}:inflight",
        f"pfx:{tag}:lease", f"pfx:{tag}:fence", f"pfx:{tag}:dlq", f"pfx:{tag}:job:j1",
    ]
    assert sk.job("j1") == sk.job_prefix + "j1"
    for name in names:
        # Redis Cluster hashes only the text between the first '{' and the next '}'.
        start = name.index("{")
        assert name[start + 1:name.index("}", start)] == str(shard)
    assert len(set(names)) == len(names)


def test_global_keys() -> None:
    k = Keys("pfx")
    assert k.schedulers == "pfx:schedulers"
    assert k.wake == "pfx:wake"
    assert Keys("a").shard(1).due != Keys("b").shard(1).due
