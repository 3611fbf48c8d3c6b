"""BlockPool: which blocks a request owns — ids, reference counts and the prefix cache.

The allocator is C++ (``csrc/memory/block_pool.h``); every call takes the pool's lock and
releases the GIL, so one pool may be shared by threads. This module is its Python face, with
the two functions that go with it: ``block_hashes`` (the prefix cache's keys) and ``runs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmove import _C

__all__ = ["BlockPool", "block_hashes", "prefix_hashes", "runs"]


class BlockPool:
    """A fixed pool of ``num_blocks`` equal blocks with ids ``0..num_blocks-1``.

    It owns no memory (a ``KVCache`` has one for its blocks). A block is *free* (ref 0),
    *cached* (ref 0, carries a hash: evictable, revived by ``match``) or *used* (ref > 0).

    Example:
        >>> pool = kvmove.BlockPool(1024)
        >>> ids = pool.allocate(250)          # list[int], or None when 250 are not free now
        >>> pool.commit(ids[:2], kvmove.block_hashes(range(32), 16))
        >>> pool.free(ids)                    # the two committed blocks stay cached

    Args:
        num_blocks: blocks in the pool, in ``[1, 2**31)``.
    """

    __slots__ = ("_core", "_owner")

    def __init__(self, num_blocks: int) -> None:
        self._core = _C.BlockPool(num_blocks)
        self._owner: Any = None

    @classmethod
    def _of(cls, core: _C.BlockPool, owner: Any) -> BlockPool:
        """The pool of a core ``KVCache``, keeping ``owner`` (its cache) alive."""
        pool = cls.__new__(cls)
        pool._core, pool._owner = core, owner
        return pool

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def num_free(self) -> int:
        """Free plus cached (evictable) blocks: what ``allocate`` can hand out now."""
        return self._core.num_free

    @property
    def num_used(self) -> int:
        return self._core.num_used

    @property
    def num_cached(self) -> int:
        """Freed blocks that carry a hash, kept until evicted."""
        return self._core.num_cached

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with reference count 1, in as few runs of consecutive ids as possible.

        All-or-nothing. Evicts least recently used cached blocks when free ones are not enough.

        Returns:
            The ids, or ``None`` when fewer than ``n`` are free right now (back-pressure).

        Raises:
            ConfigError: ``n < 1`` or ``n > num_blocks``.
        """
        return self._core.allocate(n)

    def free(self, ids: Sequence[int]) -> None:
        """Drops one reference per occurrence of each id.

        At zero a block with a hash becomes cached (LRU: the list's last block is evicted
        first); one without returns to the free runs.

        Raises:
            BlockError: an id out of range, a free block, or more frees than references
                (nothing is freed then).
        """
        self._core.free(ids)  # type: ignore[arg-type]  # _C.pyi: any sequence, named list

    def share(self, ids: Sequence[int]) -> None:
        """Adds one reference per occurrence of each id (prefix sharing between requests).

        Raises:
            BlockError: an id that is not allocated.
        """
        self._core.share(ids)  # type: ignore[arg-type]  # _C.pyi: any sequence, named list

    def commit(self, ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Tags used blocks with content hashes (``block_hashes``) so that, once freed, they
        stay cached and ``match`` finds them. A hash already held by another block is left to
        that block.

        Raises:
            ConfigError: ``len(ids) != len(hashes)``.
            BlockError: an id out of range, not allocated, or tagged with another hash.
        """
        self._core.commit(ids, list(hashes))  # type: ignore[arg-type]  # as in free()

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Ids of the longest cached prefix of ``hashes``, each with one new reference (the
        caller frees them like allocated blocks)."""
        return self._core.match(list(hashes))

    def ref_count(self, block_id: int) -> int:
        return self._core.ref_count(block_id)

    def block_hash(self, block_id: int) -> int | None:
        """The hash committed to block ``block_id``, or None."""
        return self._core.block_hash(block_id)

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free}, "
                f"used={self.num_used}, cached={self.num_cached})")


def block_hashes(token_ids: Sequence[int] | Any, block_size: int,
                 parent: int | None = None, *, seed: int = 0) -> list[int]:
    """Chained 64-bit content hashes of the full blocks of ``token_ids``.

    Block i's hash is XXH64 of its parent's hash and its tokens (little-endian int64), so equal
    hashes mean equal prefixes; a trailing partial block gets none. Pass the result to
    ``BlockPool.commit`` / ``BlockPool.match``, or use it as a ``KVStore`` key.

    Args:
        token_ids: ``[num_tokens]`` integer ids (list or array; converted to int64).
        block_size: tokens per block.
        parent: hash of the block before ``token_ids[0]``, or None at a sequence's start.
        seed: 0 for the plain chain. A secret seed (``DeploymentKey.hash_seed()``) makes the
            hashes unpredictable to anyone without it: then no one can craft two prompts
            whose blocks collide in a shared prefix cache or store (vLLM's CVE-2025-25183
            class). Every process sharing a cache or store must use the same seed.

    Example:
        >>> len(kvmove.block_hashes(range(40), 16))   # 2 full blocks, 8 tokens left over
        2
    """
    return _C.block_hashes(token_ids, block_size, parent, seed)


def prefix_hashes(tokens: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """The hashes a prompt's cached prefix is looked up by: its full blocks, leaving at least
    one token to compute (its logits give the next token). The one definition, shared by the
    engine scheduler's match and ``kvmove-serve``'s KV-aware routers (in front of its own
    engine and of vLLM), which must hash as it does."""
    usable = (len(tokens) - 1) // block_size
    if usable <= 0:
        return []
    return block_hashes(tokens[:usable * block_size], block_size, seed=seed)


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ascending ids as ``(first, count)`` runs, in order.

    Example:
        >>> kvmove.runs([4, 5, 6, 9, 2, 3])
        [(4, 3), (9, 1), (2, 2)]
    """
    return _C.runs(list(ids))
