"""Writes fuzz/corpus/stream_message/: one valid layer-stream message of every kind (with the
fields each kind may carry: a Layer's checksums, an Offer's block ids, a Final's, Refuse's and
Decline's payload), named by the first 16 hex digits of their SHA-1 as libFuzzer names its
inputs.

    python fuzz/stream_message_seeds.py fuzz/corpus/stream_message   # outside the checkout

Rerun it when the message format changes (the old seeds are of the old version: delete them).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from kvmove import _C

KINDS = ("Begin", "Go", "Refuse", "Layer", "Final", "Ack", "Abort", "Cancel", "Offer",
         "Decline")


def message(kind: str) -> bytes:
    epoch = 0x1234_5678_0000_0002
    ids = [4, 5, 6]
    return _C.encode_stream_message(
        kind, "req-7", epoch, layer=3 if kind == "Layer" else 0, ids_hash=_C.hash_ids(ids),
        checksums=[0xDEAD, 0xBEEF, 0xF00D] if kind == "Layer" else [],
        payload=b"why not" if kind in ("Final", "Refuse", "Decline") else b"",
        block_ids=ids if kind == "Offer" else [])


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        data = message(kind)
        (folder / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


if __name__ == "__main__":
    main(sys.argv[1])
