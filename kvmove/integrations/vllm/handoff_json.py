"""The decode's offer and the prefill's refusal as JSON notifications: the hand-off messages
until kvmove's stream protocol carries them (``Agent.offer``/``Agent.decline``), kept in this
one module so that the switch replaces it whole.

- decode -> prefill ``{"op": "want", "key", "blocks", "epoch"}``: "stream request ``key``'s KV
  into my ``blocks`` under lease ``epoch``" (``blocks`` empty: "I need nothing").
- prefill -> decode ``{"op": "refuse", "key", "reason"}``: the prefill no longer holds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_MESSAGE", "Offer", "Refusal", "parse", "refuse_message", "want_message"]

MAX_MESSAGE = 1 << 16          # bytes of one notification


@dataclass(frozen=True, slots=True)
class Offer:
    """A decode's lease for one request's KV: ``blocks`` empty (and ``epoch`` 0) means it
    needs none."""

    peer: str
    request_id: str
    epoch: int
    blocks: list[int]


@dataclass(frozen=True, slots=True)
class Refusal:
    peer: str
    request_id: str
    reason: str


def want_message(key: str, blocks: list[int], epoch: int) -> bytes:
    return json.dumps({"op": "want", "key": key, "blocks": blocks, "epoch": epoch}).encode()


def refuse_message(key: str, reason: str) -> bytes:
    return json.dumps({"op": "refuse", "key": key, "reason": reason}).encode()


def parse(peer: str, data: bytes) -> Offer | Refusal | None:
    """The message in a notification; None for anything malformed."""
    try:
        message = json.loads(data[:MAX_MESSAGE])
    except ValueError:
        return None
    if not isinstance(message, dict):
        return None
    if message.get("op") == "want":
        return _want(peer, message)
    if message.get("op") == "refuse":
        return Refusal(peer, str(message.get("key")), str(message.get("reason"))[:200])
    return None


def _want(peer: str, message: dict[str, Any]) -> Offer | None:
    key, blocks, epoch = message.get("key"), message.get("blocks"), message.get("epoch")
    if not isinstance(key, str) or not isinstance(blocks, list) or \
            not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks) or \
            not isinstance(epoch, int) or isinstance(epoch, bool):
        return None
    return Offer(peer, key, epoch, blocks)
