"""The engine's side of a ``KVStore``: stored prefixes come back instead of being prefilled,
finished requests' full blocks go in.

* After the live prefix cache (``BlockPool.match``), the rest of a new request's full blocks
  are looked up in the store. When the store's decision is to load some (``Lookup``), the
  request gets blocks for them and leaves the queue while ``KVStore.get`` fills them; other
  requests run meanwhile. Once the get ends, the blocks that arrived count as computed (and
  join the live prefix cache); the request goes back to the head of the queue and computes
  the rest. A block that did not arrive (evicted meanwhile, or corrupt) is simply recomputed.
* When a request finishes, its full blocks are offered (``KVStore.put``), holding a reference
  on them until the store has copied them, so they cannot be reused under the copy.
* Prefill steps report their throughput, the store's other input for load-or-recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.block_pool import BlockPool
from kvmove.engine.request import Request, RequestState
from kvmove.errors import ConfigError, TimeoutError
from kvmove.kv_cache import KVCache
from kvmove.store import KVStore, StoreHandle

__all__ = ["PrefixStore"]

_OBSERVE_MIN_TOKENS = 64  # steps smaller than this measure overheads, not prefill throughput


@dataclass
class _Fetch:
    request: Request
    handle: StoreHandle
    hashes: list[int]
    ids: list[int]
    cancelled: bool = False


class PrefixStore:
    def __init__(self, store: KVStore, cache: KVCache) -> None:
        if store.layout != cache.layout:
            raise ConfigError(f"the store's layout {store.layout!r} is not the cache's "
                              f"{cache.layout!r}")
        self.store = store
        self.cache = cache
        assert cache.pool is not None  # the engine worker's own cache, which has its pool
        self.pool: BlockPool = cache.pool
        self.block_size = cache.layout.block_size
        self.fetching: list[_Fetch] = []
        self._offers: list[tuple[StoreHandle, list[int]]] = []

    @property
    def busy(self) -> bool:
        return bool(self.fetching or self._offers)

    def fetch(self, request: Request, hashes: list[int]) -> bool:
        """Starts loading the stored blocks of ``hashes`` past the request's live prefix.
        False when there is nothing worth loading or no free block for it (it computes)."""
        have = len(request.blocks)
        lookup = self.store.lookup(hashes[have:])
        n = lookup.load_blocks
        ids = self.pool.allocate(n) if n else None
        if ids is None:
            return False
        wanted = list(hashes[have:have + n])
        handle = self.store.get(wanted, self.cache, ids)
        request.blocks += ids
        request.state = RequestState.FETCHING
        self.fetching.append(_Fetch(request, handle, wanted, ids))
        return True

    def poll(self) -> list[Request]:
        """Requests whose fetch ended, in the order they started, ready to compute the rest."""
        self._poll_offers()
        ready, kept = [], []
        for f in self.fetching:
            if not f.handle.done():
                kept.append(f)
                continue
            n = f.handle.wait(0)
            if f.cancelled:
                self.pool.free(f.ids)
                continue
            self._settle(f, n)
            ready.append(f.request)
        self.fetching = kept
        return ready

    def _settle(self, f: _Fetch, n: int) -> None:
        request = f.request
        if n < len(f.ids):
            self.pool.free(f.ids[n:])
            del request.blocks[len(request.blocks) - len(f.ids) + n:]
        if n:
            self.pool.commit(f.ids[:n], f.hashes[:n])
        request.hashes += f.hashes[:n]
        request.num_computed = len(request.blocks) * self.block_size
        request.num_stored += n * self.block_size
        request.num_cached += n * self.block_size
        request.state = RequestState.WAITING

    def cancel(self, request: Request) -> bool:
        """Drops a fetching request; its blocks come back once the store stopped writing
        them. False when it is not fetching."""
        for f in self.fetching:
            if f.request is request and not f.cancelled:
                f.cancelled = True
                request.blocks = request.blocks[:len(request.blocks) - len(f.ids)]
                return True
        return False

    def offer(self, request: Request) -> None:
        """Stores a request's full blocks (those with a hash), holding them until copied."""
        ids = request.blocks[:len(request.hashes)]
        if not ids:
            return
        self.pool.share(ids)
        self._offers.append((self.store.put(request.hashes, self.cache, ids), ids))

    def _poll_offers(self) -> None:
        kept = []
        for handle, ids in self._offers:
            if handle.done():
                self.pool.free(ids)
            else:
                kept.append((handle, ids))
        self._offers = kept

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= _OBSERVE_MIN_TOKENS:
            self.store.observe_prefill(num_tokens, seconds)

    def wait_fetch(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the oldest fetch to end (an idle engine's
        step, instead of spinning)."""
        if self.fetching:
            try:
                self.fetching[0].handle.wait(timeout)
            except TimeoutError:
                pass

    def drain(self, timeout: float) -> None:
        """Waits for every fetch and offer (before the cache goes away)."""
        for f in self.fetching:
            f.handle.wait(timeout)
        for handle, _ in self._offers:
            handle.wait(timeout)
        self.poll()
