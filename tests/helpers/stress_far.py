"""The sender of ``test_stale_kv.py``'s read-after-reassign stress: a ``StreamFar`` that runs
the streams it is given on a few threads, as a prefill worker would, with the delays each job
asks for, and fills every block with a digest of (request, layer, position) before saving it,
so that the receiver can check every byte it uses.

Nothing is mocked: every byte moves through ``kvmove.Agent`` and UCX.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from helpers.kv import digest_blocks, raw_view
from helpers.stream_far import StreamFar

THREADS = 8


class StressSender(StreamFar):
    """``submit(job)`` queues a stream; ``outcomes()`` reports how each ended."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.jobs: queue.Queue = queue.Queue()
        self.results: dict[str, tuple[str, str]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(THREADS)]
        for thread in self.threads:
            thread.start()

    def submit(self, job: dict) -> None:
        """job: rid, number (the digest's request), epoch, dst, start_delay, layer_delays."""
        self.jobs.put(job)

    def outcomes(self) -> dict[str, tuple[str, str]]:
        """Request id -> (final state, error class or "")."""
        with self.lock:
            return dict(self.results)

    def idle(self) -> bool:
        with self.lock:
            return self.jobs.empty() and self.running == 0

    running = 0

    def _work(self) -> None:
        while not self.stop.is_set():
            try:
                job = self.jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            with self.lock:
                self.running += 1
            try:
                outcome = self._stream(job)
            finally:
                with self.lock:
                    self.running -= 1
                    self.results[job["rid"]] = outcome  # type: ignore[assignment]

    def _stream(self, job: dict) -> tuple[str, str]:
        n = len(job["dst"])
        src = None
        while src is None:  # the sender's pool is large enough for every job in flight
            with self.lock:
                src = self.cache.pool.allocate(n)
            if src is None:
                time.sleep(0.001)
        try:
            time.sleep(job["start_delay"])
            raw = raw_view(self.cache)
            stream = self.agent.stream_to(job["peer"], src, job["dst"], job["rid"],
                                          epoch=job["epoch"], checksums=job.get("checksums"))
            for layer, delay in enumerate(job["layer_delays"]):
                time.sleep(delay)
                raw[layer, src] = digest_blocks(job["number"], layer, n, raw.shape[2])
                stream.save_layer(layer)
            stream.finish(b"")
            stream.wait_for_save(30.0)
            return stream.state.name, ""
        except Exception as error:  # noqa: BLE001 - the outcome is what the test counts
            return "FAILED", type(error).__name__
        finally:
            with self.lock:
                self.cache.pool.free(src)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(5.0)
        super().close()
