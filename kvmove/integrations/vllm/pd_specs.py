"""The jobs the P/D scheduler (``pd_scheduler.py``) gives its workers (``pd_worker.py``) in
each step's ``PDMetadata``: the decode's loads, the prefill's pushes (this step completes the
prompt) and sends (vLLM handed the finished request's blocks over). Plain data, no vLLM: the
workers' parts import them without it."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.integrations.vllm.params import TransferMode

__all__ = ["LoadSpec", "PushSpec", "SendSpec"]


@dataclass
class LoadSpec:
    """Decode side: load a request's prompt KV from a prefill instance into ``blocks``."""

    req_id: str
    key: str                   # the prefill's name for it: transfer id (push) or request id
    mode: TransferMode
    blocks: list[int]          # local blocks; empty: nothing to load, only release the prefill
    remote_host: str
    remote_port: int           # the prefill's rank 0 agent; its rank r listens on + r
    num_tokens: int
    remote_tp_size: int | None = None  # the prefill's tensor parallelism (None: not said)


@dataclass
class SendSpec:
    """Prefill side: a finished request's blocks, held for the decode until ``deadline``
    (``time.monotonic()``, the same clock in every process of the host)."""

    req_id: str
    transfer_id: str | None
    blocks: list[int]
    deadline: float
    abort: bool = False        # the request did not finish normally: send nothing


@dataclass
class PushSpec:
    """Prefill side, push mode: this step's forward pass completes the request's prompt; its
    layers may stream to the decode's lease as they are saved."""

    req_id: str
    transfer_id: str
    blocks: list[int]

