"""A request's hand-off on the prefill (``Outgoing``, kept by ``PDPrefillWorker``) is two
small state machines, because two parties drive it independently:

- its **blocks** (``Blocks``), driven by vLLM::

      COMPUTING --computed--> COMPUTED --hold--> HELD --give_back--> RETURNED
          \\________________hold_______________/^

  COMPUTING only for a push, while the forward pass that completes its prompt runs; a pull's
  request is known from ``hold`` on (``request_finished``: vLLM hands the finished request's
  blocks over until the lease deadline).
- its **send** to each decode rank that loads it (``Share``: one, or one per decode rank of a
  higher tensor parallelism, ``tp.py``), driven by that rank's offer and the stream::

      WAITING --stream_opened--> STREAMING --closing--> ENDING --ended--> DONE
          \\_______________________skipped___________________________/^

  ``skipped``: nothing will be streamed (an empty offer, a declined one, a stream that could not
  start, the lease over, the request aborted).

The blocks go back to vLLM (``give_back``) exactly when they are HELD and every share is DONE:
vLLM no longer needs them and no stream reads them. Folding the two into one enum would take
their product (4 x 4 states); each transition method asserts the state it leaves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import kvmove

__all__ = ["Blocks", "Outgoing", "Send", "Share"]


class Blocks(enum.Enum):
    """Where a request's blocks are (see the module's docstring)."""

    COMPUTING = "computing"    # the forward pass writes their last layers (push)
    COMPUTED = "computed"      # every layer is in them; vLLM still runs the request
    HELD = "held"              # vLLM handed them over until the lease deadline
    RETURNED = "returned"      # given back to vLLM


class Send(enum.Enum):
    """How far a request's KV is on its way to the decode."""

    WAITING = "waiting"        # no decode has offered a lease for it yet
    STREAMING = "streaming"    # a stream into the lease is open; layers post as saved
    ENDING = "ending"          # finish() or abort() went out; a pool thread awaits the end
    DONE = "done"              # no stream reads the blocks (ended, failed, or none started)


@dataclass(eq=False)
class Share:
    """The send to one decode rank: share ``index`` of the request's."""

    key: str
    index: int
    send: Send = Send.WAITING
    stream: kvmove.SaveStream | None = None
    posted: set[int] = field(default_factory=set)  # streamed to the decode
    overlapped: int = 0            # layers posted before the forward pass ended
    nbytes: int = 0                # what the stream sends (for the connector's stats)

    def _leave(self, *allowed: Send) -> None:
        assert self.send in allowed, f"{self.key}: {self.send} is not one of {allowed}"

    def stream_opened(self, stream: kvmove.SaveStream) -> None:
        self._leave(Send.WAITING)
        self.stream, self.send = stream, Send.STREAMING

    def closing(self) -> None:
        self._leave(Send.STREAMING)
        self.send = Send.ENDING

    def ended(self) -> None:
        self._leave(Send.ENDING)
        self.send = Send.DONE

    def skipped(self) -> None:
        self._leave(Send.WAITING)
        self.send = Send.DONE


@dataclass(eq=False)
class Outgoing:
    """One request's hand-off, from its forward pass (push) or ``hold`` (pull) until its
    blocks go back to vLLM."""

    req_id: str
    key: str                       # what the decode offers for: transfer id or request id
    blocks: list[int]
    state: Blocks
    shares: list[Share] = field(default_factory=list)  # one, until an offer says more
    layers: set[int] = field(default_factory=set)  # in the blocks so far
    # What marks a layer ready, until every share posted it: the CUDA event recorded after the
    # forward pass wrote it (pd_worker.layer_ready_event); a layer without one is ready when
    # saved.
    ready: dict[int, Any] = field(default_factory=dict)
    deadline: float = float("inf")  # of the lease, once HELD

    def __post_init__(self) -> None:
        if not self.shares:
            self.shares = [Share(self.key, 0)]

    @property
    def done(self) -> bool:
        """No share will read the blocks any more."""
        return all(share.send is Send.DONE for share in self.shares)

    @property
    def waiting(self) -> list[Share]:
        """The shares no decode rank has offered for yet."""
        return [share for share in self.shares if share.send is Send.WAITING]

    def split(self, count: int) -> bool:
        """``count`` decode ranks load this request (their offers say so); False when sends
        to another number already started."""
        if count != len(self.shares):
            if len(self.waiting) != len(self.shares):
                return False
            self.shares = [Share(self.key, i) for i in range(count)]
        return True

    def forget_ready(self) -> None:
        """Drops the markers of layers every share posted or will never post."""
        for layer in list(self.ready):
            if all(layer in share.posted or share.send is Send.DONE for share in self.shares):
                del self.ready[layer]

    def _leave(self, *allowed: Blocks) -> None:
        assert self.state in allowed, f"{self.key}: {self.state} is not one of {allowed}"

    def computed(self, num_layers: int) -> None:
        self._leave(Blocks.COMPUTING)
        for share in self.shares:
            share.overlapped = len(share.posted)
        self.layers.update(range(num_layers))
        self.state = Blocks.COMPUTED

    def hold(self, blocks: list[int], deadline: float, num_layers: int) -> None:
        self._leave(Blocks.COMPUTING, Blocks.COMPUTED)
        self.blocks, self.deadline = list(blocks), deadline
        self.layers.update(range(num_layers))
        self.state = Blocks.HELD

    def give_back(self) -> None:
        self._leave(Blocks.HELD)
        assert self.done, f"{self.key}: a share is not done: {self.shares}"
        self.state = Blocks.RETURNED
