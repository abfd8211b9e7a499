"""How the replies of a pipelined MULTI ... EXEC (a batch over several shards) are read."""

from __future__ import annotations

import pytest
from redis.exceptions import ExecAbortError, NoScriptError, OutOfMemoryError

from celery_delayed.store.runner import _executed

pytestmark = pytest.mark.timeout(10)


def test_the_replies_of_a_transaction_that_ran_are_exec_s_own() -> None:
    missing = NoScriptError("No matching script")
    assert _executed(["OK", "QUEUED", "QUEUED", [["=1"], missing]]) == [["=1"], missing]


def test_a_command_refused_while_queued_is_raised_as_itself() -> None:
    oom = OutOfMemoryError("command not allowed when used memory > 'maxmemory'")
    abort = ExecAbortError("Transaction discarded because of previous errors.")
    with pytest.raises(OutOfMemoryError) as err:
        _executed(["OK", "QUEUED", oom, abort])
    assert err.value is oom


def test_exec_refused_for_memory_is_an_out_of_memory_error() -> None:
    abort = ExecAbortError("Transaction discarded because of: OOM command not allowed when used memory > 'maxmemory'.")
    with pytest.raises(OutOfMemoryError, match="maxmemory"):
        _executed(["OK", "QUEUED", "QUEUED", abort])
    other = ExecAbortError("Transaction discarded because of: something else")
    with pytest.raises(ExecAbortError):
        _executed(["OK", "QUEUED", other])
