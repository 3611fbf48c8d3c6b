"""A worker's kvmove peers, kept connected: where each peer's agent listens (from the router's
Connect commands), and a thread that connects again to one this worker lost.

A decode worker loses a prefill peer when it cuts off a stalled one (no answer to a Cancel),
or when the other side dropped it. Until the two connect again, every hand-off between them
fails, and the leases the prefill had engaged stay quarantined (docs/streaming.md,
"Quarantine"): they end only with its Abort over a new connection, or its exit. So the lost
peer is connected to again in the background, every ``RECONNECT_INTERVAL`` seconds while it
is lost, without holding up the worker's loop (a stalled peer takes the connect's whole
timeout); an offer that finds its peer gone also reconnects at once (``reconnect``).
"""

from __future__ import annotations

import logging
import threading

from kvmove.agent import Agent
from kvmove.errors import KVMoveError

__all__ = ["PeerLinks"]

logger = logging.getLogger(__name__)

RECONNECT_INTERVAL = 1.0  # seconds between tries to reach a lost peer
CONNECT_SECONDS = 2.0     # one try's deadline (an exchange takes milliseconds)


class PeerLinks:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._addresses: dict[str, tuple[str, int]] = {}
        # One connect at a time per address (each makes fresh endpoints), and only per
        # address: a try at a dead peer's old address must not hold up the router's Connect
        # to its new run.
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def connect(self, host: str, port: int) -> str:
        """Connects to the agent at ``host:port`` (the router's Connect) and remembers where
        it is; returns its name."""
        with self._lock_of((host, port)):
            name = self.agent.connect(host, port)
            self._addresses[name] = (host, port)
        return name

    def reconnect(self, name: str) -> bool:
        """Connects again to ``name`` if it is no live peer; False when its address is unknown
        or the connect failed."""
        address = self._addresses.get(name)
        if address is None:
            return False
        with self._lock_of(address):
            if self.agent.peer_alive(name):
                return True  # another thread did it meanwhile
            try:
                self.agent.connect(*address, timeout=CONNECT_SECONDS)
            except KVMoveError as error:
                logger.info("connecting again to %s at %s:%d failed: %s", name, *address, error)
                return False
        logger.info("connected again to %s at %s:%d", name, *address)
        return True

    def forget(self, name: str) -> None:
        """``name``'s process is gone: its address is not connected to again (its next run,
        if any, comes with the router's Connect)."""
        self._addresses.pop(name, None)

    def lost(self) -> list[str]:
        """The peers this worker knows where to reach and is not connected to now (``/health``
        says so: until they connect again, no hand-off between them works)."""
        if self.agent.closed:
            return []
        return sorted(name for name in list(self._addresses) if not self.agent.peer_alive(name))

    def _lock_of(self, address: tuple[str, int]) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(address, threading.Lock())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, name="peer-links", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CONNECT_SECONDS + 1.0)

    def _keep(self) -> None:
        while not self._stop.wait(RECONNECT_INTERVAL):
            for name in list(self._addresses):
                if not self.agent.closed and not self.agent.peer_alive(name):
                    self.reconnect(name)
