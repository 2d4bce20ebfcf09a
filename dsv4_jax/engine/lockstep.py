"""Device calls in lockstep across processes (`dsv4_jax.parallel.distributed`).

With several hosts every process must make the same device calls in the same order, or a
collective waits forever. The engine makes each of its device calls through `Lockstep.call(name,
*args)`: on the leader it first sends the call's name and host arguments to the followers, whose
`follow` loop makes the same call. Device arrays that calls return are numbered in the order they
appear, the same on every process, so an argument that is such an array (the previous step's
sampled tokens, a step's logits) travels as its number. With one process `call` is a plain call.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable

import jax

from dsv4_jax.parallel.distributed import StepChannel, start_failures

logger = logging.getLogger(__name__)

_STOP = "stop"
# Results a later call may take, remembered for the last few such calls (two steps of fill, run,
# sample: the previous step's samples and this step's logits are the furthest back a call reaches).
_KEEP_CALLS = 6


@dataclasses.dataclass(frozen=True)
class ArrayRef:
    number: int


def _device_arrays(value: Any) -> list[jax.Array]:
    """The device arrays in a call's result, in a fixed order."""
    if isinstance(value, jax.Array):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [a for f in dataclasses.fields(value) for a in _device_arrays(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [a for item in value for a in _device_arrays(item)]
    return []


class Lockstep:
    """`calls`: every device call by name; `passed_on`: the names whose results later calls take
    as arguments (only those are remembered: the others, such as a head over every position, can
    be large and are read once on the host)."""

    def __init__(self, calls: dict[str, Callable[..., Any]], passed_on: frozenset[str]):
        self.calls = calls
        self.passed_on = passed_on
        self.channel: StepChannel | None = None
        self._arrays: dict[int, jax.Array] = {}
        self._numbers: dict[int, int] = {}  # id(array) -> its number (leader)
        self._recent: collections.deque[list[int]] = collections.deque()  # numbers, per remembered call
        self._next = 0

    def call(self, name: str, *args: Any) -> Any:
        """`calls[name](*args)`, made on every process."""
        if self.channel is None:
            return self.calls[name](*args)
        self.channel.send((name, tuple(self._outgoing(a) for a in args)))
        return self._remember(name, self.calls[name](*args))

    def lead(self, channel: StepChannel) -> None:
        """From now on, every call is also made by the followers behind `channel`."""
        self.channel = channel

    def stop(self) -> None:
        """Leader: release the followers (their `follow` returns)."""
        if self.channel is not None:
            self.channel.finish(_STOP)
            self.channel = None

    def follow(self, channel: StepChannel) -> int:
        """Follower: make the leader's calls until it stops; returns the number of calls made."""
        made = 0
        while True:
            try:
                message = channel.receive()
            except EOFError:
                said = start_failures().get(0)  # node 0 failed while starting after this node had finished
                raise RuntimeError(f"node 0 stopped while starting: {said}" if said else
                                   "the leader closed the step channel without stopping (did it die?)") from None
            if message == _STOP:
                channel.close()
                return made
            name, args = message
            self._remember(name, self.calls[name](*(self._incoming(a) for a in args)))
            made += 1

    def _outgoing(self, arg: Any) -> Any:
        if isinstance(arg, jax.Array):
            number = self._numbers.get(id(arg))
            if number is None or self._arrays.get(number) is not arg:
                raise RuntimeError("a device array passed to a lockstep call was not made by one (or is too old)")
            return ArrayRef(number)
        return arg

    def _incoming(self, arg: Any) -> Any:
        return self._arrays[arg.number] if isinstance(arg, ArrayRef) else arg

    def _remember(self, name: str, result: Any) -> Any:
        """Number the result's arrays (every call, the same on every process); keep those of a
        call in `passed_on`, for the last _KEEP_CALLS such calls."""
        numbers = []
        for array in _device_arrays(result):
            if name in self.passed_on:
                self._arrays[self._next] = array
                self._numbers[id(array)] = self._next
                numbers.append(self._next)
            self._next += 1
        if name in self.passed_on:
            self._recent.append(numbers)
            while len(self._recent) > _KEEP_CALLS:
                for number in self._recent.popleft():
                    self._numbers.pop(id(self._arrays.pop(number)), None)
        return result
