"""Agent: moves KV blocks between this process's KVCache and its peers' (see docs/transfer.md).

The byte-moving core is C++ (``csrc/agent.h``): one UCX worker, a progress thread, one-sided
put/get of coalesced block runs, notifications by active message. This module adds the
Python side: construction from a ``KVCache``, the metadata side channel (``listen`` /
``connect``), and the context-manager protocol.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from kvmove import _C
from kvmove.bootstrap import MetadataServer, exchange
from kvmove.errors import ConfigError, PeerError
from kvmove.kv_cache import KVCache, block_shape
from kvmove.stream import LoadStream, SaveStream
from kvmove.validation import require_positive_finite

__all__ = ["Agent", "Transfer", "TransferState", "TransferStats"]

Transfer = _C.Transfer
TransferState = _C.TransferState
TransferStats = _C.TransferStats

ERROR_MODES = ("peer", "none")


def _weak_add_peer(agent: Agent) -> Callable[[bytes], str]:
    ref = weakref.ref(agent)

    def add_peer(metadata: bytes) -> str:
        target = ref()
        if target is None:
            raise PeerError("the listening agent is gone")
        return target.add_peer(metadata)

    return add_peer


class Agent(_C.Agent):
    """One UCX endpoint set for one ``KVCache``: peers, transfers and notifications.

    Args:
        name: how peers address this agent (1..255 printable bytes, unique among them).
        cache: the KV memory to register and expose to peers.
        transports: UCX transport list (``"tcp"``, ``"sm"``, ``"posix,cma"``, or a sequence of
            names); ``None`` lets UCX choose.
        error_mode: ``"peer"`` detects a dead peer and fails its transfers with ``PeerError``
            (UCX then drops the posix/sysv shared-memory transports; tcp and cma remain);
            ``"none"`` keeps shared memory, and waits still end at their deadlines.
        peer_timeout: seconds of silence after which UCX declares a peer dead (keepalive).

    Methods from the core: ``metadata()``, ``add_peer(bytes) -> name``, ``remove_peer(name)``,
    ``peers``, ``write(peer, local_ids, remote_ids, layers=None, notify=None) -> Transfer``,
    ``read(...)``, ``notifications()``, ``wait_notification(timeout)``. Layer streaming:
    ``stream_to`` and ``expect`` (docs/streaming.md).
    """

    def __init__(self, name: str, cache: KVCache, *, transports: str | Sequence[str] | None = None,
                 error_mode: str = "peer", peer_timeout: float = 10.0) -> None:
        if error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {error_mode!r}")
        if not isinstance(cache, KVCache):
            raise ConfigError(f"cache must be a kvmove.KVCache, got {type(cache).__name__}")
        if transports is not None and not isinstance(transports, str):
            transports = ",".join(transports)
        super().__init__(name, cache, block_shape(cache.layout), transports or "",
                         error_mode == "peer", float(peer_timeout))
        self.cache = cache
        self._server: MetadataServer | None = None

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serves metadata exchange on ``host:port`` (0 = any free port) until ``close()``.

        Each agent that ``connect``s becomes a peer here, and receives this agent's metadata.
        """
        if self.closed:
            raise ConfigError(f"agent {self.name!r} is closed")
        if self._server is not None:
            raise ConfigError(f"agent {self.name!r} already listens on {self._server.address}")
        # The listener thread holds the agent only weakly, and is closed when the agent is
        # collected: an agent dropped without close() must not live on through its listener.
        self._server = MetadataServer(self.metadata(), _weak_add_peer(self), host, port)
        weakref.finalize(self, self._server.close)
        return self._server.address

    def connect(self, host: str, port: int, timeout: float = 10.0) -> str:
        """Exchanges metadata with an agent listening at ``host:port``; returns its name.

        Raises:
            PeerError: no answer within ``timeout`` seconds, or the other side refused us.
            MetadataError: its answer is not valid metadata.
        """
        require_positive_finite("connect timeout", timeout)
        return self.add_peer(exchange(self.metadata(), host, port, timeout))

    def stream_to(self, peer: str, local_ids: Sequence[int], remote_ids: Sequence[int],
                  request_id: str) -> SaveStream:
        """Starts streaming one request's KV to ``peer`` layer by layer (see kvmove.stream).

        ``local_ids[i]`` of this cache goes to ``remote_ids[i]`` of the peer's, in every layer
        the caller saves. Everything is checked here, before any byte moves.

        Raises:
            ConfigError: mismatched lengths or layouts, a bad ``request_id`` (1..256 bytes),
                or the same request already streaming to this peer.
            BlockError: an id out of range, or a destination block twice.
            PeerError: unknown or dead peer.
        """
        return SaveStream(super().stream_to(peer, local_ids, remote_ids, request_id), self)

    def expect(self, peer: str, request_id: str, local_ids: Sequence[int]) -> LoadStream:
        """Prepares to receive request ``request_id`` from ``peer`` into ``local_ids``.

        Call ``start_load()`` on the result to start matching the sender's messages.

        Raises:
            ConfigError: a bad ``request_id`` or differing layouts.
            BlockError: an id out of range or twice.
            PeerError: unknown or dead peer (the sender must be a peer: that is how its death
                is noticed).
        """
        return LoadStream(super().expect(peer, request_id, local_ids), self)

    def close(self) -> None:
        """Stops listening and progress, fails pending transfers, releases UCX. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        super().close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, peers={self.peers})"
