"""The far side of the two-process tests: a ``KVCache`` + ``Agent`` in a spawned child process
(``FarAgent``), driven through ``kvmove.bench.harness`` (``FarPeer``). Every call has a
deadline; ``stop()`` always leaves the child dead and joined.

Nothing here mocks the data path: every byte moves through ``kvmove.Agent`` and UCX.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import kvmove
from kvmove.bench.harness import Child

from helpers.kv import fill, raw_view


class FarAgent:
    """Commands the parent can run in the child; each returns a picklable value."""

    def __init__(self, name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
                 device: str | None = None):
        self.cache = kvmove.KVCache(kvmove.KVSpec(**layout_kwargs), num_blocks,
                                    device=device)
        self.agent = kvmove.Agent(name, self.cache, **agent_kwargs)

    def close(self) -> None:
        self.agent.close()

    def pid(self) -> int:
        return os.getpid()

    def fill(self, seed: int) -> None:
        fill(self.cache, seed)

    def snapshot(self) -> np.ndarray:
        return raw_view(self.cache).copy()

    def listen(self, host: str = "127.0.0.1") -> tuple[str, int]:
        return tuple(self.agent.listen(host))

    def connect(self, host: str, port: int) -> str:
        return self.agent.connect(host, port)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def remove_peer(self, name: str) -> None:
        self.agent.remove_peer(name)

    def peers(self) -> list[str]:
        return list(self.agent.peers)

    def faults_injected(self) -> dict[str, int]:
        return self.agent.faults_injected()

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(str(n), bytes(p)) for n, p in self.agent.notifications()]

    def wait_notification(self, timeout: float) -> tuple[str, bytes]:
        name, payload = self.agent.wait_notification(timeout)
        return str(name), bytes(payload)

    def wait_notification_and_gather(self, timeout: float, block_ids: list[int],
                                     layers: list[int] | None = None) -> tuple[str, bytes, Any]:
        """Waits for a notification and copies ``block_ids`` (in ``layers``) the instant it
        arrives, before anything else can change them: ``[len(layers), len(ids), nbytes]``."""
        name, payload = self.agent.wait_notification(timeout)
        raw = raw_view(self.cache)
        rows = raw if layers is None else raw[layers]
        return str(name), bytes(payload), rows[:, block_ids].copy()

    def write(self, peer: str, local_ids: list[int], remote_ids: list[int],
              layers: list[int] | None = None, notify: bytes | None = None,
              timeout: float = 10.0) -> dict:
        t = self.agent.write(peer, local_ids, remote_ids, layers=layers, notify=notify)
        t.wait(timeout)
        return _stats(t)

    def write_many(self, peer: str, batches: list[tuple[list[int], list[int], bytes]],
                   timeout: float = 10.0) -> None:
        """Posts every batch before waiting on any (each with its notify payload)."""
        posted = [self.agent.write(peer, loc, rem, notify=n) for loc, rem, n in batches]
        for t in posted:
            t.wait(timeout)


def _stats(t: Any) -> dict:
    s = t.stats
    return {"nbytes": s.nbytes, "num_ops": s.num_ops, "post_seconds": s.post_seconds,
            "complete_seconds": s.complete_seconds, "state": str(t.state), "error": t.error}


class FarPeer(Child):
    """A ``FarAgent`` (or ``host``, a subclass of it) named ``name`` in a spawned child.

    ``call(command, *args)`` runs ``FarAgent.command`` there; what it raises arrives as a
    ``ChildError`` whose ``kind`` is the class name (e.g. ``"PeerError"``). ``extra`` goes
    to the host's constructor after the agent's arguments.
    """

    def __init__(self, name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
                 *extra: Any, host: type[FarAgent] = FarAgent, start_timeout: float = 30.0):
        super().__init__(host, name, layout_kwargs, num_blocks, agent_kwargs, *extra,
                         name=f"far-{name}", label=f"far process {name!r}", timeout=30.0,
                         start_timeout=start_timeout)
