"""vLLM's P/D protocol: the ``kv_transfer_params`` of a request and of a prefill's answer, as
one frozen type (``KVTransferParams``), and the hand-off mode (``TransferMode``).

The wire is vLLM's NixlConnector's (its toy proxy and ours are interchangeable), plus kvmove's
push fields::

    to a prefill   {"do_remote_decode": true, ...}              keep the KV for a decode
    its answer     {"do_remote_prefill": true, "remote_block_ids", "remote_engine_id",
                    "remote_request_id", "remote_host", "remote_port", "tp_size",
                    "remote_num_tokens", "transfer_mode"}        where the decode gets it
    to a decode    the answer (pull), or {"do_remote_prefill": true, "transfer_mode": "push",
                    "kvmove_transfer_id", "remote_engine_id", "remote_host", "remote_port"}

This is the one place a key is spelled: the connector (``pd_scheduler.py``) and the proxy
(``kvmove/serve/vllm/``) both read and write the params through this type. It imports
neither vLLM nor anything that does, because the proxy runs without vLLM.

A field that is ``None`` is absent from the dict. The constructor refuses a bad value
(``ConfigError``: our own code built it wrong); ``from_request`` drops one instead (the
params come from a client's JSON, and a bad field must not fail vLLM's engine core: the
connector then computes the prompt itself, as vLLM does for a request it cannot hand off).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmove.errors import ConfigError

__all__ = ["KVTransferParams", "MAX_TRANSFER_ID", "TransferMode", "mark_handed_off"]

log = logging.getLogger(__name__)

MAX_TRANSFER_ID = 128  # characters of a kvmove_transfer_id


class TransferMode(enum.StrEnum):
    """How the KV moves: ``pull`` (vLLM's flow: the decode asks once the prefill finished) or
    ``push`` (kvmove's: the prefill streams each layer into blocks the decode leased first)."""

    PUSH = "push"
    PULL = "pull"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "a non-empty string"


def _count(least: int, below: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and value >= least and \
                (below is None or value < below):
            return None
        return f"an int in [{least}, {below})" if below else f"an int >= {least}"
    return check


def _transfer_id(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_TRANSFER_ID:
        return None
    return f"a string of 1 to {MAX_TRANSFER_ID} characters"


def _block_ids(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and all(_count(0)(b) is None for b in value)
    return None if ok else "a list of block ids (ints >= 0)"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _mode(value: Any) -> str | None:
    modes = [m.value for m in TransferMode]
    return None if isinstance(value, str) and value in modes else f"one of {modes}"


# Each field's check: None when the value is acceptable, else what it must be.
_CHECKS = {
    "do_remote_decode": _flag, "do_remote_prefill": _flag, "remote_engine_id": _text,
    "remote_block_ids": _block_ids, "remote_request_id": _text, "remote_host": _text,
    "remote_port": _count(1, 65536), "tp_size": _count(1), "remote_num_tokens": _count(0),
    "transfer_mode": _mode, "kvmove_transfer_id": _transfer_id,
}
# The fields a prefill fills in, sent null by vLLM's toy proxy (``pull_request``).
_ANSWERED = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
_ADDRESS = ("remote_engine_id", "remote_host", "remote_port")


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """One request's ``kv_transfer_params`` (vLLM's P/D protocol, kvmove's push fields).

    Example:
        >>> p = KVTransferParams.from_request({"do_remote_prefill": True, "remote_port": 5600,
        ...                                    "remote_host": "10.0.0.7", "extra": 1})
        >>> p.agent_address, p.to_dict()["remote_port"]
        (('10.0.0.7', 5600), 5600)
    """

    do_remote_decode: bool | None = None    # to a prefill: keep the KV for a remote decode
    do_remote_prefill: bool | None = None   # to a decode: the prompt's KV is remote
    remote_engine_id: str | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_request_id: str | None = None    # the prefill's request id (pull's key)
    remote_host: str | None = None          # where the prefill's kvmove agent listens
    remote_port: int | None = None
    tp_size: int | None = None
    remote_num_tokens: int | None = None
    transfer_mode: TransferMode | None = None
    kvmove_transfer_id: str | None = None   # push's key, the same in both requests

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            value = getattr(self, name)
            problem = None if value is None else check(value)
            if problem is not None:
                raise ConfigError(f"kv_transfer_params[{name!r}] must be {problem}, got "
                                  f"{value!r}")
        if self.transfer_mode is not None:
            object.__setattr__(self, "transfer_mode", TransferMode(self.transfer_mode))
        if self.remote_block_ids is not None:
            object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))

    @classmethod
    def from_request(cls, params: dict[str, Any] | None) -> KVTransferParams:
        """The fields of ``params`` kvmove reads, each checked; a bad one is dropped (logged),
        unknown keys (another connector's) are ignored. ``None`` gives empty params.

        ``do_remote_decode``/``do_remote_prefill`` count by truthiness, as in vLLM's own
        connectors (``params.get("do_remote_prefill")``)."""
        if not isinstance(params, dict):
            return cls()
        kept: dict[str, Any] = {}
        for name, check in _CHECKS.items():
            value = params.get(name)
            if name.startswith("do_remote_") and value is not None:
                value = bool(value)
            if value is not None and check(value) is None:
                kept[name] = value
            elif value is not None:
                log.debug("kv_transfer_params[%r] = %.100r dropped: not %s", name, value,
                          check(value))
        return cls(**kept)

    @classmethod
    def pull_request(cls) -> dict[str, Any]:
        """What a pull's prefill request carries, exactly as vLLM's toy proxy sends it: a
        remote decode, with the fields the prefill answers present and null."""
        return cls(do_remote_decode=True, do_remote_prefill=False).to_dict() | \
            dict.fromkeys(_ANSWERED)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the fields that are not ``None``, in plain JSON types."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, TransferMode):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            if value is not None:
                out[field.name] = value
        return out

    @property
    def transfer_id(self) -> str | None:
        """The push transfer id, when the request asks for push."""
        return self.kvmove_transfer_id if self.transfer_mode is TransferMode.PUSH else None

    @property
    def mode(self) -> TransferMode:
        return TransferMode.PUSH if self.transfer_id is not None else TransferMode.PULL

    @property
    def key(self) -> str | None:
        """The prefill's name for the request's KV: the transfer id (push) or its request id
        (pull)."""
        return self.transfer_id if self.transfer_id is not None else self.remote_request_id

    @property
    def agent_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the prefill's kvmove agent, when both are there."""
        if self.remote_host is None or self.remote_port is None:
            return None
        return self.remote_host, self.remote_port

    def prefill_address(self) -> KVTransferParams | None:
        """The prefill instance's kvmove address alone (engine id, host, port), when all
        three are there, with its ``tp_size`` when it said it: what a proxy keeps to push to
        that instance later. (The TP spares a decode of another TP a connection to the
        prefill's rank 0 only to ask how many heads each rank holds.)"""
        values = {name: getattr(self, name) for name in _ADDRESS}
        if any(v is None for v in values.values()):
            return None
        return KVTransferParams(**values, tp_size=self.tp_size)


def mark_handed_off(params: dict[str, Any]) -> None:
    """Sets ``do_remote_prefill`` false in a request's own params dict, as vLLM's
    NixlConnector does: vLLM asks the connector again for a request it preempted, and its
    KV is fetched once (afterwards it is computed)."""
    params["do_remote_prefill"] = False
