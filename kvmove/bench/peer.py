"""The two sides of ``kvmove-bench transfer`` (and ``stream``): a ``Side`` (cache + agent + the
data pattern that lets every byte be verified) here, and a ``Peer`` process driving another
``Side`` through ``harness.Child``, every reply with a deadline."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvmove.agent import Agent
from kvmove.bench.engine_caches import allocate, block_words, native_words, wrap_engine
from kvmove.bench.harness import Child
from kvmove.bench.report import BenchError
from kvmove.bench.transfer_report import Registration
from kvmove.errors import ConfigError, KVMoveError
from kvmove.kv_cache import KVCache
from kvmove.layout import KVLayout

__all__ = ["FAR", "FarSide", "NEAR", "Peer", "STOP", "Side", "connect_pair", "ping",
           "stop_echo"]

NEAR, FAR = "bench-near", "bench-far"
_WIPE = np.uint64(0xA5A5A5A5A5A5A5A5)
_PEER_IDLE_SECONDS = 600.0  # a peer without commands this long assumes we are gone
STOP = b"stop"  # the notification that ends Side.echo


# --- the data pattern -----------------------------------------------------------------------

def _base(seed: int, num_words: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**64 - 1, size=num_words, dtype=np.uint64, endpoint=True)


def _keys(seed: int, layer: int, src_ids: np.ndarray) -> np.ndarray:
    """One 64-bit key per (layer, source block): splitmix64 of (seed, layer, id)."""
    x = src_ids.astype(np.uint64) + np.uint64(((seed & 0xFFFF) << 48) | ((layer + 1) << 32))
    x = x * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _cache(layout: KVLayout, num_blocks: int,
           wrap: str | None) -> tuple[KVCache, list[list[np.ndarray]], float]:
    """The cache, its ``block_words`` and the seconds ``KVCache.wrap`` took (0 for a cache
    kvmove allocates). Every page is written before anything is timed, so no page fault
    counts as registration."""
    if wrap is None:
        cache = KVCache(layout, num_blocks)
        words = native_words(cache)
        _touch(words)
        return cache, words, 0.0
    tensors = allocate(wrap, layout, num_blocks)
    words = block_words(wrap, tensors, num_blocks)
    _touch(words)
    start = time.perf_counter()
    cache = wrap_engine(wrap, tensors, layout, pool=True)
    return cache, words, time.perf_counter() - start


def _touch(words: list[list[np.ndarray]]) -> None:
    for planes in words:
        for plane in planes:
            plane.fill(0)


class Side:
    """One process's cache and agent, and the pattern operations on its blocks.

    Args:
        wrap: None for a ``KVCache`` kvmove allocates; else an engine of
            ``engine_caches.WRAP_FORMATS`` whose tensors (numpy) are allocated and wrapped,
            with a ``BlockPool`` so both kinds of cache place blocks alike.

    Attributes:
        registration: how long making the cache and agent took (``Registration``).
    """

    def __init__(self, name: str, layout: KVLayout, num_blocks: int,
                 agent_kwargs: dict[str, Any], wrap: str | None = None) -> None:
        if layout.bytes_per_block_per_layer % 8:
            raise ConfigError(f"bytes per block per layer must be a multiple of 8, got "
                              f"{layout.bytes_per_block_per_layer}")
        self.cache, self.words, wrap_seconds = _cache(layout, num_blocks, wrap)
        start = time.perf_counter()
        try:
            self.agent = Agent(name, self.cache, **agent_kwargs)
        except KVMoveError as error:
            raise BenchError(f"cannot create agent {name!r} with {agent_kwargs}: "
                             f"{error}") from error
        self.registration = Registration(wrap or "native", layout.block_size,
                                         num_blocks * layout.bytes_per_block, wrap_seconds,
                                         time.perf_counter() - start)
        self._held: list[int] = []
        self._loads: dict[str, Any] = {}  # leased, not yet loaded

    def place(self, num_blocks: int, placement: str, seed: int) -> list[int]:
        """Owns ``num_blocks`` blocks placed as ``placement`` (releasing the previous ones)."""
        pool = self.cache.pool
        if self._held:
            pool.free(self._held)
        if placement == "allocator":
            self._held = pool.allocate(num_blocks)
        else:
            every = pool.allocate(self.cache.num_blocks)
            order = np.random.default_rng(seed).permutation(len(every))
            self._held = [every[i] for i in order[:num_blocks]]
            pool.free([every[i] for i in order[num_blocks:]])
        return list(self._held)

    def fill(self, ids: list[int], seed: int) -> None:
        ids_arr = np.asarray(ids)
        base = _base(seed, self.num_words)
        for layer, planes in enumerate(self.words):
            pattern = base ^ _keys(seed, layer, ids_arr)[:, None]
            for plane, part in zip(planes, np.split(pattern, len(planes), axis=1)):
                plane[ids_arr] = part

    def wipe(self, ids: list[int]) -> None:
        ids_arr = np.asarray(ids)
        for planes in self.words:
            for plane in planes:
                plane[ids_arr] = _WIPE

    @property
    def num_words(self) -> int:
        """uint64 words of one block of one layer, all its planes."""
        return sum(plane.shape[1] for plane in self.words[0])

    def mismatches(self, ids: list[int], src_ids: list[int], seed: int) -> int:
        """(layer, block) pairs of ``ids`` not holding the pattern of ``src_ids`` (same order)."""
        base, ids_arr, src_arr = _base(seed, self.num_words), np.asarray(ids), \
            np.asarray(src_ids)
        bad = 0
        for layer, planes in enumerate(self.words):
            expected = base ^ _keys(seed, layer, src_arr)[:, None]
            got = np.concatenate([plane[ids_arr] for plane in planes], axis=1)
            if not np.array_equal(got, expected):
                bad += int(np.count_nonzero((got != expected).any(axis=1)))
        return bad

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


def connect_pair(peer: Peer, layout: KVLayout, num_blocks: int, agent_kwargs: dict[str, Any],
                 timeout: float, wrap: str | None = None) -> Side:
    """A fresh ``Side`` named ``FAR`` in the peer process and one named ``NEAR`` here, each
    with ``num_blocks`` blocks (of engine ``wrap``'s tensors, if given), connected through
    the peer's metadata listener."""
    address = peer.call("setup", FAR, layout, num_blocks, agent_kwargs, wrap)
    near = Side(NEAR, layout, num_blocks, agent_kwargs, wrap)
    try:
        near.agent.connect(*address, timeout=timeout)
    except BaseException:
        near.close()
        raise
    return near
