"""The decode's part of ``PDWorker``: each request's prompt KV loaded from its prefill into the
blocks vLLM allocated for it.

A load (``_Incoming``) runs in a pool thread, one state after the other::

    CONNECTING --offered--> OFFERED --ended--> ENDED
        \\__________________ended______________/^

CONNECTING: finding the prefill's agent (connected on first use, and again whenever it is no
live peer: it failed, restarted, or this side cut it off). OFFERED: the blocks are leased (an
epoch and the ``load_timeout`` deadline) and the lease was offered to the prefill, which
streams into it (from prefill ranks of another tensor parallelism: one lease per rank whose
heads this rank needs, each in a staging area of that rank's layout, converted on arrival;
``tp.py``). ENDED: the load completed or failed; on failure its blocks are load errors (vLLM
recomputes them), reported only once no byte of the prefill's can land in them any more. A
load with no blocks (the request was aborted before vLLM allocated any, or the decode has the
whole prompt) offers nothing, which tells the prefill to let its blocks go.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kvmove
from kvmove.agent_stats import trouble_note
from kvmove.errors import ChecksumError, ConfigError
from kvmove.integrations.vllm.pd_specs import LoadSpec
from kvmove.integrations.vllm.tally import Tally
from kvmove.integrations.vllm.tp import Source, rank_heads, share_key, sources
from kvmove.staging import StagedLoad, StagingArea

__all__ = ["Load", "PDDecodeWorker"]

# Under "vllm.": vLLM's handlers print it beside its own lines.
logger = logging.getLogger("vllm.kvmove.pd_decode")

STAGING_POLL_SECONDS = 0.005   # while a staging area has no room for a load


class Load(enum.Enum):
    """Where a request's load is (see the module's docstring)."""

    CONNECTING = "connecting"
    OFFERED = "offered"
    ENDED = "ended"


@dataclass(eq=False)
class _Incoming:
    spec: LoadSpec
    state: Load = Load.CONNECTING
    # One per prefill rank loaded from: the lease on the cache (equal TP), or on a staging
    # area converted into it. Empty once OFFERED: offered nothing.
    loads: list[kvmove.LoadStream | StagedLoad] = field(default_factory=list)

    @property
    def streams(self) -> list[kvmove.LoadStream]:
        return [load.stream if isinstance(load, StagedLoad) else load for load in self.loads]

    def offered(self) -> None:
        assert self.state is Load.CONNECTING, f"{self.spec.req_id}: {self.state}"
        self.state = Load.OFFERED

    def ended(self) -> None:
        assert self.state is not Load.ENDED, f"{self.spec.req_id}: ended twice"
        self.state = Load.ENDED


class PDDecodeWorker:
    """Loads requests' prompt KV from their prefills; reports what arrived and what failed."""

    def __init__(self, agent: kvmove.Agent, timeout: float, lock: threading.Condition,
                 pool: ThreadPoolExecutor, tp_rank: int = 0, tp_size: int = 1,
                 total_kv_heads: int | None = None, staging_blocks: int = 0,
                 agent_kwargs: dict[str, Any] | None = None, tally: Tally | None = None) -> None:
        self.agent = agent
        self.tally = tally or Tally()   # what vLLM's metrics show (get_kv_connector_stats)
        self.tp_rank, self.tp_size = tp_rank, tp_size  # this decode rank's
        # the model's KV heads (None: this rank's times tp_size)
        self.total_kv_heads = total_kv_heads or agent.cache.layout.num_kv_heads * tp_size
        # staging blocks per prefill rank of another TP (0: a quarter of the cache's)
        self.staging_blocks = staging_blocks or max(1, agent.cache.num_blocks // 4)
        self._agent_kwargs = agent_kwargs or {}   # for the staging areas' agents
        self.timeout = timeout     # load_timeout: every step of a load
        self._lock = lock          # the PDWorker's: notified when a load ends
        self._pool = pool
        self._incoming: dict[str, _Incoming] = {}        # by request id, until ended
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self._peers: dict[tuple[str, str, int], str] = {}   # (agent, host, port) -> peer
        self._staging: dict[tuple[str, int, int], StagingArea] = {}  # (host, port, TP)
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
            self._offer(incoming)
            logger.debug("kvmove: load %s: offered to %d prefill rank(s) after %.1f ms",
                         spec.req_id, len(incoming.loads), 1e3 * (time.monotonic() - started))
            deadline = time.monotonic() + self.timeout + 1.0
            for load in incoming.loads:
                load.wait_all(timeout=max(0.001, deadline - time.monotonic()))
            if incoming.loads:
                self._loaded(spec, started)
            errors: list[int] = []
        except ChecksumError as error:
            errors = self._bad_blocks(incoming)
            self.tally.count("failed_loads")
            logger.warning("kvmove: load of %s: %s", spec.req_id, error)
        except Exception as error:  # noqa: BLE001 - any failure: recompute, never hang
            errors = list(spec.blocks)
            self.tally.count("failed_loads")
            logger.warning("kvmove: load of %s from %s:%d failed after %.1f s: %s%s",
                           spec.req_id, spec.remote_host, spec.remote_port,
                           time.monotonic() - started, error, self._trouble(incoming))
        if incoming.loads and errors:
            self._release(incoming)
        self._end(incoming, errors)

    def _offer(self, incoming: _Incoming) -> None:
        """Leases the request's blocks to each prefill rank it loads from and offers the lease
        for ``spec.key`` (``Agent.offer``); no blocks: offers nothing, and the prefill lets its
        blocks go."""
        spec = incoming.spec
        found = self._sources(spec)
        loads: list[kvmove.LoadStream | StagedLoad] = []
        try:
            for source in found:
                load = self._offer_one(spec, source, len(found) == 1 and source.shares == 1
                                       and source.num_heads == self.agent.cache.layout
                                       .num_kv_heads)
                if load is not None:
                    loads.append(load)
        finally:   # what was offered is released on failure, never lost
            with self._lock:
                incoming.loads = loads
                incoming.offered()

    def _offer_one(self, spec: LoadSpec, source: Source, identical: bool
                   ) -> kvmove.LoadStream | StagedLoad | None:
        port = spec.remote_port + source.rank
        key = share_key(spec.key, source.share, source.shares)
        if identical:   # the prefill rank of this rank's own heads: straight into the cache
            peer = self._peer(self.agent, spec.remote_host, port)
            return self.agent.offer(peer, key, spec.blocks, timeout=self.timeout)
        area = self._staging_area(spec.remote_host, port, source)
        peer = self._peer(area.agent, spec.remote_host, port)
        if not spec.blocks:
            area.agent.offer(peer, key, [], timeout=self.timeout)
            return None
        deadline = time.monotonic() + self.timeout
        while True:   # staging room is back-pressure: wait for it, up to the load's deadline
            load = area.offer(peer, key, spec.blocks, spec.num_tokens, timeout=self.timeout)
            if load is not None:
                return load
            if time.monotonic() > deadline:
                raise TimeoutError(f"no room in staging area {area.agent.name} for "
                                   f"{len(spec.blocks)} blocks within {self.timeout:.0f} s")
            time.sleep(STAGING_POLL_SECONDS)

    def _trouble(self, incoming: _Incoming) -> str:
        """What the agents of a failed load counted going astray (``trouble_note``)."""
        agents = {load.area.agent if isinstance(load, StagedLoad) else self.agent
                  for load in incoming.loads} or {self.agent}
        return trouble_note(agents)

    def _bad_blocks(self, incoming: _Incoming) -> list[int]:
        """The blocks a checksum failure spoiled: those the stream names on the cache's own
        lease; every block of a staged one (its names are staging blocks)."""
        if len(incoming.loads) == 1 and isinstance(incoming.loads[0], kvmove.LoadStream):
            return incoming.loads[0].bad_blocks()
        return list(incoming.spec.blocks)

    def _loaded(self, spec: LoadSpec, started: float) -> None:
        nbytes = len(spec.blocks) * self.agent.cache.block_nbytes
        self.tally.loaded(nbytes, time.monotonic() - started)
        logger.info("kvmove: loaded %s (%s): %d tokens, %d blocks, %d bytes in %.1f ms",
                    spec.req_id, spec.mode.value, spec.num_tokens, len(spec.blocks), nbytes,
                    1e3 * (time.monotonic() - started))

    def _release(self, incoming: _Incoming) -> None:
        """Cancels a failed load's leases and waits until no byte can land in its blocks: vLLM
        recomputes into the same blocks once their errors are reported. A prefill that was cut
        off while it could still write them keeps them quarantined until its process exits
        (docs/streaming.md, "Quarantine"); the request waits that long rather than compute on
        KV a late write could change. (A staged load's own blocks are staging blocks: nothing
        was converted into the cache's after the failure.)"""
        for load in incoming.loads:
            load.cancel()
        for stream in incoming.streams:
            if stream.wait_released(self.timeout):
                continue
            logger.error("kvmove: lease of %s not released within %.0f s: its prefill was cut "
                         "off and may still write its blocks; the request waits until it exits",
                         incoming.spec.req_id, self.timeout)
            while not stream.wait_released(self.timeout):
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

    def _sources(self, spec: LoadSpec) -> list[Source]:
        """The prefill ranks this decode rank loads from. Equal TP: the same rank (its agent
        listens on ``remote_port + rank``), which holds the same KV heads (every decode rank
        loaded from rank 0's port: rank 1 got rank 0's heads). Unequal TP: each rank whose
        heads this one needs (``tp.sources``). The prefill's TP is its answer's ``tp_size``;
        where no answer came first (push: both instances got the request at once), its rank
        0 agent's metadata tells (the heads it holds of the model's).

        Raises:
            ConfigError: a TP size that does not split the model's heads evenly: the blocks
                are recomputed.
        """
        remote = spec.remote_tp_size
        if remote is None:
            peer = self._peer(self.agent, spec.remote_host, spec.remote_port)
            _, count, total = self.agent.peer_kv_heads(peer)
            if total != self.total_kv_heads or total % count:
                raise ConfigError(f"the prefill at {spec.remote_host}:{spec.remote_port} "
                                  f"holds {count} of {total} KV heads, this model has "
                                  f"{self.total_kv_heads}")
            remote = total // count
        return sources(self.total_kv_heads, remote, self.tp_size, self.tp_rank)

    def _staging_area(self, host: str, port: int, source: Source) -> StagingArea:
        """The staging area for the prefill rank at ``host:port`` (made on first use, kept):
        its blocks in that rank's layout, converted into this rank's heads."""
        with self._connect_lock:
            area = self._staging.get((host, port, source.num_heads))
            if area is None:
                cache = self.agent.cache
                layout = dataclasses.replace(cache.layout, num_kv_heads=source.num_heads)
                first, count = rank_heads(self.total_kv_heads, self.tp_size, self.tp_rank)
                started = time.monotonic()
                area = StagingArea(f"{self.agent.name}/staging-{host}:{port}", cache,
                                   sender_layout=layout, sender_order=cache.order,
                                   num_blocks=self.staging_blocks, sender_kv_heads=source.heads,
                                   kv_heads=(first, self.total_kv_heads), **self._agent_kwargs)
                self._staging[(host, port, source.num_heads)] = area
                logger.info("kvmove: staging area %s: %d blocks for a prefill rank of %d KV "
                            "heads, made in %.0f ms", area.agent.name, self.staging_blocks,
                            source.num_heads, 1e3 * (time.monotonic() - started))
            return area

    def _peer(self, agent: kvmove.Agent, host: str, port: int) -> str:
        """The prefill agent at ``host:port`` as ``agent``'s peer, connected to again when it
        is no live peer (it failed or restarted, or this side cut it off). A live one is kept:
        a connect makes fresh endpoints both ways, which would fail the loads in flight from
        it."""
        with self._connect_lock:
            name = self._peers.get((agent.name, host, port))
            if name is None or not agent.peer_alive(name):
                name = agent.connect(host, port, timeout=self.timeout)
                self._peers[(agent.name, host, port)] = name
            return name

    @property
    def agents(self) -> list[kvmove.Agent]:
        """This rank's agent and its staging areas' (for their counters)."""
        with self._connect_lock:
            return [self.agent, *(area.agent for area in self._staging.values())]

    def close(self) -> None:
        """Closes the staging areas' agents (their loads fail)."""
        with self._connect_lock:
            areas, self._staging = list(self._staging.values()), {}
        for area in areas:
            area.close()
