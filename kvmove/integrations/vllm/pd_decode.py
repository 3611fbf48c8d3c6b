"""The decode's part of ``PDWorker``: each request's prompt KV loaded from its prefill into the
blocks vLLM allocated for it.

A load (``_Incoming``) runs in a pool thread, one state after the other::

    CONNECTING --offered--> OFFERED --ended--> ENDED
        \\__________________ended______________/^

CONNECTING: finding the prefill's agent (connected on first use, and again whenever it is no
live peer: it failed, restarted, or this side cut it off). OFFERED: the blocks are leased (an
epoch and the ``load_timeout`` deadline) and the lease was offered to the prefill, which
streams into it. ENDED: the load
completed or failed; on failure its blocks are load errors (vLLM recomputes them), reported
only once no byte of the prefill's can land in them any more. A load with no blocks (the
request was aborted before vLLM allocated any, or the decode has the whole prompt) offers
nothing, which tells the prefill to let its blocks go.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import kvmove
from kvmove.errors import ChecksumError, ConfigError
from kvmove.integrations.vllm.pd_specs import LoadSpec

__all__ = ["Load", "PDDecodeWorker"]

# Under "vllm.": vLLM's handlers print it beside its own lines.
logger = logging.getLogger("vllm.kvmove.pd_decode")


class Load(enum.Enum):
    """Where a request's load is (see the module's docstring)."""

    CONNECTING = "connecting"
    OFFERED = "offered"
    ENDED = "ended"


@dataclass(eq=False)
class _Incoming:
    spec: LoadSpec
    state: Load = Load.CONNECTING
    stream: kvmove.LoadStream | None = None

    def offered(self, stream: kvmove.LoadStream | None) -> None:  # None: offered nothing
        assert self.state is Load.CONNECTING, f"{self.spec.req_id}: {self.state}"
        self.stream, self.state = stream, Load.OFFERED

    def ended(self) -> None:
        assert self.state is not Load.ENDED, f"{self.spec.req_id}: ended twice"
        self.state = Load.ENDED


class PDDecodeWorker:
    """Loads requests' prompt KV from their prefills; reports what arrived and what failed."""

    def __init__(self, agent: kvmove.Agent, timeout: float, lock: threading.Condition,
                 pool: ThreadPoolExecutor, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.agent = agent
        self.tp_rank, self.tp_size = tp_rank, tp_size  # this decode rank's
        self.timeout = timeout     # load_timeout: every step of a load
        self._lock = lock          # the PDWorker's: notified when a load ends
        self._pool = pool
        self._incoming: dict[str, _Incoming] = {}        # by request id, until ended
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self._peers: dict[tuple[str, int], str] = {}
        self._connect_lock = threading.Lock()

    @property
    def pending(self) -> bool:
        """Some load has not ended yet."""
        return bool(self._incoming)

    @property
    def has_received(self) -> bool:
        return bool(self._received)

    def start(self, loads: list[LoadSpec]) -> None:
        """Starts this step's loads, each in a pool thread."""
        with self._lock:
            incoming = [_Incoming(spec) for spec in loads]
            self._incoming.update((i.spec.req_id, i) for i in incoming)
        for one in incoming:
            self._pool.submit(self._load, one)

    def take_received(self) -> set[str]:
        """Requests whose load ended (vLLM's ``finished_recving``)."""
        with self._lock:
            received, self._received = self._received, set()
        return received

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- one load, in a pool thread ---------------------------------------------------------

    def _load(self, incoming: _Incoming) -> None:
        """Leases the blocks, offers them to the prefill and waits; on any failure the
        blocks are load errors, reported once no byte of the prefill's can land in them."""
        spec = incoming.spec
        started = time.monotonic()
        try:
            peer = self._peer(spec.remote_host, self._remote_port(spec))
            logger.debug("kvmove: load %s: peer %s after %.1f ms", spec.req_id, peer,
                         1e3 * (time.monotonic() - started))
            stream = self._offer(incoming, peer)
            if stream is not None:
                stream.wait_all(timeout=self.timeout + 1.0)
                self._loaded(spec, started)
            errors: list[int] = []
        except ChecksumError as error:
            errors = incoming.stream.bad_blocks() if incoming.stream else list(spec.blocks)
            logger.warning("kvmove: load of %s: %s", spec.req_id, error)
        except Exception as error:  # noqa: BLE001 - any failure: recompute, never hang
            errors = list(spec.blocks)
            logger.warning("kvmove: load of %s from %s:%d failed after %.1f s: %s",
                           spec.req_id, spec.remote_host, spec.remote_port,
                           time.monotonic() - started, error)
        if incoming.stream is not None and errors:
            self._release(incoming)
        self._end(incoming, errors)

    def _offer(self, incoming: _Incoming, peer: str) -> kvmove.LoadStream | None:
        """Leases the request's blocks to ``peer`` and offers the lease for ``spec.key``
        (``Agent.offer``); no blocks: offers nothing, and the prefill lets its blocks go."""
        spec = incoming.spec
        stream = self.agent.offer(peer, spec.key, spec.blocks, timeout=self.timeout)
        with self._lock:
            incoming.offered(stream)
        return stream

    def _loaded(self, spec: LoadSpec, started: float) -> None:
        nbytes = len(spec.blocks) * self.agent.cache.block_nbytes
        logger.info("kvmove: loaded %s (%s): %d tokens, %d blocks, %d bytes in %.1f ms",
                    spec.req_id, spec.mode.value, spec.num_tokens, len(spec.blocks), nbytes,
                    1e3 * (time.monotonic() - started))

    def _release(self, incoming: _Incoming) -> None:
        """Cancels a failed load's lease and waits until no byte can land in its blocks: vLLM
        recomputes into the same blocks once their errors are reported. A prefill that was cut
        off while it could still write them keeps them quarantined until its process exits
        (docs/streaming.md, "Quarantine"); the request waits that long rather than compute on
        KV a late write could change."""
        assert incoming.stream is not None
        incoming.stream.cancel()
        if incoming.stream.wait_released(self.timeout):
            return
        logger.error("kvmove: lease of %s not released within %.0f s: its prefill was cut off "
                     "and may still write its blocks; the request waits until it exits",
                     incoming.spec.req_id, self.timeout)
        while not incoming.stream.wait_released(self.timeout):
            pass

    def _end(self, incoming: _Incoming, errors: list[int]) -> None:
        with self._lock:
            incoming.ended()
            del self._incoming[incoming.spec.req_id]
            if incoming.spec.blocks:
                self._received.add(incoming.spec.req_id)
                self._lock.notify_all()
            self._load_errors.update(errors)

    # ---- peers ------------------------------------------------------------------------------

    def _remote_port(self, spec: LoadSpec) -> int:
        """The prefill rank this decode rank loads from: the same rank (its agent listens on
        ``remote_port + rank``), which holds the same KV heads. Every decode rank loaded from
        rank 0's port: rank 1 got rank 0's heads.

        Raises:
            ConfigError: the prefill's tensor parallelism is not this side's (its ranks hold
                other heads; converting them is not done): the blocks are recomputed.
        """
        remote = self.tp_size if spec.remote_tp_size is None else spec.remote_tp_size
        if remote != self.tp_size:
            raise ConfigError(f"the prefill runs tensor parallelism {remote}, this decode "
                              f"{self.tp_size}: kvmove pairs equal ranks only (recomputing)")
        return spec.remote_port + self.tp_rank

    def _peer(self, host: str, port: int) -> str:
        """The prefill agent at ``host:port``, connected to again when it is no live peer (it
        failed or restarted, or this side cut it off). A live one is kept: a connect makes
        fresh endpoints both ways, which would fail the loads in flight from it."""
        with self._connect_lock:
            name = self._peers.get((host, port))
            if name is None or not self.agent.peer_alive(name):
                name = self.agent.connect(host, port, timeout=self.timeout)
                self._peers[(host, port)] = name
            return name
