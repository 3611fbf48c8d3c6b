"""Tensor parallelism between a prefill and a decode: which KV heads each rank holds, which
prefill ranks a decode rank loads from, and how a prefill rank tells apart the decode ranks
that load the same request from it. Plain arithmetic, no vLLM.

vLLM splits the model's KV heads evenly: rank ``r`` of ``tp`` holds heads
``[r * total / tp, (r + 1) * total / tp)``. With equal TP a decode rank loads from the prefill
rank of its own number, an identical peer. With unequal TP it loads from every prefill rank
whose heads it needs, each through a ``kvmove.StagingArea`` in that rank's layout, converted
into its own heads on arrival::

    TP 2 -> 1:  decode 0 <- prefill 0 (heads [0, 2) of 4) + prefill 1 (heads [2, 4))
    TP 1 -> 2:  decode 0 <- prefill 0 (all 4 heads, keeps [0, 2)), decode 1 <- prefill 0 (keeps
                [2, 4)): prefill 0 streams the request twice, once per offer

A prefill rank that several decode ranks load from must hold the request's blocks until each
has been served: each decode rank offers under ``share_key(key, i, n)`` (share ``i`` of ``n``),
and the prefill counts the shares (``parse_share``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import ConfigError

__all__ = ["Source", "parse_share", "rank_heads", "share_key", "sources"]

SHARE_MARK = "#kvmove-share="


def rank_heads(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(first, count)``: the KV heads rank ``rank`` of ``tp_size`` holds of the model's
    ``total``.

    Raises:
        ConfigError: ``tp_size`` does not divide ``total`` (vLLM then replicates heads across
            ranks, which kvmove does not pair across unequal TP).
    """
    if total % tp_size:
        raise ConfigError(f"tensor parallelism {tp_size} does not split the model's {total} KV "
                          f"heads evenly (vLLM replicates them): kvmove pairs such ranks only "
                          f"with a peer of the same tensor parallelism")
    count = total // tp_size
    return rank * count, count


@dataclass(frozen=True)
class Source:
    """A prefill rank a decode rank loads a request from."""

    rank: int                  # the prefill rank: its agent listens on the engine port + rank
    heads: tuple[int, int]     # (first, total): the KV heads it holds, as Agent(kv_heads=)
    num_heads: int             # how many
    share: int                 # this decode rank is share `share` of the `shares` decode
    shares: int                # ranks that load from it


def sources(total: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[Source]:
    """The prefill ranks whose heads decode rank ``decode_rank`` needs, in head order.

    Raises:
        ConfigError: a TP size that does not divide ``total`` (``rank_heads``).
    """
    def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
        return max(a[0], b[0]) < min(a[0] + a[1], b[0] + b[1])

    mine = rank_heads(total, decode_tp, decode_rank)
    found = []
    for rank in range(prefill_tp):
        theirs = rank_heads(total, prefill_tp, rank)
        if overlap(mine, theirs):
            readers = [r for r in range(decode_tp)
                       if overlap(rank_heads(total, decode_tp, r), theirs)]
            found.append(Source(rank, (theirs[0], total), theirs[1],
                                readers.index(decode_rank), len(readers)))
    return found


def share_key(key: str, share: int, shares: int) -> str:
    """The offer key of share ``share`` of ``shares`` decode ranks loading ``key`` from one
    prefill rank; ``key`` itself when it is the only one."""
    return key if shares == 1 else f"{key}{SHARE_MARK}{share}/{shares}"


def parse_share(offer_key: str) -> tuple[str, int, int]:
    """``(key, share, shares)`` of an offer key (``(offer_key, 0, 1)`` for a plain one).

    Raises:
        ConfigError: a share mark that does not parse, or a share out of range.
    """
    key, mark, share_of = offer_key.rpartition(SHARE_MARK)
    if not mark:
        return offer_key, 0, 1
    share, slash, shares = share_of.partition("/")
    if not (slash and share.isdigit() and shares.isdigit()
            and 0 <= int(share) < int(shares) <= 1024):
        raise ConfigError(f"offer key {offer_key!r}: its share must be i/n with 0 <= i < n "
                          f"<= 1024, got {share_of!r}")
    return key, int(share), int(shares)
