"""Far side of ``test_layer_stream.py`` (and ``test_gpu.py``): ``FarAgent`` plus the
layer-stream verbs, so the child sends (``SaveStream``) or receives (``LoadStream``) layer
streams on command. A stream's data is ``helpers.kv.layer_data``: bytes determined by
``(seed, layer)``, computed the same way in both processes, so the receiver knows what each
layer must hold without asking.

Nothing is mocked: every byte moves through ``kvmove.Agent`` and UCX.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np

from helpers.far import FarAgent
from helpers.kv import raw_view, write_layer


class StreamFar(FarAgent):
    """``FarAgent`` plus the layer-stream verbs, keyed by request id. Far exceptions reach
    the parent as ``ChildError`` with ``kind`` the class name (e.g. ``"PeerError"``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.streams: dict[str, Any] = {}
        self.loads: dict[str, Any] = {}
        self.runs: dict[str, dict] = {}  # background streams: request id -> result

    def close(self) -> None:
        self.streams.clear()
        self.loads.clear()
        super().close()

    # -- the cache's BlockPool ------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        return self.cache.pool.allocate(n)

    def free(self, ids: list[int]) -> None:
        self.cache.pool.free(ids)

    def num_free(self) -> int:
        return self.cache.pool.num_free

    def scrub(self, ids: list[int], value: int = 0) -> None:
        raw_view(self.cache)[:, ids] = value

    def write_layers(self, seed: int, layers: list[int], ids: list[int]) -> None:
        for layer in layers:
            write_layer(self.cache, seed, layer, ids)

    def blocks(self, ids: list[int]) -> np.ndarray:
        """A copy of ``ids`` in every layer: ``[L, len(ids), block_nbytes]``."""
        return raw_view(self.cache)[:, ids].copy()

    # -- sender ---------------------------------------------------------------------------

    def stream_to(self, peer: str, local_ids: list[int], remote_ids: list[int],
                  request_id: str, epoch: int) -> None:
        self.streams[request_id] = self.agent.stream_to(peer, local_ids, remote_ids, request_id,
                                                        epoch=epoch)

    def save_layers(self, request_id: str, layers: list[int]) -> None:
        for layer in layers:
            self.streams[request_id].save_layer(layer)

    def save_each(self, saves: list[tuple[str, int]]) -> None:
        """``save_layer(layer)`` of stream ``request_id`` for each pair, in this order (to
        interleave streams)."""
        for request_id, layer in saves:
            self.streams[request_id].save_layer(layer)

    def finish(self, request_id: str, payload: bytes = b"") -> None:
        self.streams[request_id].finish(payload)

    def wait_for_save(self, request_id: str, timeout: float) -> None:
        self.streams[request_id].wait_for_save(timeout)

    def abort(self, request_id: str, timeout: float) -> None:
        self.streams[request_id].abort(timeout)

    def state(self, request_id: str) -> str:
        return self.streams[request_id].state.name

    def layer_times(self, request_id: str) -> list[tuple[float | None, float | None]]:
        return self.streams[request_id].layer_times()

    def drop(self, request_id: str) -> None:
        """Forgets the stream without finishing or aborting it, and collects it."""
        del self.streams[request_id]
        gc.collect()

    def abort_all(self, timeout: float) -> list[str]:
        """Aborts every stream still open (what a failed test left behind) and waits for the
        background ones to stop, so their blocks can be given to the next test; returns their
        request ids."""
        still_open = [rid for rid, s in self.streams.items() if s.state.name == "OPEN"]
        for rid in still_open:
            self.streams[rid].abort(timeout)
        for result in self.runs.values():
            result["thread"].join(timeout)
        return still_open

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.loads.pop(request_id, None)

    def run_stream(self, peer: str, local_ids: list[int], remote_ids: list[int],
                   request_id: str, epoch: int, order: list[int], seed: int, delay: float,
                   payload: bytes, timeout: float) -> None:
        """Streams in a background thread, like a forward pass: for each layer of ``order``,
        writes its data into ``local_ids`` (``write_layer``), sleeps ``delay`` (the layer's
        compute), then ``save_layer``; then ``finish(payload)`` and ``wait_for_save``.
        Returns at once: :meth:`join_stream` collects the outcome."""
        stream = self.agent.stream_to(peer, local_ids, remote_ids, request_id, epoch=epoch)
        self.streams[request_id] = stream
        result: dict = {}
        self.runs[request_id] = result

        def run() -> None:
            try:
                for layer in order:
                    write_layer(self.cache, seed, layer, local_ids)
                    if delay:
                        time.sleep(delay)
                    stream.save_layer(layer)
                stream.finish(payload)
                stream.wait_for_save(timeout)
            except Exception as e:  # noqa: BLE001 - reported to the parent by join_stream
                result["error"] = (type(e).__name__, str(e))

        thread = threading.Thread(target=run, daemon=True)
        result["thread"] = thread
        thread.start()

    def join_stream(self, request_id: str, timeout: float) -> dict:
        """Waits for :meth:`run_stream`'s thread: ``{"state", "error", "layer_times"}``."""
        result = self.runs.pop(request_id)
        result["thread"].join(timeout)
        if result["thread"].is_alive():
            raise RuntimeError(f"stream {request_id!r} still running after {timeout} s")
        stream = self.streams.pop(request_id)
        return {"state": stream.state.name, "error": result.get("error"),
                "layer_times": stream.layer_times()}

    # -- receiver -------------------------------------------------------------------------

    def expect(self, peer: str, request_id: str, local_ids: list[int],
               timeout: float = 60.0) -> int:
        """Leases ``local_ids`` to ``peer`` and starts loading; returns the lease's epoch."""
        load = self.agent.expect(peer, request_id, local_ids, timeout=timeout).start_load()
        self.loads[request_id] = load
        return load.epoch

    def released(self, request_id: str, timeout: float) -> bool:
        return self.loads[request_id].wait_released(timeout)

    def wait_for_layer(self, request_id: str, layer: int, timeout: float) -> None:
        self.loads[request_id].wait_for_layer(layer, timeout)

    def wait_all(self, request_id: str, timeout: float) -> bytes:
        return self.loads[request_id].wait_all(timeout)
