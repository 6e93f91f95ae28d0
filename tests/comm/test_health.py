"""comm.health.guard: a failed collective becomes one ParallelError line that says what is
known of the other ranks."""

from __future__ import annotations

import pytest

from exitlm.comm.health import ParallelError, guard

GLOO_RESET = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:39811: Connection reset by peer")


def test_a_peer_that_closed_its_connection_is_said_so() -> None:
    """A SIGKILLed peer shows on the survivor as gloo's connection reset, long before any
    heartbeat is overdue: the message said "a collective of rank 0 failed" of the survivor."""
    with pytest.raises(ParallelError) as info, \
            guard("training step", rank=0, timeout_s=20, heartbeat=None):
        raise RuntimeError(GLOO_RESET)
    message = str(info.value)
    assert "a peer closed its connection (it exited or was killed)" in message
    assert "rank 0 (this process)" in message and "\n" not in message


def test_a_timeout_without_a_closed_connection_blames_no_peer() -> None:
    with pytest.raises(ParallelError) as info, \
            guard("training step", rank=1, timeout_s=5, heartbeat=None):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    assert "peer closed" not in str(info.value) and "rank 1 (this process)" in str(info.value)


def test_other_errors_pass_through() -> None:
    with pytest.raises(ValueError, match="not a collective"), \
            guard("training step", rank=0, timeout_s=5, heartbeat=None):
        raise ValueError("not a collective")
