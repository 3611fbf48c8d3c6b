"""Agent: moves KV blocks between this process's KVCache and its peers' (see docs/transfer.md).

The byte-moving core is C++ (``csrc/transport/agent.h``): one UCX worker, a progress thread,
one-sided put/get of coalesced block runs, notifications by active message. This module is
its Python face: construction from a ``KVCache``, the metadata side channel (``listen`` /
``connect``), transfers and the context-manager protocol.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence

from kvmove import _C
from kvmove.agent_stats import AgentStats
from kvmove.auth import DeploymentKey, resolve_key
from kvmove.bootstrap import (
    WILDCARDS,
    ListenerStats,
    MetadataServer,
    advertised_host,
    exchange,
    is_loopback,
    net_devices_for,
)
from kvmove.errors import ConfigError, PeerError
from kvmove.kv_cache import KVCache, block_shape
from kvmove.stream import LoadStream, Offer, SaveStream
from kvmove.transfer import Transfer, TransferState, TransferStats, traffic_class
from kvmove.validation import require_positive_finite, require_positive_int

__all__ = ["Agent", "AgentStats", "Transfer", "TransferState", "TransferStats"]

# Two gaps in _C.pyi (pybind11-stubgen's, not edited by hand), silenced with
# `type: ignore[arg-type]` where met: the block-id caster (bindings/ids.h) is named list[int]
# but takes any sequence of ints, and a std::string parameter is named str but takes bytes too.
ERROR_MODES = ("peer", "none")
SAME_HOST_PATHS = ("map", "ucx")


def _weak_add_peer(agent: Agent) -> Callable[[bytes], str]:
    ref = weakref.ref(agent)

    def add_peer(verified: bytes) -> str:
        target = ref()
        if target is None:
            raise PeerError("the listening agent is gone")
        # A connecting agent we have as a peer asks for fresh endpoints (it may have dropped
        # ours, or its earlier connect timed out before it saw our answer): take it again.
        return target._core.add_peer(verified, rejoin=True)  # type: ignore[arg-type]

    return add_peer


class Agent:
    """One UCX endpoint set for one ``KVCache``: peers, transfers and notifications.

    Example:
        >>> with kvmove.Agent("prefill-0", cache) as agent:
        ...     peer = agent.connect("decode-host", 5555)   # the decode side listen()s
        ...     agent.write(peer, ids, remote_ids, notify=b"req-42").wait(timeout=5.0)

    Args:
        name: how peers address this agent (1..255 printable bytes, unique among them).
        cache: the KV memory to register and expose to peers: a ``KVCache``, or one that
            ``KVCache.wrap`` made of an engine's tensors (each registered once).
        transports: UCX transport list (``"tcp"``, ``"sm"``, ``"posix,cma"``, or a sequence of
            names); ``None`` lets UCX choose.
        error_mode: ``"peer"`` detects a dead peer and fails its transfers with ``PeerError``;
            on one host it keeps shared memory and cma, as kvmove sets UCX up for it
            (docs/transfer.md, "Error mode"). ``"none"`` (expert) does not: waits still end at
            their deadlines, and a dead peer is never reported as such.
        peer_timeout: seconds of silence after which UCX declares a peer dead (keepalive).
        cancel_timeout: seconds a stream's sender has to answer a Cancel of its lease (it
            stops and flushes) before it is disconnected.
        ack_timeout: seconds a stream's receiver has to acknowledge the final message before
            the stream fails.
        checksums: streams sent by this agent carry per-block checksums (XXH3), which their
            receiver verifies before the KV is used; a mismatch fails the load with
            ``ChecksumError`` (``stream_to(checksums=...)`` decides per stream). Default
            (``None``): on for a cache in host memory, off for one on a device (checksums are
            computed on the host; ``True`` there is a ConfigError at ``stream_to``).
        faults: fault injection for tests, e.g. ``"fail_post=7,drop_message=0.01,seed=3"``
            (``csrc/transport/faults.h`` lists them); default: ``$KVMOVE_FAULTS``, else none.
            Off, it costs nothing.
        key: the deployment key (``kvmove.auth``): only agents holding it become peers.
            Default: ``$KVMOVE_KEY``, ``$KVMOVE_KEY_FILE``, else this user's host key (enough
            for agents on one host; another host's agents need a key of their own).
        host: the address this agent serves on. UCX's network transports are kept to the
            interface holding it ("lo" for loopback, the default), and ``listen()`` binds it.
            ``"0.0.0.0"`` leaves every interface to UCX.
        net_devices: UCX's device list (``UCX_NET_DEVICES`` syntax, e.g. ``"mlx5_0:1"`` for an
            InfiniBand port), instead of the interface of ``host``; ``"all"`` for every one.
            Default: ``$UCX_NET_DEVICES`` when set (an RDMA host keeps its devices), else the
            interface of ``host``.
        max_peers: peers this agent accepts at most (each holds a UCX endpoint).
        same_host: ``"map"`` (default): a peer on this host (same boot, network and pid
            namespace, same user) maps this agent's cache and this agent maps the peer's, so a
            transfer is one memcpy into or out of its blocks: no socket, no kernel copy, no
            CPU on the other side. Both agents must allow it, and both caches must be
            kvmove's own host memory (a wrapped engine tensor or device memory keeps UCX).
            ``"ucx"``: neither offer nor map; UCX carries everything. Notifications, stream
            messages and failure detection go over UCX either way (``peer_path``).
        copy_threads: threads copying mapped transfers (None: one per two CPUs, 2 to 4).
        kv_heads: ``(first, total)`` for a tensor-parallel rank: its cache holds the model's KV
            heads ``[first, first + layout.num_kv_heads)`` of ``total`` (rank r of TP=2 over 8
            heads: ``(4 * r, 8)``). The metadata carries it, and only agents holding the same
            heads are identical peers (``kvmove.StagingArea`` converts between others).
            None: every head.

    Layer streaming: ``stream_to`` and ``expect`` (docs/streaming.md).
    """

    def __init__(self, name: str, cache: KVCache, *, transports: str | Sequence[str] | None = None,
                 error_mode: str = "peer", peer_timeout: float = 10.0,
                 cancel_timeout: float = 5.0, ack_timeout: float = 10.0,
                 checksums: bool | None = None, faults: str | None = None,
                 key: bytes | str | None = None, host: str = "127.0.0.1",
                 net_devices: str | None = None, max_peers: int = 1024,
                 kv_heads: tuple[int, int] | None = None, same_host: str = "map",
                 copy_threads: int | None = None) -> None:
        if error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {error_mode!r}")
        if same_host not in SAME_HOST_PATHS:
            raise ConfigError(f"same_host must be one of {SAME_HOST_PATHS}, got {same_host!r}")
        if copy_threads is not None:
            require_positive_int("copy_threads", copy_threads)
        if not isinstance(cache, KVCache):
            raise ConfigError(f"cache must be a kvmove.KVCache, got {type(cache).__name__}")
        if transports is not None and not isinstance(transports, str):
            transports = ",".join(transports)
        for what, value in (("peer_timeout", peer_timeout), ("cancel_timeout", cancel_timeout),
                            ("ack_timeout", ack_timeout)):
            require_positive_finite(what, value)
        if faults is None:
            faults = os.environ.get("KVMOVE_FAULTS", "")
        require_positive_int("max_peers", max_peers)
        self.key: DeploymentKey = resolve_key(key)
        self.host = host
        if net_devices is None:  # the user's UCX_NET_DEVICES wins over host's interface
            devices = "all" if os.environ.get("UCX_NET_DEVICES") else net_devices_for(host)
        else:
            devices = net_devices
        shape = block_shape(cache.layout, cache.order, kv_heads)
        self._core = _C.Agent(name, cache._core, shape, transports or "", error_mode == "peer",
                              float(peer_timeout), float(cancel_timeout), float(ack_timeout),
                              faults, "" if devices == "all" else devices, max_peers,
                              same_host == "map", copy_threads or 0)
        self.cache = cache
        self.checksums = cache.device == "cpu" if checksums is None else bool(checksums)
        self._server: MetadataServer | None = None
        self._advertised: tuple[str, int] | None = None  # what listen() told

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def incarnation(self) -> int:
        """This agent's run, a random nonzero number: the high 32 bits of its leases' epochs.
        A peer that comes back under the same name has another."""
        return self._core.incarnation

    def faults_injected(self) -> dict[str, int]:
        """What fault injection did so far, by kind (empty when it is off)."""
        return dict(self._core.fault_counts())

    def stats(self) -> AgentStats:
        """Counters of this agent's streams and leases (``AgentStats``)."""
        s = self._core.stream_stats()
        return AgentStats(**{f: getattr(s, f) for f in AgentStats.__dataclass_fields__})

    @property
    def peers(self) -> list[str]:
        """Names of the peers added, dead ones included until removed."""
        return self._core.peers

    def peer_transports(self, name: str) -> list[tuple[str, str]]:
        """The ``(transport, device)`` pairs UCX chose to reach the live peer ``name``, each
        once, e.g. ``[("sysv", "memory"), ("posix", "memory"), ("cma", "memory")]`` for a peer
        on this host, ``[("tcp", "eth0")]`` for one behind a socket (docs/transfer.md, "Error
        mode").

        Raises:
            PeerError: no such peer, or it failed.
        """
        return self._core.peer_transports(name)

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (``add_peer`` on its side): opaque bytes,
        versioned, and signed with the deployment key."""
        return self.key.sign(self._core.metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Adds the agent that ``metadata`` describes as a peer; returns its name.

        The signature is checked first: metadata not signed with this agent's deployment key
        never reaches the core or UCX.

        A peer of that name that comes back with new metadata (it restarted) replaces the
        old one: the old connection is closed first (its remote key dropped before it), and
        whatever was in flight with it fails with ``PeerError``. A new run is told by its
        incarnation alone (one this agent has not seen under the name), never by the clock of
        its host; a run that another replaced is refused as a replay.

        Raises:
            MetadataError: not signed with this deployment's key; truncated, corrupted or
                foreign metadata.
            PeerError: the same peer is already added, a run of it that another replaced (a
                replay), the agent has ``max_peers`` already, or the peer cannot be reached.
        """
        return self._core.add_peer(self.key.verify(metadata))  # type: ignore[arg-type]

    def peer_path(self, name: str) -> str:
        """How transfers with peer ``name`` move: ``"mapped"`` (a memcpy into its memory,
        mapped here: same host, both agents allow it) or ``"ucx"``.

        Raises:
            PeerError: unknown peer.
        """
        return self._core.peer_path(name)

    def peer_kv_heads(self, name: str) -> tuple[int, int, int]:
        """``(first, count, total)``: the model's KV heads the peer's cache holds, as its
        metadata says (its ``kv_heads``; ``(0, n, n)``: all). PeerError for an unknown peer."""
        shape = self._core.peer_shape(name)
        return shape.head_first, shape.num_kv_heads, shape.total_kv_heads

    def peer_alive(self, name: str) -> bool:
        """Whether ``name`` is a peer this agent can reach: added, and not failed (``peers``
        lists failed ones too, until removed). False: ``connect`` to it again."""
        return self._core.peer_alive(name)

    def remove_peer(self, name: str) -> None:
        """Fails the peer's pending transfers and streams (``PeerError``), then closes its
        endpoint after flushing what is already posted."""
        self._core.remove_peer(name)

    def write(self, peer: str, local_ids: Sequence[int], remote_ids: Sequence[int],
              layers: Sequence[int] | None = None, notify: bytes | None = None, *,
              traffic: str = "handoff") -> Transfer:
        """One-sided put of block ``local_ids[i]`` into ``remote_ids[i]`` of ``peer``.

        Args:
            layers: the layers to move (all when None).
            notify: up to 64 KiB delivered to the peer (``notifications()``) once every byte is
                in place there.
            traffic: what it is for, most urgent first: ``"handoff"`` (a request's KV to its
                decode; streams are hand-offs), ``"prefetch"``, ``"offload"``
                (``TRAFFIC_CLASSES``; docs/transfer.md, "Traffic classes").

        Raises:
            ConfigError: mismatched lengths, layouts, a layer out of range or an unknown
                ``traffic``.
            BlockError: an id out of range, or a destination block twice.
            PeerError: unknown or dead peer.
        """
        args = (peer, local_ids, remote_ids, _layers(layers), notify, traffic_class(traffic))
        return Transfer(self._core.write(*args))  # type: ignore[arg-type]

    def read(self, peer: str, local_ids: Sequence[int], remote_ids: Sequence[int],
             layers: Sequence[int] | None = None, notify: bytes | None = None, *,
             traffic: str = "handoff") -> Transfer:
        """One-sided get of ``peer``'s block ``remote_ids[i]`` into ``local_ids[i]`` (as
        ``write``, the other way; a read from a store ahead of use is ``"prefetch"``)."""
        args = (peer, local_ids, remote_ids, _layers(layers), notify, traffic_class(traffic))
        return Transfer(self._core.read(*args))  # type: ignore[arg-type]

    def send(self, peer: str, payload: bytes) -> Transfer:
        """Sends ``payload`` (up to 64 KiB) to ``peer`` as a notification alone (NIXL's
        ``send_notif``): it arrives in the peer's ``notifications()`` after everything sent to
        it before. The ``Transfer`` (of no bytes) is DONE once the message is out.

        Raises:
            ConfigError: ``payload`` over 64 KiB.
            PeerError: unknown or dead peer.
        """
        return Transfer(self._core.notify(peer, bytes(payload)))

    def notifications(self) -> list[tuple[str, bytes]]:
        """Received ``(peer name, payload)`` pairs, oldest first; drains the queue."""
        return self._core.notifications()

    def wait_notification(self, timeout: float) -> tuple[str, bytes]:
        """The oldest notification, waiting up to ``timeout`` seconds for one.

        The calling thread progresses the transport itself while it waits (the agent's
        progress thread steps aside), sleeping on the transport's events when nothing is
        under way: a notification reaches the caller straight from the socket, without a
        hand-off between threads (docs/transfer.md, "A one-block write over tcp").

        Raises:
            TimeoutError: none came in time (or the agent closed).
        """
        return self._core.wait_notification(timeout)

    def listen(self, host: str | None = None, port: int = 0,
               advertise: str | None = None) -> tuple[str, int]:
        """Serves metadata exchange on ``host:port`` (default: the agent's ``host``; port 0 =
        any free port) until ``close()``; returns the address peers connect to.

        Each agent that ``connect``s with metadata signed by this deployment's key becomes a
        peer here, and receives this agent's metadata.

        ``advertise``: the host peers are told (default: ``host``; for a wildcard such as
        ``"0.0.0.0"``, this host's address on its default route: a wildcard is never
        advertised).

        Raises:
            ConfigError: closed, already listening, a non-loopback address with only the host
                key (it proves nothing to another host: give a deployment key), or a wildcard
                with no route to tell an address by and no ``advertise``.
        """
        host = self.host if host is None else host
        if self.closed:
            raise ConfigError(f"agent {self.name!r} is closed")
        if self.key.host_only and not is_loopback(host):
            raise ConfigError(f"agent {self.name!r} cannot listen on {host!r} with only the "
                              "host key: anyone reaching it could join. Give a deployment key "
                              "(Agent(key=...), KVMOVE_KEY or KVMOVE_KEY_FILE)")
        if self._server is not None:
            raise ConfigError(f"agent {self.name!r} already listens on {self._server.address}")
        shown = advertised_host(host) if advertise is None else advertise
        if shown in WILDCARDS:
            raise ConfigError(f"agent {self.name!r} cannot advertise the wildcard {shown!r}: "
                              "give an address of this host")
        # The listener thread holds the agent only weakly, and is closed when the agent is
        # collected: an agent dropped without close() must not live on through its listener.
        self._server = MetadataServer(self.metadata(), self.key.verify, _weak_add_peer(self),
                                      host, port)
        weakref.finalize(self, self._server.close)
        self._advertised = (shown, self._server.address[1])
        return (shown, self._server.address[1])

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The address ``listen()`` returned (peers connect there), or None."""
        return self._advertised

    def listener_stats(self) -> ListenerStats | None:
        """What ``listen()``'s listener received (``ListenerStats``: exchanges, refusals,
        unsigned input and how much of it went unanswered), or None when not listening."""
        return None if self._server is None else self._server.stats()

    def connect(self, host: str, port: int, timeout: float = 10.0) -> str:
        """Exchanges metadata with an agent listening at ``host:port``; returns its name.

        Connecting to an agent that is already a peer (the same run) makes fresh endpoints
        both ways: either side may have dropped the other (a disconnect, ``remove_peer``)
        while the other's endpoint looks alive. What was in flight between the two fails with
        ``PeerError`` ("reconnected"); leases that peer had engaged stay quarantined until it
        answers their Cancel over the new connection (docs/streaming.md, "Quarantine").

        Raises:
            ConfigError: ``host`` is another host and this agent serves on loopback (its
                ``host``): UCX could not reach it.
            PeerError: no answer within ``timeout`` seconds, or the other side refused us.
            MetadataError: its answer is not valid metadata.
        """
        require_positive_finite("connect timeout", timeout)
        if is_loopback(self.host) and not is_loopback(host):
            raise ConfigError(f"agent {self.name!r} serves on {self.host} (loopback) and cannot "
                              f"reach {host!r}: create it with host=<an address of this host> "
                              "on the network to use")
        # rejoin: the same run of a peer we have is taken again, on fresh endpoints.
        metadata = self.key.verify(exchange(self.metadata(), host, port, timeout))
        return self._core.add_peer(metadata, rejoin=True)  # type: ignore[arg-type]

    def stream_to(self, peer: str, local_ids: Sequence[int], remote_ids: Sequence[int],
                  request_id: str, *, epoch: int, checksums: bool | None = None) -> SaveStream:
        """Starts streaming one request's KV into ``peer``'s lease ``epoch`` (see kvmove.stream).

        ``local_ids[i]`` of this cache goes to ``remote_ids[i]`` of the peer's, in every layer
        the caller saves. The peer granted the lease (``expect``) and told us ``epoch`` and
        ``remote_ids``; it is asked at once, and nothing is posted before it said yes.

        Args:
            epoch: the receiver's lease (``LoadStream.epoch`` on its side).
            checksums: send per-block checksums for the receiver to verify (default: the
                agent's ``checksums``). Host memory only.

        Raises:
            ConfigError: mismatched lengths or layouts, a bad ``request_id`` (1..256 bytes),
                the same lease already streaming, or checksums from a device cache.
            BlockError: an id out of range, or a destination block twice.
            PeerError: unknown or dead peer, or an epoch of an earlier run of it.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 < epoch < 2**64:
            raise ConfigError(f"epoch must be a lease's epoch (an int in [1, 2**64)), got "
                              f"{epoch!r}")
        sums = self.checksums if checksums is None else bool(checksums)
        core = self._core.stream_to(peer, local_ids, remote_ids,  # type: ignore[arg-type]
                                    request_id, epoch, sums)
        return SaveStream(core, self)

    def expect(self, peer: str, request_id: str, local_ids: Sequence[int], *,
               timeout: float = 60.0) -> LoadStream:
        """Leases ``local_ids`` to ``peer`` for request ``request_id``: its stream may fill them
        until the lease ends. Tell the sender ``LoadStream.epoch`` and ``local_ids``.

        The lease ends when the load completes, fails or is cancelled, and at the latest
        ``timeout`` seconds from now (then the load fails with ``TimeoutError`` and the sender
        is told to stop). Reuse the blocks only once ``LoadStream.released``.

        Raises:
            ConfigError: a bad ``request_id`` or ``timeout``, differing layouts, or the
                request already leased from this peer.
            BlockError: an id out of range or twice.
            PeerError: unknown or dead peer (the sender must be a peer: that is how its death
                is noticed).
        """
        require_positive_finite("timeout", timeout)
        core = self._core.expect(peer, request_id, local_ids,  # type: ignore[arg-type]
                                 float(timeout))
        return LoadStream(core, self)

    def offer(self, peer: str, request_id: str, local_ids: Sequence[int], *,
              timeout: float = 60.0) -> LoadStream | None:
        """Leases ``local_ids`` to ``peer`` for ``request_id`` (as ``expect(...).start_load()``)
        and offers the lease to it: ``peer`` gets an ``Offer`` with the epoch and the ids
        (``offers()`` / ``wait_offer()`` there) and streams into it. This is the hand-off's
        first message; no control plane needs to carry the epoch and ids.

        With no ``local_ids``, tells ``peer`` that none of ``request_id``'s KV is needed here
        (it lets the blocks it holds for it go) and returns None.

        Returns:
            The started ``LoadStream`` (it fails if the offer cannot be sent), or None.

        Raises:
            ConfigError: as ``expect``; also a bad ``timeout``.
            BlockError: an id out of range or twice.
            PeerError: unknown or dead peer.
        """
        require_positive_finite("timeout", timeout)
        if not local_ids:
            self._core.offer_nothing(peer, request_id)
            return None
        core = self._core.offer(peer, request_id, local_ids,  # type: ignore[arg-type]
                                float(timeout))
        return LoadStream(core, self)

    def offers(self) -> list[Offer]:
        """The offers peers made (``Agent.offer`` on their side) and nobody took yet, oldest
        first; drains them. At most 1024 of one peer wait; more are dropped (and counted in
        ``stats().messages_refused``)."""
        return [Offer._from_core(o) for o in self._core.offers()]

    def wait_offer(self, timeout: float) -> Offer:
        """The oldest offer not taken yet, waiting up to ``timeout`` seconds for one.

        Raises:
            TimeoutError: none came in time (or the agent closed).
        """
        require_positive_finite("timeout", timeout)
        return Offer._from_core(self._core.wait_offer(float(timeout)))

    def decline(self, offer: Offer, reason: str) -> None:
        """Tells the offer's peer that this agent will not write its lease: its ``LoadStream``
        fails at once with ``TransferError`` naming ``reason``, and its blocks are free (nothing
        was written). Only before ``stream_to`` into the lease (after it: abort the stream).

        Raises:
            ConfigError: an offer of no blocks, a reason over 64 KiB, or the lease is being
                streamed into.
            PeerError: the peer is no live peer.
        """
        if not isinstance(offer, Offer):
            raise ConfigError(f"decline takes an Offer, got {type(offer).__name__}")
        self._core.decline(offer._core(), str(reason))

    def close(self) -> None:
        """Stops listening and progress, fails pending transfers, releases UCX. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server, self._advertised = None, None
        self._core.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, peers={self.peers})"


def _layers(layers: Sequence[int] | None) -> list[int] | None:
    return None if layers is None else list(layers)

