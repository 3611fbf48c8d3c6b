"""AgentStats: what an agent's layer streams and leases did (``Agent.stats()``). Its fields
are the core's ``StreamStats`` (csrc/stream/stream_protocol.h), one for one; ``kvmove.metrics``
exports each as a metric."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["AgentStats", "trouble_note"]


@dataclass(frozen=True, slots=True)
class AgentStats:
    """What an agent's layer streams and leases did (counters since it started, unless said).

    Attributes:
        leases_granted: ``expect`` calls.
        leases_active: now: leases granted and not yet released.
        blocks_quarantined: now: blocks of cancelled or expired leases whose sender has not
            answered yet, or was cut off while it could still write them: not reusable until
            it answers, or its process exited (docs/streaming.md, "Quarantine").
        leases_quarantined: leases whose sender was cut off (disconnected, removed, replaced
            by a new run, or its endpoint failed) while it could still write them.
        leases_expired: leases whose deadline passed before they completed.
        cancels_sent: Cancels sent to senders (a cancel or an expiry of an engaged lease).
        senders_disconnected: senders cut off for not answering a Cancel in time.
        messages_refused: stream messages refused: for no lease, from another sender than the
            lease's, for other blocks, or in a state that does not allow them.
        begins_refused: of those, senders told no (they wrote nothing).
        checksum_mismatches: received blocks (per layer) whose bytes did not match.
        acks_missed: sent Finals not acknowledged in time (those streams failed).
        unknown_senders: messages and notifications from an endpoint that is no peer's
            (dropped: an agent must be added as a peer before it is heard).
        messages_dropped: messages dropped for their form: rendezvous (too large to arrive
            eagerly), over the size bound, or over a peer's notification queue cap.

    Example:
        >>> stats = agent.stats()
        >>> stats.leases_active, stats.blocks_quarantined    # both 0 when the agent is idle
        (0, 0)
    """

    leases_granted: int
    leases_active: int
    blocks_quarantined: int
    leases_quarantined: int
    leases_expired: int
    cancels_sent: int
    senders_disconnected: int
    messages_refused: int
    begins_refused: int
    checksum_mismatches: int
    acks_missed: int
    unknown_senders: int
    messages_dropped: int

    def trouble(self) -> str:
        """The counters that say messages went astray or peers were cut off, those not 0, as
        ``"unknown_senders=2, acks_missed=1"`` ("" when all are 0): for a failure's log line."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in TROUBLE
                         if getattr(self, name))


class _Counted(Protocol):
    """An ``Agent``, as ``trouble_note`` uses it (a Protocol: kvmove.agent imports this
    module)."""

    @property
    def name(self) -> str: ...

    def stats(self) -> AgentStats: ...


def trouble_note(agents: Iterable[_Counted]) -> str:
    """``"; agent X: unknown_senders=1"`` for each of ``agents`` whose ``trouble()`` is not
    empty ("" when none): what a failure's log line adds."""
    said = ((agent.name, agent.stats().trouble()) for agent in agents)
    return "".join(f"; agent {name}: {trouble}" for name, trouble in said if trouble)


# AgentStats.trouble's counters.
TROUBLE = ("unknown_senders", "messages_dropped", "messages_refused", "senders_disconnected",
           "leases_expired", "acks_missed", "leases_quarantined")
