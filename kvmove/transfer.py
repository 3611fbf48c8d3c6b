"""Transfer: one batch of block copies between two agents, its state and what it took.

``Agent.write``, ``Agent.read`` and ``Agent.send`` return one; the core's
(``csrc/transport/transfer.h``) is wrapped here so its waits keep their docstrings and types.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmove import _C
from kvmove.errors import ConfigError

__all__ = ["TRAFFIC_CLASSES", "Transfer", "TransferState", "TransferStats", "traffic_class"]

TransferState = _C.TransferState
"""PENDING, then DONE or FAILED.

Example:
    >>> transfer = agent.write(peer, ids, remote_ids)
    >>> transfer.state                    # TransferState.PENDING while ops are in flight
    >>> transfer.wait(timeout=5.0)        # raises instead of ending FAILED
    >>> transfer.state is kvmove.TransferState.DONE
    True
"""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What a transfer moved and how long it took.

    Attributes:
        nbytes: bytes moved.
        num_ops: RMA operations posted, after coalescing adjacent blocks.
        post_seconds: time spent posting them.
        complete_seconds: from the first post to completion (0 while pending).

    Example:
        >>> s = agent.write(peer, ids, remote_ids).stats   # after wait(): complete
        >>> s.nbytes / s.complete_seconds / 1e9            # GB/s of this transfer
        >>> s.num_ops      # 32 for Llama-3.1-8B's 250 contiguous blocks: one op per layer
    """

    nbytes: int
    num_ops: int
    post_seconds: float
    complete_seconds: float


class Transfer:
    """One batch of block copies to or from a peer (made by ``Agent.write`` / ``read``).

    Example:
        >>> transfer = agent.read(peer, local_ids, remote_ids)   # remote blocks -> local ones
        >>> transfer.wait(timeout=5.0)     # every byte is in place, or it raised
        >>> transfer.stats.nbytes == len(local_ids) * cache.layout.bytes_per_block
        True
    """

    __slots__ = ("_core",)

    def __init__(self, core: _C.Transfer) -> None:
        self._core = core

    @property
    def peer(self) -> str:
        return self._core.peer

    @property
    def state(self) -> TransferState:
        return self._core.state

    @property
    def stats(self) -> TransferStats:
        s = self._core.stats
        return TransferStats(s.nbytes, s.num_ops, s.post_seconds, s.complete_seconds)

    @property
    def error(self) -> str:
        """Why it failed; empty unless FAILED."""
        return self._core.error

    def wait(self, timeout: float) -> None:
        """Returns once every byte is in place (and the notification, if any, was sent).

        While its agent is open, the calling thread progresses the transport itself (as
        ``Agent.wait_notification`` does).

        Raises:
            TimeoutError: still pending after ``timeout`` seconds (the transfer goes on).
            TransferError: it failed.
            PeerError: the peer died or was removed.
        """
        self._core.wait(timeout)

    def __repr__(self) -> str:
        return f"Transfer({self.peer!r}, {self.state.name}, {self.stats})"


TRAFFIC_CLASSES = ("handoff", "prefetch", "offload")
"""What a transfer is for (``Agent.write``/``read``'s ``traffic``), most urgent first.

To same-host peers an agent's copy threads run a hand-off's copies before a prefetch's before
an offload's, which take only the CPU time nothing else wants, without starving them
(docs/transfer.md, "Traffic classes"). Transfers to one peer still complete in posting order.
Layer streams (``stream_to``) are hand-offs.

Example:
    >>> agent.write(store, ids, store_ids, traffic="offload")   # behind any hand-off
"""


def traffic_class(traffic: str) -> _C.TrafficClass:
    """The core's class for one of ``TRAFFIC_CLASSES`` (ConfigError naming them if not)."""
    if traffic not in TRAFFIC_CLASSES:
        raise ConfigError(f"traffic must be one of {TRAFFIC_CLASSES}, got {traffic!r}")
    return getattr(_C.TrafficClass, traffic)
