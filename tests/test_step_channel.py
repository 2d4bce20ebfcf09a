"""The step channel's host logic on one machine, without jax.distributed (tests/test_multihost.py
runs the real multi-process cases): what a follower says when node 0 hangs up."""

from __future__ import annotations

import socket

import pytest

from dsv4_jax import distributed
from dsv4_jax.engine import lockstep
from dsv4_jax.engine.lockstep import Lockstep


@pytest.mark.parametrize("announced", [None, "a shard is truncated"])
def test_a_follower_whose_leader_hangs_up_names_the_leaders_announced_reason(monkeypatch, announced):
    """A follower that finished starting before node 0 failed is reading the channel, not watching
    for announcements: the end of the channel is its cue, and node 0's announcement its reason."""
    monkeypatch.setattr(lockstep, "start_failures", lambda: {0: announced} if announced else {})
    follower_end, leader_end = socket.socketpair()
    leader_end.close()
    with pytest.raises(RuntimeError) as raised:
        Lockstep({}, frozenset()).follow(distributed.StepChannel({0: follower_end}))
    expected = f"node 0 stopped while starting: {announced}" if announced else "the leader closed the step channel"
    assert str(raised.value).startswith(expected), raised.value


def test_without_jax_distributed_no_node_has_announced_anything():
    assert distributed.start_failures() == {}
