"""The router's end of the control channel (``Channel``): commands out, events in.

* **Out**: a command goes to a worker now or raises; an answer awaited is a future per
  (worker, key) that the worker's event resolves (``resolve``) or its death fails (``fail``).
  The router's placement (a decode worker's ``reserved``) and the supervisor's peering
  (``connected``) both wait on it.
* **In** (``receive``): every frame is checked before the router sees it. Nothing a peer sends
  ends this loop: a message from an identity that is no live worker process's, or one that
  does not parse (``messages.py``), is logged and dropped
  (``kvmove_control_messages_dropped_total``); an error handling a valid one is logged.

Its socket is the ``ControlEndpoint``'s (``control.py``: where it listens, who can reach it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.asyncio

from kvmove.errors import KVMoveError, PeerError
from kvmove.serve.messages import Command, Event, encode, parse_event

if TYPE_CHECKING:
    from prometheus_client import Counter

    from kvmove.serve.pool import WorkerPool
    from kvmove.serve.workers import WorkerInfo

__all__ = ["Channel"]

logger = logging.getLogger(__name__)

LOUD_DROPS = 10  # dropped control messages logged as warnings (of each reason), then debug


class Channel:
    """Args:
        socket: the router's ROUTER socket (``ControlEndpoint.socket``).
        address: where workers connect to it (their ``--router``).
        pool: the workers, whose live processes' identities are heard.
        dropped: counts the messages dropped, by ``reason``.
        on_event: handles each valid event, with the worker that sent it.
    """

    def __init__(self, socket: zmq.asyncio.Socket, address: str, pool: WorkerPool,
                 dropped: Counter, on_event: Callable[[WorkerInfo, Event], None]) -> None:
        self.socket, self.address, self.pool = socket, address, pool
        self.dropped, self.on_event = dropped, on_event
        self._futures: dict[tuple[str, str], asyncio.Future] = {}
        self._drops: dict[str, int] = {}  # control messages dropped, by reason

    # --- out: commands, and the answers awaited -------------------------------------------

    def send(self, worker: WorkerInfo, message: Command) -> None:
        """Sends now or raises ``PeerError`` (a worker that is gone is unreachable; a client
        whose request it ends sees this error, not ZeroMQ's "Host unreachable")."""
        try:
            # pyzmq types this Awaitable; zmq.asyncio's socket returns an asyncio.Future
            sent = cast("asyncio.Future[Any]", self.socket.send_multipart(
                [worker.identity, encode(message)], flags=zmq.NOBLOCK))
            error = sent.exception() if sent.done() else None
        except zmq.ZMQError as raised:
            error = raised
        if error is not None:
            raise PeerError(f"worker {worker.name} is unreachable (it exited?): {error}") \
                from error

    def expect(self, worker: str, key: str) -> asyncio.Future:
        """A future for ``worker``'s answer about ``key`` (a request id, or "connect")."""
        future = asyncio.get_running_loop().create_future()
        self._futures[worker, key] = future
        return future

    def resolve(self, worker: str, key: str, value: Any) -> None:
        future = self._futures.pop((worker, key), None)
        if future is not None and not future.done():
            future.set_result(value)

    def awaits(self, worker: str, key: str | None = None) -> bool:
        """An answer of ``worker`` (about ``key``; None: any) is expected. A future failed by
        ``fail``, or one whose waiter gave up, still counts until resolved."""
        if key is not None:
            return (worker, key) in self._futures
        return any(name == worker for name, _ in self._futures)

    def fail(self, worker: str) -> None:
        """``worker`` died: every answer still awaited from it raises ``KVMoveError``."""
        for (name, _), future in list(self._futures.items()):
            if name == worker and not future.done():
                future.set_exception(KVMoveError(f"worker {name} died"))

    # --- in: events -----------------------------------------------------------------------

    async def receive(self) -> None:
        """Every event from the workers, until the router stops (the module says what is
        dropped). Should it end anyway, ``/health`` says so."""
        while True:
            frames = await self.socket.recv_multipart()
            try:
                self.dispatch(frames)
            except Exception:  # noqa: BLE001 - one event's bug must not stop every stream
                logger.exception("handling a control event failed")
                self._drop("error", "see the exception above")

    def dispatch(self, frames: list[bytes]) -> None:
        """One message as the ROUTER socket gives it: the sender's identity, then its frame."""
        worker = self.pool.identify(frames[0])
        if worker is None:
            self._drop("unknown_peer", f"from {frames[0][:80]!r}, no live worker's identity")
            return
        if len(frames) != 2:
            self._drop("malformed", f"{len(frames) - 1} frames from {worker.name}, want 1")
            return
        try:
            event = parse_event(frames[1])
        except PeerError as error:
            self._drop("malformed", f"from {worker.name}: {error}")
            return
        self.on_event(worker, event)

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped.labels(reason=reason).inc()
        self._drops[reason] = count = self._drops.get(reason, 0) + 1
        level = logging.WARNING if count <= LOUD_DROPS else logging.DEBUG
        logger.log(level, "control message dropped (%s, %d so far): %s", reason, count, detail)
