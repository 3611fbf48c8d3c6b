"""The two sides of ``kvmove-bench transfer`` (and ``stream``): a ``Side`` (cache + agent + the
data pattern that lets every byte be verified) here, and a ``Peer`` process driving another
``Side`` through ``harness.Child``, every reply with a deadline."""

from __future__ import annotations

import time
from typing import Any

from kvmove.agent import Agent
from kvmove.bench.harness import Channel, Child
from kvmove.bench.pattern import PatternCache
from kvmove.bench.report import BenchError
from kvmove.bench.transfer_report import Registration
from kvmove.errors import KVMoveError
from kvmove.kv_spec import KVSpec

__all__ = ["FAR", "FarSide", "NEAR", "Peer", "STOP", "Side", "connect_pair", "ping",
           "stop_echo"]

NEAR, FAR = "bench-near", "bench-far"
_PEER_IDLE_SECONDS = 600.0  # a peer without commands this long assumes we are gone
STOP = b"stop"  # the notification that ends Side.echo


class Side(PatternCache):
    """One process's cache and agent, and the pattern operations on its blocks
    (``PatternCache``).

    Args:
        wrap: None for a ``KVCache`` kvmove allocates; else an engine of
            ``engine_caches.WRAP_FORMATS`` whose tensors (numpy) are allocated and wrapped.

    Attributes:
        registration: how long making the cache and agent took (``Registration``).
    """

    def __init__(self, name: str, layout: KVSpec, num_blocks: int,
                 agent_kwargs: dict[str, Any], wrap: str | None = None,
                 device: str | None = None) -> None:
        super().__init__(layout, num_blocks, wrap, device)
        start = time.perf_counter()
        try:
            self.agent = Agent(name, self.cache, **agent_kwargs)
        except KVMoveError as error:
            raise BenchError(f"cannot create agent {name!r} with {agent_kwargs}: "
                             f"{error}") from error
        self.registration = Registration(wrap or "native", layout.block_size,
                                         num_blocks * layout.bytes_per_block,
                                         self.wrap_seconds, time.perf_counter() - start)
        self._loads: dict[str, Any] = {}  # leased, not yet loaded

    def check_after_notification(self, tag: bytes, ids: list[int], src_ids: list[int],
                                 seed: int, timeout: float) -> int:
        """Waits for the notification ``tag``, then counts ``mismatches``."""
        peer, payload = self.agent.wait_notification(timeout)
        if bytes(payload) != tag:
            raise BenchError(f"expected notification {tag!r}, got {bytes(payload)!r} "
                             f"from {peer!r}")
        return self.mismatches(ids, src_ids, seed)

    def echo(self, local_id: int, remote_id: int, timeout: float) -> int:
        """Answers each notification with a one-block write of layer 0 and a notification,
        until the payload is ``STOP``; returns how many it answered."""
        answered = 0
        while True:
            peer, payload = self.agent.wait_notification(timeout)
            if bytes(payload) == STOP:
                return answered
            self.agent.write(peer, [local_id], [remote_id], layers=[0],
                             notify=b"pong").wait(timeout)
            answered += 1

    def lease(self, request_id: str, ids: list[int], timeout: float) -> int:
        """Leases ``ids`` to the near side for one layer stream (``expect``, ``start_load``);
        returns the epoch its sender needs."""
        load = self.agent.expect(NEAR, request_id, ids, timeout=timeout).start_load()
        self._loads[request_id] = load
        return load.epoch

    def load(self, request_id: str, ids: list[int], src_ids: list[int], seed: int,
             timeout: float) -> dict[str, Any]:
        """Receives the stream of a ``lease`` (``wait_all``) and counts ``mismatches`` against
        the pattern of ``src_ids``; returns when each layer arrived (``time.monotonic()``),
        the payload and the mismatch count."""
        load = self._loads.pop(request_id)
        payload = load.wait_all(timeout)
        return {"arrived": load.layer_times(), "payload": payload,
                "mismatches": self.mismatches(ids, src_ids, seed)}

    def close(self) -> None:
        self.agent.close()


# The Side's verbs a peer runs on command (``setup`` first).
_SIDE_VERBS = ("place", "fill", "wipe", "mismatches", "check_after_notification", "echo",
               "lease", "load")


class FarSide:
    """What the peer process hosts: ``setup`` builds a fresh ``Side`` (closing the last one)
    and answers its listen address; the ``Side``'s verbs then run on it."""

    def __init__(self) -> None:
        self.side: Side | None = None

    def setup(self, *args: Any) -> tuple[str, int]:
        self.close()
        self.side = Side(*args)
        return self.side.agent.listen()

    def __getattr__(self, verb: str) -> Any:
        if verb not in _SIDE_VERBS:
            raise AttributeError(f"{type(self).__name__} has no command {verb!r}")
        if self.side is None:
            raise BenchError(f"no setup yet: {verb!r} needs a Side")
        return getattr(self.side, verb)

    def close(self) -> None:
        side, self.side = self.side, None
        if side is not None:
            side.close()


class Peer(Child):
    """The peer process, a ``FarSide`` in a ``harness.Child``: every reply has a deadline of
    ``timeout`` seconds, and whatever fails there is a ``BenchError`` here."""

    def __init__(self, timeout: float) -> None:
        super().__init__(FarSide, name="kvmove-bench-peer", label="peer process",
                         timeout=timeout, idle_exit=_PEER_IDLE_SECONDS)

    def failure(self, text: str, kind: str = "", message: str = "") -> Exception:
        return BenchError(text)


def ping(agent: Agent, peer: str, local_id: int, remote_id: int, timeout: float) -> None:
    """One round trip with a peer running ``Side.echo``: a one-block write of layer 0 with a
    notification, answered the same way."""
    transfer = agent.write(peer, [local_id], [remote_id], layers=[0], notify=b"ping")
    agent.wait_notification(timeout)
    transfer.wait(timeout)


def stop_echo(agent: Agent, peer: str, local_id: int, remote_id: int, timeout: float) -> None:
    agent.write(peer, [local_id], [remote_id], layers=[0], notify=STOP).wait(timeout)


def connect_pair(peer: Channel, layout: KVSpec, num_blocks: int, agent_kwargs: dict[str, Any],
                 timeout: float, wrap: str | None = None, device: str | None = None) -> Side:
    """A fresh ``Side`` named ``FAR`` in the peer process and one named ``NEAR`` here, each
    with ``num_blocks`` blocks (of engine ``wrap``'s tensors, or in ``device``'s memory, if
    given), connected through the peer's metadata listener."""
    host, port = peer.call("setup", FAR, layout, num_blocks, agent_kwargs, wrap, device)
    near = Side(NEAR, layout, num_blocks, agent_kwargs, wrap, device)
    try:
        near.agent.connect(host, port, timeout=timeout)
    except BaseException:
        near.close()
        raise
    return near
