"""A request's hand-off on the prefill (``Outgoing``, kept by ``PDPrefillWorker``) is two
small state machines, because two parties drive it independently:

- its **blocks** (``Blocks``), driven by vLLM::

      COMPUTING --computed--> COMPUTED --hold--> HELD --give_back--> RETURNED
          \\________________hold_______________/^

  COMPUTING only for a push, while the forward pass that completes its prompt runs; a pull's
  request is known from ``hold`` on (``request_finished``: vLLM hands the finished request's
  blocks over until the lease deadline).
- its **send** (``Send``), driven by the decode's offer and the stream::

      WAITING --stream_opened--> STREAMING --closing--> ENDING --ended--> DONE
          \\_______________________skipped___________________________/^

  ``skipped``: nothing will be streamed (an empty offer, a declined one, a stream that could not
  start, the lease over, the request aborted).

The blocks go back to vLLM (``give_back``) exactly when they are HELD and the send is DONE:
vLLM no longer needs them and no stream reads them. Folding the two into one enum would take
their product (4 x 4 states); each transition method asserts the state it leaves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import kvmove

__all__ = ["Blocks", "Outgoing", "Send"]


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
class Outgoing:
    """One request's hand-off, from its forward pass (push) or ``hold`` (pull) until its
    blocks go back to vLLM."""

    req_id: str
    key: str                       # what the decode offers for: transfer id or request id
    blocks: list[int]
    state: Blocks
    send: Send = Send.WAITING
    layers: set[int] = field(default_factory=set)  # in the blocks so far
    # What marks a layer ready, until it is posted: the CUDA event recorded after the forward
    # pass wrote it (pd_worker.layer_ready_event); a layer without one is ready when saved.
    ready: dict[int, Any] = field(default_factory=dict)
    posted: set[int] = field(default_factory=set)  # streamed to the decode
    overlapped: int = 0            # layers posted before the forward pass ended
    stream: kvmove.SaveStream | None = None
    deadline: float = float("inf")  # of the lease, once HELD

    def _leave(self, current: enum.Enum, *allowed: enum.Enum) -> None:
        assert current in allowed, f"{self.key}: {current} is not one of {allowed}"

    def computed(self, num_layers: int) -> None:
        self._leave(self.state, Blocks.COMPUTING)
        self.overlapped = len(self.posted)
        self.layers.update(range(num_layers))
        self.state = Blocks.COMPUTED

    def hold(self, blocks: list[int], deadline: float, num_layers: int) -> None:
        self._leave(self.state, Blocks.COMPUTING, Blocks.COMPUTED)
        self.blocks, self.deadline = list(blocks), deadline
        self.layers.update(range(num_layers))
        self.state = Blocks.HELD

    def give_back(self) -> None:
        self._leave(self.state, Blocks.HELD)
        self._leave(self.send, Send.DONE)
        self.state = Blocks.RETURNED

    def stream_opened(self, stream: kvmove.SaveStream) -> None:
        self._leave(self.send, Send.WAITING)
        self.stream, self.send = stream, Send.STREAMING

    def closing(self) -> None:
        self._leave(self.send, Send.STREAMING)
        self.send = Send.ENDING

    def ended(self) -> None:
        self._leave(self.send, Send.ENDING)
        self.send = Send.DONE

    def skipped(self) -> None:
        self._leave(self.send, Send.WAITING)
        self.send = Send.DONE
